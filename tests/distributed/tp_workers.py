"""What each rank runs in test_tensor_parallel_dist.py, and the cases it runs.

The parent writes one safetensors checkpoint and a list of cases (``write_cases``); every rank
(``run``) reads only its shards from the file, runs its QuantLinear / QuantMoE on the reference
backend, and combines the ranks' outputs as an engine does: column-parallel outputs are
all-gathered (uneven widths padded to the widest), row-parallel and MoE outputs all-reduced
(summed in float64, with the sum of their magnitudes for the error bound). Rank 0 saves the
combined outputs, every rank the bytes it read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tp_checkpoints import experts, gpt_oss_experts, linear_layer

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.checkpoints import (
    SafetensorsStateDict,
    parse_quant_config,
    read_linear_shard,
    read_moe_shard,
)

FILE = "model.safetensors"
#: Linear kinds run across processes (the in-process tests cover every convention).
LINEAR = ("modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4", "gpt-oss", "fp8-channel", "fp8-block")


def write_cases(folder: Path, world: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The checkpoint (saved to ``folder``) and the cases for ``world`` ranks."""
    g = torch.Generator().manual_seed(100 + world)
    sd: dict[str, torch.Tensor] = {}
    cases: list[dict[str, Any]] = []
    x = torch.randn(5, 288, generator=g).to(torch.bfloat16)
    fp8_block = {"quant_method": "fp8", "weight_block_size": [32, 64]}
    for i, kind in enumerate(LINEAR):
        p = f"model.layers.{i}.proj"
        sd |= linear_layer(kind, p, 162, 288, g)  # uneven N; K: 18 / 9 groups, 4.5 blocks
        cfg = fp8_block if kind == "fp8-block" else None
        for parallel in ("column", "row"):
            cases.append(dict(name=f"{kind}-{parallel}", kind=parallel, prefix=p, config=cfg, x=x))
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        heads = 32 if name == "q_proj" else 8  # head dim 64
        sd |= linear_layer("modelopt-nvfp4", f"attn.{name}", heads * 64, 256, g, gs=0.01 * 0.3**i)
    qkv = [f"attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]
    cases.append(dict(name="qkv-gqa", kind="column", prefix=qkv, heads=(32, 8), x=x[:, :256]))
    sd |= linear_layer("ct-nvfp4", "mlp.gate_proj", 144, 128, g, gs=0.01)
    sd |= linear_layer("ct-nvfp4", "mlp.up_proj", 144, 128, g, gs=0.03)
    sd |= linear_layer("ct-nvfp4", "mlp.down_proj", 128, 144, g)
    cases.append(dict(name="mlp-uneven-I", kind="mlp", prefix="mlp", x=x[:, :128]))
    sd |= experts("modelopt-nvfp4", "moe", 4, 64, 160, g)
    sd |= gpt_oss_experts("oss", 4, 64, 160, g)
    logits = torch.randn(5, 4, generator=g)
    splits = [(world, 1), (1, world)] + ([(2, 2)] if world == 4 else [])
    for prefix, activation in (("moe", "silu"), ("oss", "swiglu_oai")):
        for tp, ep in splits:
            cases.append(
                dict(
                    name=f"{prefix}-tp{tp}-ep{ep}", kind="moe", prefix=prefix, tp=tp, ep=ep,
                    activation=activation, x=x[:, :64], logits=logits,
                )
            )  # fmt: skip
    save_file(sd, str(folder / FILE))
    torch.save(cases, folder / "cases.pt")
    return sd, cases


def _quant(cfg: dict | None, prefix: Any) -> Any:
    if cfg is None:
        return None
    config = parse_quant_config(cfg)
    return config.layer(prefix) if isinstance(prefix, str) else [config.layer(p) for p in prefix]


def _gather_columns(y: torch.Tensor) -> torch.Tensor:
    """All-gather [M, n_r] outputs of uneven widths: pad to the widest, gather, trim."""
    world = dist.get_world_size()
    widths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(widths, torch.tensor([y.shape[1]]))
    widest = max(int(w) for w in widths)
    padded = torch.zeros(y.shape[0], widest, dtype=torch.float64)
    padded[:, : y.shape[1]] = y.double()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:, : int(w)] for p, w in zip(parts, widths, strict=True)], dim=1)


def _k_offset(k: int) -> int:
    """This rank's first input column: the widths of the ranks before it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    widths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(widths, torch.tensor([k]))
    return int(sum(int(w) for w in widths[:rank]))


def _sum(y: torch.Tensor) -> dict[str, torch.Tensor]:
    total, magnitude = y.double(), y.double().abs()
    dist.all_reduce(total)
    dist.all_reduce(magnitude)
    return {"y": total, "abs": magnitude}


def _column(case: dict, sd: Any, rank: int, world: int) -> dict:
    loaded = read_linear_shard(
        sd, case["prefix"], _quant(case.get("config"), case["prefix"]), tp_rank=rank,
        tp_size=world, heads=case.get("heads"),
    )  # fmt: skip
    y = QuantLinear.from_loaded(loaded, device="cpu")(case["x"])
    return {"y": _gather_columns(y), "shape": tuple(loaded.weight.shape)}


def _row(case: dict, sd: Any, rank: int, world: int) -> dict:
    quant = _quant(case.get("config"), case["prefix"])
    loaded = read_linear_shard(
        sd, case["prefix"], quant, tp_rank=rank, tp_size=world, parallel="row"
    )
    k = loaded.weight.shape[1]
    a = _k_offset(k)
    y = QuantLinear.from_loaded(loaded, device="cpu")(case["x"][:, a : a + k].contiguous())
    return {**_sum(y), "shape": tuple(loaded.weight.shape), "bias": loaded.bias is not None}


def _mlp(case: dict, sd: Any, rank: int, world: int) -> dict:
    p = case["prefix"]
    gu = read_linear_shard(
        sd, [f"{p}.gate_proj", f"{p}.up_proj"], tp_rank=rank, tp_size=world, align=16
    )
    down = read_linear_shard(sd, f"{p}.down_proj", tp_rank=rank, tp_size=world, parallel="row")
    h = QuantLinear.from_loaded(gu, device="cpu")(case["x"]).float()
    i = h.shape[1] // 2
    a = (torch.nn.functional.silu(h[:, :i]) * h[:, i:]).to(torch.bfloat16)
    return _sum(QuantLinear.from_loaded(down, device="cpu")(a))


def _moe(case: dict, sd: Any, rank: int, world: int) -> dict:
    tp, ep = case["tp"], case["ep"]
    ep_rank, tp_rank = divmod(rank, tp)
    ids = list(range(ep_rank, 4, ep))  # strided expert ids: several runs to read
    shard = read_moe_shard(
        sd, case["prefix"], num_experts=4, expert_ids=ids, tp_rank=tp_rank, tp_size=tp
    )
    layer = QuantMoE(
        w13=shard.w13, w2=shard.w2, format=shard.format, fp8_block_size=shard.fp8_block_size,
        w13_bias=shard.w13_bias, w2_bias=shard.w2_bias, scheme=shard.scheme,
        expert_ids=shard.expert_ids, num_experts=4, top_k=2, activation=case["activation"],
        device="cpu",
    )  # fmt: skip
    return {**_sum(layer(case["x"], case["logits"])), "intermediate": shard.intermediate}


_RUNNERS = {"column": _column, "row": _row, "mlp": _mlp, "moe": _moe}


def run(rank: int, world: int, folder: str) -> None:
    """One rank: every case, then its results to ``folder/rank{rank}.pt``."""
    root = Path(folder)
    sd = SafetensorsStateDict(root / FILE)
    out = {}
    for case in torch.load(root / "cases.pt"):
        before = sd.bytes_read
        result = _RUNNERS[case["kind"]](case, sd, rank, world)
        result["bytes_read"] = sd.bytes_read - before
        if rank:  # the combined outputs are rank 0's to save
            result = {k: v for k, v in result.items() if k not in ("y", "abs")}
        out[case["name"]] = result
    torch.save(out, root / f"rank{rank}.pt")

"""What each rank runs in test_tensor_parallel_dist.py, and the cases it runs.

The parent writes one safetensors checkpoint and a list of cases (``write_cases``); every rank
(``run``) builds its layers through the layer API (``QuantLinear.from_checkpoint`` /
``load_linear`` / ``QuantMoE.from_checkpoint`` with ``tp_rank`` / ``tp_size``), which reads only
its shards from the file, runs them (QuantLinear / QuantMoE on the reference backend, unquantized
layers as nn.Linear), and combines the ranks' outputs as an engine does: column-parallel outputs are
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
from quantdispatch.checkpoints import SafetensorsStateDict
from quantdispatch.layers import load_linear

FILE = "model.safetensors"
#: A quant config that leaves the dense.* layers unquantized (load_linear: nn.Linear).
DENSE = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["dense.*"]}}
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
    sd["dense.qkv.weight"] = torch.randn(3 * 96, 288, generator=g).to(torch.bfloat16)
    sd["dense.qkv.bias"] = torch.randn(3 * 96, generator=g).to(torch.bfloat16)
    sd["dense.o.weight"] = torch.randn(96, 288, generator=g).to(torch.bfloat16)
    sd["dense.o.bias"] = torch.randn(96, generator=g).to(torch.bfloat16)
    cases.append(
        dict(name="dense-qkv-gqa", kind="column", prefix="dense.qkv", config=DENSE, x=x,
             heads=(4, 4), segments=[96, 96, 96])
    )  # fmt: skip
    cases.append(dict(name="dense-row", kind="row", prefix="dense.o", config=DENSE, x=x))
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


def _layer(case: dict, sd: Any, rank: int, world: int, **kw: Any) -> Any:
    """This rank's layer, through the layer API (nn.Linear for an unquantized one)."""
    return load_linear(
        sd, case["prefix"], case.get("config"), tp_rank=rank, tp_size=world,
        heads=case.get("heads"), segments=case.get("segments"), device="cpu", **kw,
    )  # fmt: skip


def _column(case: dict, sd: Any, rank: int, world: int) -> dict:
    layer = _layer(case, sd, rank, world)
    y = layer(case["x"])
    return {"y": _gather_columns(y), **_shape(layer)}


def _shape(layer: Any) -> dict:
    return {"shape": (layer.out_features, layer.in_features)}


def _row(case: dict, sd: Any, rank: int, world: int) -> dict:
    layer = _layer(case, sd, rank, world, parallel="row")
    k = layer.in_features
    a = _k_offset(k)
    y = layer(case["x"][:, a : a + k].contiguous())
    return {**_sum(y), **_shape(layer), "bias": layer.bias is not None}


def _mlp(case: dict, sd: Any, rank: int, world: int) -> dict:
    p, tp = case["prefix"], dict(tp_rank=rank, tp_size=world, device="cpu")
    gate_up = QuantLinear.from_checkpoint(sd, [f"{p}.gate_proj", f"{p}.up_proj"], align=16, **tp)
    down = QuantLinear.from_checkpoint(sd, f"{p}.down_proj", parallel="row", align=16, **tp)
    h = gate_up(case["x"]).float()
    i = h.shape[1] // 2
    a = (torch.nn.functional.silu(h[:, :i]) * h[:, i:]).to(torch.bfloat16)
    return _sum(down(a))


def _moe(case: dict, sd: Any, rank: int, world: int) -> dict:
    tp, ep = case["tp"], case["ep"]
    ep_rank, tp_rank = divmod(rank, tp)
    ids = list(range(ep_rank, 4, ep))  # strided expert ids: several runs to read
    layer = QuantMoE.from_checkpoint(
        sd, case["prefix"], num_experts=4, top_k=2, activation=case["activation"],
        expert_ids=ids, tp_rank=tp_rank, tp_size=tp, device="cpu",
    )  # fmt: skip
    y = layer(case["x"], case["logits"])
    return {**_sum(y), "intermediate": (tp_rank, layer.intermediate_size)}


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

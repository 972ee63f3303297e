#!/usr/bin/env python3
"""Tensor- and expert-parallel layers across processes: outputs against the unsharded layer in
float64, and the decode time of a tensor-parallel MLP pair against bf16 on the same GPUs.

Cases, each rank loading only its shard from one safetensors checkpoint (compressed-tensors
NVFP4, written by rank 0 with random codes and scales):

- a Llama-3-70B MLP pair (hidden 8192, intermediate 28672): gate/up column parallel, down row
  parallel, the partial outputs all-reduced as an engine does;
- a Qwen3-30B-A3B MoE layer (128 experts, top 8, hidden 2048, expert intermediate 768), the
  experts split over the ranks (expert parallel), partial outputs all-reduced.

Rank 0 compares every combined output (M = 1, 16, 100) with the float64 result of the whole
layer (gate and up merged under one global scale, as the layer loads them, then dequantized).
With NCCL on CUDA it then times the MLP pair, gate/up -> SiLU-and-mul -> down -> all-reduce, at
M = 1 and 16 inside a CUDA graph against the same pair with bf16 weight shards (F.linear) on
the same GPUs.

    torchrun --nproc_per_node 2 benchmarks/tp_nccl.py --out DIR             # one rank per GPU
    torchrun --nproc_per_node 2 benchmarks/tp_nccl.py --backend gloo --small --device cpu

With ``--backend gloo`` on CUDA several ranks may share one GPU (outputs only, no timing). The
CPU form is what tests/distributed/test_tp_nccl_script.py runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # tp_checkpoints: checkpoint tensors

SHAPES = {
    "full": dict(hidden=8192, inter=28672, experts=128, top_k=8, moe_hidden=2048, moe_inter=768),
    "small": dict(hidden=256, inter=640, experts=8, top_k=2, moe_hidden=128, moe_inter=96),
}
MS = (1, 16, 100)
TIMED_MS = (1, 16)
#: Relative Frobenius error allowed against float64: the bf16 rounding of the gate/up output
#: and of each layer's output (2^-9 relative each) with room for summation order.
BOUND = 1e-2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    p.add_argument("--work", default="/tmp/qd-tp-nccl", help="folder for the checkpoint")
    p.add_argument("--out", default=None, help="folder for tp-<backend>-<date>.json / .md")
    return p.parse_args(argv)


def write_checkpoint(folder: Path, s: dict[str, int]) -> None:
    from safetensors.torch import save_file
    from tp_checkpoints import experts, linear_layer

    g = torch.Generator().manual_seed(7)
    sd: dict[str, torch.Tensor] = {}
    for name, n, k in (("gate_proj", s["inter"], s["hidden"]), ("up_proj", s["inter"], s["hidden"]),
                       ("down_proj", s["hidden"], s["inter"])):  # fmt: skip
        gs = {"gate_proj": 0.011, "up_proj": 0.017, "down_proj": 0.013}[name]
        sd |= linear_layer("ct-nvfp4", f"mlp.{name}", n, k, g, gs=gs, bias=False)
    sd |= experts("ct-nvfp4", "moe", s["experts"], s["moe_hidden"], s["moe_inter"], g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))


def nvfp4(sd: Any, prefix: str, device: torch.device) -> Any:
    """A compressed-tensors NVFP4 weight of the checkpoint as an Nvfp4Weight, read by hand from
    the format's tensor names (not by the checkpoint reader the layers use, so the reference
    does not share its code)."""
    from quantdispatch.formats.nvfp4 import Nvfp4Weight, global_scale_from_compressed_tensors

    return Nvfp4Weight(
        packed=sd[f"{prefix}.weight_packed"].to(device),
        block_scale=sd[f"{prefix}.weight_scale"].to(device),
        global_scale=global_scale_from_compressed_tensors(
            sd[f"{prefix}.weight_global_scale"].to(device)
        ),
    )


def whole64(sd: Any, prefix: str, device: torch.device) -> list[torch.Tensor]:
    """The unsharded layer's weights in float64: gate and up of the fused gate/up layer (merged
    under one global scale, as the layer loads them, then split), and down."""
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, merge_nvfp4_shards

    fused = merge_nvfp4_shards(
        [nvfp4(sd, f"{prefix}.{n}", device) for n in ("gate_proj", "up_proj")]
    )
    w13 = dequantize_nvfp4(fused, dtype=torch.float64)
    i = w13.shape[0] // 2
    down = dequantize_nvfp4(nvfp4(sd, f"{prefix}.down_proj", device), dtype=torch.float64)
    return [w13[:i], w13[i:], down]


def swiglu64(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ gate.T) * (x @ up.T)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def mlp_layers(sd: Any, rank: int, world: int, device: torch.device) -> tuple[Any, Any]:
    from quantdispatch import QuantLinear

    tp = dict(tp_rank=rank, tp_size=world, device=device)
    gate_up = QuantLinear.from_checkpoint(sd, ["mlp.gate_proj", "mlp.up_proj"], **tp)
    down = QuantLinear.from_checkpoint(sd, "mlp.down_proj", parallel="row", **tp)
    return gate_up, down


def swiglu(h: torch.Tensor) -> torch.Tensor:
    i = h.shape[1] // 2
    return (F.silu(h[:, :i].float()) * h[:, i:].float()).to(h.dtype)


def check_mlp(sd: Any, rank: int, world: int, device: torch.device, s: dict) -> list[dict]:
    gate_up, down = mlp_layers(sd, rank, world, device)
    rows = []
    ref = None
    if rank == 0:
        ref = whole64(sd, "mlp", device)
    for m in MS:
        x = _x(m, s["hidden"], device, seed=m)
        y = down(swiglu(gate_up(x))).float()
        dist.all_reduce(y)
        if rank == 0:
            assert ref is not None
            want = swiglu64(x.double(), ref[0], ref[1]) @ ref[2].T
            case = f"MLP pair, hidden {s['hidden']}, intermediate {s['inter']}, column + row"
            rows.append(_row(case, m, gate_up, down, y, want, world))
    return rows


def check_moe(sd: Any, rank: int, world: int, device: torch.device, s: dict) -> list[dict]:
    from quantdispatch import QuantMoE

    e = s["experts"]
    ids = list(range(rank * e // world, (rank + 1) * e // world))
    layer = QuantMoE.from_checkpoint(
        sd, "moe", num_experts=e, top_k=s["top_k"], expert_ids=ids, device=device
    )
    rows = []
    for m in MS:
        x = _x(m, s["moe_hidden"], device, seed=100 + m)
        g = torch.Generator().manual_seed(200 + m)
        logits = torch.randn(m, e, generator=g).to(device)
        y = layer(x, logits).float()
        dist.all_reduce(y)
        if rank == 0:
            want = _moe64(sd, x.double(), *layer.route(logits), device)
            rows.append(
                dict(case=f"MoE {e} experts, top {s['top_k']}, experts split over {world} ranks",
                     m=m, shard=f"{len(ids)} experts", rel_error=rel(y, want), bound=BOUND)
            )  # fmt: skip
    return rows


def _moe64(
    sd: Any, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, device: torch.device
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in sorted(set(ids.flatten().tolist())):
        gate, up, down = whole64(sd, f"moe.experts.{e}", device)
        t, k = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, t, weights[t, k].double()[:, None] * (swiglu64(x[t], gate, up) @ down.T))
    return out


def _x(m: int, k: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)


def _row(
    case: str, m: int, a: Any, b: Any, y: torch.Tensor, want: torch.Tensor, world: int
) -> dict:
    shard = f"{a.out_features}x{a.in_features} + {b.out_features}x{b.in_features} per rank"
    return dict(case=case, m=m, shard=shard, rel_error=rel(y, want), bound=BOUND, ranks=world)


def time_mlp(sd: Any, rank: int, world: int, device: torch.device, s: dict) -> list[dict]:
    """us per MLP pair step (all-reduce included), NVFP4 vs bf16 shards, in a CUDA graph."""
    gate_up, down = mlp_layers(sd, rank, world, device)
    g = torch.Generator(device=device).manual_seed(rank)
    w13 = torch.randn(gate_up.out_features, gate_up.in_features, generator=g, device=device)
    w2 = torch.randn(down.out_features, down.in_features, generator=g, device=device)
    w13, w2 = (w13 * 0.02).to(torch.bfloat16), (w2 * 0.02).to(torch.bfloat16)
    steps = {
        "nvfp4": lambda x: down(swiglu(gate_up(x))),
        "bf16": lambda x: F.linear(swiglu(F.linear(x, w13)), w2),
    }
    rows = []
    for m in TIMED_MS:
        x = _x(m, s["hidden"], device, seed=m)
        row: dict[str, Any] = dict(m=m)
        for name, fn in steps.items():
            row[f"{name}_us"] = _graph_us(fn, x, device)
        row["speedup"] = row["bf16_us"] / row["nvfp4_us"]
        row["nvfp4_weight_bytes_per_rank"] = gate_up.device_bytes() + down.device_bytes()
        row["bf16_weight_bytes_per_rank"] = (w13.numel() + w2.numel()) * 2
        rows.append(row)
    return rows


def _graph_us(fn: Any, x: torch.Tensor, device: torch.device, reps: int = 20) -> float:
    """Median us per step over graph replays (``reps`` steps per graph), slowest rank."""

    def body() -> None:
        for _ in range(reps):
            y = fn(x)
            dist.all_reduce(y)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        body()  # warm-up: kernels compile, NCCL connects
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    times = []
    for _ in range(15):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / reps)
    slowest = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def worker(rank: int, world: int, argv: list[str]) -> dict[str, Any] | None:
    """One rank (inside an initialized process group). Rank 0 returns and writes the report."""
    from quantdispatch.checkpoints import SafetensorsStateDict

    args = parse_args(argv)
    s = SHAPES["small" if args.small else "full"]
    if args.device == "cuda":
        ngpu = torch.cuda.device_count()
        device = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    work = Path(args.work)
    if rank == 0:
        write_checkpoint(work, s)
    dist.barrier()
    sd = SafetensorsStateDict(work / "model.safetensors")
    rows = check_mlp(sd, rank, world, device, s) + check_moe(sd, rank, world, device, s)
    timed = []
    if args.backend == "nccl" and device.type == "cuda":
        timed = time_mlp(sd, rank, world, device, s)
    if rank != 0:
        return None
    report = dict(
        backend=args.backend, ranks=world, shapes=s, checks=rows, timing=timed,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )  # fmt: skip
    report["all_within_bound"] = all(r["rel_error"] < r["bound"] for r in rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"tp-{args.backend}-{world}x-{dt.date.today():%Y-%m-%d}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        stem.with_suffix(".md").write_text(render(report), encoding="utf-8")
    print(render(report), flush=True)
    return report


def render(r: dict[str, Any]) -> str:
    lines = [
        f"# Tensor / expert parallel across {r['ranks']} ranks ({r['backend']}, {r['device']})",
        "",
        f"torch {r['torch']}, {r['date']}. Error: relative Frobenius error of the all-reduced "
        f"output against the whole layer in float64 (bound {BOUND}).",
        "",
        "| case | M | shard | rel. error | within bound |",
        "|---|---|---|---|---|",
    ]
    for c in r["checks"]:
        ok = "yes" if c["rel_error"] < c["bound"] else "NO"
        lines.append(f"| {c['case']} | {c['m']} | {c['shard']} | {c['rel_error']:.2e} | {ok} |")
    if r["timing"]:
        head = (
            "MLP pair step (gate/up, SiLU-and-mul, down, all-reduce), us, CUDA graph, slowest rank:"
        )
        lines += ["", head, "", "| M | NVFP4 | bf16 | speed-up |", "|---|---|---|---|"]
        for t in r["timing"]:
            lines.append(
                f"| {t['m']} | {t['nvfp4_us']:.1f} | {t['bf16_us']:.1f} | {t['speedup']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(args.backend)
    try:
        report = worker(rank, world, sys.argv[1:])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if report is not None and not report["all_within_bound"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

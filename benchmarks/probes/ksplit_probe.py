#!/usr/bin/env python3
"""The K split of the 8-pair-block MoE kernels on experts whose K is 44 / 45 / 46 / 64 chunks.

Session 15's question: why gpt-oss (H = I = 2880, 45 chunks of 64) ran faster with no K split
while DeepSeek-V3 and Mixtral need theirs. Each point times the heuristic's pick and every
(gate/up, down) pair of splits twice, interleaved (run-to-run spread next to the differences),
after checking each against the reference. H200 log:
benchmarks/results/ksplit-probe-h200-2026-11-30.log.

    PYTHONPATH=$PWD python3 benchmarks/probes/ksplit_probe.py
    # other points (FORMAT:E,TOPK,H,I:M) and splits (WTxWKxUNROLL) per GEMM:
    PYTHONPATH=$PWD python3 benchmarks/probes/ksplit_probe.py --points mxfp4:32,4,2880,2880:4 \
        --gate-up 1x1x2,1x4x1 --down 1x1x2

Session 16 used it for the few-program regime
(benchmarks/results/ksplit-probe-h200-2026-11-30-few.log).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import moe as bench  # benchmarks/moe.py: Layer, timing, reference

from quantdispatch.kernels.common.moe_plan import (
    MmaGemmConfig,
    MmaMoeConfig,
    mma_moe_config,
)
from quantdispatch.kernels.mma_layout.moe_plan import small_moe_config

Point = tuple[str, int, int, int, int, int]  # format, experts, top-k, H, I, M
Split = tuple[int, int, int]  # warps side by side, K split, chunks in flight

#: gpt-oss-120b / 20b shapes and neighbours of their K (H = I)
POINTS: list[Point] = [("mxfp4", 128, 4, h, h, 16) for h in (2880, 2944, 2816)] + [
    ("mxfp4", 32, 4, 2880, 2880, 4), ("mxfp4", 32, 4, 2944, 2944, 4),
    ("nvfp4", 128, 4, 2880, 2880, 16), ("nvfp4", 128, 4, 4096, 4096, 16)]  # fmt: skip
SPLITS: list[Split] = [(1, 1, 2), (1, 2, 2), (1, 4, 1)]


def parse_point(text: str) -> Point:
    """``FORMAT:E,TOPK,H,I:M`` -> a point; a malformed one raises ValueError naming it."""
    try:
        fmt, dims, m = text.split(":")
        e, top_k, h, i = (int(v) for v in dims.split(","))
        point = (fmt, e, top_k, h, i, int(m))
    except ValueError:
        raise ValueError(
            f"--points {text!r}: expected FORMAT:E,TOPK,H,I:M, e.g. mxfp4:32,4,2880,2880:4"
        ) from None
    if fmt not in ("nvfp4", "mxfp4") or min(point[1:]) < 1 or top_k > e or h % 64 or i % 64:
        raise ValueError(
            f"--points {text!r}: FORMAT is nvfp4 or mxfp4, every number positive, TOPK <= E, "
            f"H and I multiples of 64"
        )
    return point


def parse_split(text: str) -> Split:
    """``WTxWKxUNROLL`` (e.g. ``1x4x1``) -> a split; a malformed one raises ValueError."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"split {text!r}: expected WTxWKxUNROLL of positive integers, e.g. 1x4x1")
    wt, wk, unroll = (int(p) for p in parts)
    return wt, wk, unroll


def probe(
    point: Point,
    gate_up: list[Split],
    down: list[Split],
    gen: torch.Generator,
    direct: bool = False,
) -> None:
    """Times the pick, 8-pair blocks with every (gate/up, down) split, one block per pair
    (``direct``: with every split too, else with 1x1x2 on both) and, with ``direct``, the
    single-pair kernels with the top-k sum in down, as the plan would configure them."""
    fmt, e, top_k, h, i, m = point
    layer = bench.Layer(e, top_k, h, i, torch.device("cuda"), seed=1, fmt=fmt)
    del layer.d13, layer.d2  # only the repacked path runs here
    inputs = layer.routings(m, bench.ROUTINGS, gen)
    ref = layer.reference(*inputs[0])
    pick = layer.config(m)
    cfgs = [pick] + [
        MmaMoeConfig(1, MmaGemmConfig(*g1), MmaGemmConfig(*g2), False)
        for g1 in gate_up
        for g2 in down
    ]
    if direct:
        cfgs += [
            MmaMoeConfig(1, MmaGemmConfig(*g1), MmaGemmConfig(*g2), True)
            for g1 in gate_up
            for g2 in down
        ]
        per_pair = mma_moe_config(m * top_k, e, i, h, direct=True, repacked=True).gemm1
        cfgs.append(small_moe_config(m, top_k, i, h, per_pair.wk, per_pair.unroll, pdl=True))
    else:
        cfgs.append(MmaMoeConfig(1, MmaGemmConfig(1, 1, 2), MmaGemmConfig(1, 1, 2), True))
    times: dict = {c: [] for c in dict.fromkeys(cfgs)}
    for _ in range(2):
        for cfg in times:
            err = bench.rel_err(layer.nvfp4(*inputs[0], config=cfg), ref)
            if err >= bench.BOUND:
                raise AssertionError(f"{cfg}: relative error {err:.2e} >= {bench.BOUND}")
            calls = [lambda a=a, b=b, c=c, cfg=cfg: layer.nvfp4(a, b, c, cfg) for a, b, c in inputs]
            times[cfg].append(bench.time_graph(calls, target_s=0.1))
    print(f"== {fmt} E={e} top{top_k} H={h} I={i} ({h // 64} / {i // 64} chunks) M={m}",
          flush=True)  # fmt: skip
    for cfg, ts in sorted(times.items(), key=lambda kv: min(kv[1])):
        mark = "pick " if cfg == pick else "     "
        print(f"  {mark}{' / '.join(f'{t:7.1f}' for t in ts)}  {bench.config_dict(cfg)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", help="FORMAT:E,TOPK,H,I:M;... (default: the gpt-oss set)")
    ap.add_argument("--gate-up", help="WTxWKxUNROLL,... for gate/up (default 1x1x2,1x2x2,1x4x1)")
    ap.add_argument("--down", help="WTxWKxUNROLL,... for down (default 1x1x2,1x2x2)")
    ap.add_argument(
        "--direct",
        action="store_true",
        help="also one block per pair with every split, and the top-k-sum kernels",
    )
    args = ap.parse_args()
    try:
        points = [parse_point(p) for p in args.points.split(";")] if args.points else POINTS
        gate_up = [parse_split(s) for s in args.gate_up.split(",")] if args.gate_up else SPLITS
        down = [parse_split(s) for s in args.down.split(",")] if args.down else SPLITS[:2]
    except ValueError as exc:
        ap.error(str(exc))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for point in points:
        probe(point, gate_up, down, gen, direct=args.direct)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The K split of the 8-pair-block MoE kernels on experts whose K is 44 / 45 / 46 / 64 chunks.

Session 15's question: why gpt-oss (H = I = 2880, 45 chunks of 64) ran faster with no K split
while DeepSeek-V3 and Mixtral need theirs. Each point times the heuristic's pick and every
(gate/up, down) pair of splits twice, interleaved (run-to-run spread next to the differences),
after checking each against the reference. H200 log: results/ksplit-probe-h200-2026-11-30.log.

    PYTHONPATH=$PWD python3 benchmarks/ksplit_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe as bench  # benchmarks/moe.py: Layer, timing, reference

from quantdispatch.kernels.fp4_mma_ckpt import MmaGemmConfig, MmaMoeConfig

#: (format, experts, top-k, H = I, M): gpt-oss-120b / 20b shapes and neighbours of their K
POINTS = [("mxfp4", 128, 4, 2880, 16), ("mxfp4", 128, 4, 2944, 16), ("mxfp4", 128, 4, 2816, 16),
          ("mxfp4", 32, 4, 2880, 4), ("mxfp4", 32, 4, 2944, 4), ("nvfp4", 128, 4, 2880, 16),
          ("nvfp4", 128, 4, 4096, 16)]  # fmt: skip
#: (warps side by side, K split, chunks in flight) per GEMM
SPLITS = [(1, 1, 2), (1, 2, 2), (1, 4, 1)]


def probe(fmt: str, e: int, top_k: int, h: int, m: int, gen: torch.Generator) -> None:
    layer = bench.Layer(e, top_k, h, h, torch.device("cuda"), seed=1, fmt=fmt)
    del layer.d13, layer.d2  # only the repacked path runs here
    inputs = layer.routings(m, bench.ROUTINGS, gen)
    ref = layer.reference(*inputs[0])
    pick = layer.config(m)
    cfgs = [pick] + [
        MmaMoeConfig(1, MmaGemmConfig(*g1), MmaGemmConfig(*g2), False)
        for g1 in SPLITS
        for g2 in SPLITS[:2]
    ]
    cfgs.append(MmaMoeConfig(1, MmaGemmConfig(1, 1, 2), MmaGemmConfig(1, 1, 2), True))
    times: dict = {c: [] for c in dict.fromkeys(cfgs)}
    for _ in range(2):
        for cfg in times:
            err = bench.rel_err(layer.nvfp4(*inputs[0], config=cfg), ref)
            if err >= bench.BOUND:
                raise AssertionError(f"{cfg}: relative error {err:.2e} >= {bench.BOUND}")
            calls = [lambda a=a, b=b, c=c, cfg=cfg: layer.nvfp4(a, b, c, cfg) for a, b, c in inputs]
            times[cfg].append(bench.time_graph(calls, target_s=0.1))
    print(f"== {fmt} E={e} top{top_k} H=I={h} ({h // 64} chunks) M={m}", flush=True)
    for cfg, ts in sorted(times.items(), key=lambda kv: min(kv[1])):
        mark = "pick " if cfg == pick else "     "
        print(f"  {mark}{' / '.join(f'{t:7.1f}' for t in ts)}  {bench.config_dict(cfg)}")


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for point in POINTS:
        probe(*point, gen)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

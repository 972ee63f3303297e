#!/usr/bin/env python3
"""Program shapes of the FP8 prefill re-encoder on the mma16x64 layout (what per-call FP8
prefill runs for a triton-backend weight), on the GPU.

Per Llama shape and recipe (128x128 weight blocks; 1x128), each (rows per program, warps)
variant re-encodes an NVFP4 weight in the layout QuantLinear holds (bf16 packing); the codes
and scales must equal the default variant's bit for bit before it is timed. Rate = FP4 bytes
read (0.5625 B per weight with the scales) + e4m3 written (1 B), per second. Timing as
benchmarks/linear.py (median of CUDA-graph replays, weights rotated past L2).

    PYTHONPATH=$PWD python3 benchmarks/probes/fp8_reencode_sweep.py [--models 8b,70b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from fp8_prefill_report import SHAPES
from linear import time_rotated

ROTATE_BYTES = 256 << 20
VARIANTS = {
    "128x128": [(32, None), (32, 2), (32, 4), (32, 16)],
    "1x128": [(32, None), (16, 2), (16, 4), (32, 2), (32, 8), (64, 4), (64, 8), (128, 8)],
}


def main() -> int:
    from quantdispatch.formats.nvfp4 import quantize_nvfp4
    from quantdispatch.kernels.mma_layout.layout import repack
    from quantdispatch.kernels.native import fp8_prefill as fp8p
    from quantdispatch.kernels.native.fp8_prefill_mma import reencode_mma_triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            g = torch.Generator(device="cuda").manual_seed(n + k)
            q = quantize_nvfp4(torch.randn(n, k, generator=g, device="cuda") * 0.02)
            words, scales = repack(q.packed, q.block_scale.view(torch.uint8), torch.bfloat16)
            copies = max(2, min(8, math.ceil(ROTATE_BYTES / (n * k * 1.5625))))
            ws = [(words.clone(), scales.clone()) for _ in range(copies)]
            for recipe, variants in VARIANTS.items():
                br, bc = fp8p.weight_blocks(recipe, k)
                outs = []
                for _ in range(copies):
                    outs.append((torch.empty((n, k), dtype=torch.uint8, device="cuda"),
                                 fp8p._scale_buffer(n, k, recipe, words.device)))  # fmt: skip

                def run(i, rpp, nw, br=br, bc=bc, outs=outs, ws=ws, gs=q.global_scale, n=n):
                    w, s = ws[i]
                    reencode_mma_triton(w, s, gs, 0, n, outs[i][0], outs[i][1],
                                        act_dtype=torch.bfloat16, block_rows=br,
                                        block_cols=bc, rows_per_program=rpp,
                                        num_warps=nw)  # fmt: skip

                r = {"model": model, "shape": name, "N": n, "K": k, "recipe": recipe, "us": {}}
                run(0, *variants[0])
                want = (outs[0][0].clone(), outs[0][1].clone())
                for rpp, nw in variants:
                    if recipe == "128x128" and rpp != 32:
                        continue
                    lab = f"r{rpp}w{nw or 'd'}"
                    outs[0][0].zero_()
                    outs[0][1].zero_()
                    run(0, rpp, nw)
                    if not (torch.equal(outs[0][0], want[0]) and torch.equal(outs[0][1], want[1])):
                        r["us"][lab] = "MISMATCH"
                        continue
                    us = time_rotated([lambda i=i, rpp=rpp, nw=nw: run(i, rpp, nw)
                                       for i in range(copies)], 0)  # fmt: skip
                    r["us"][lab] = us
                tb = {c: n * k * 1.5625 / (t * 1e-6) / 1e12
                      for c, t in r["us"].items() if isinstance(t, float)}  # fmt: skip
                r["TBps"] = tb
                print(f"{model} {name} {recipe}: " + " ".join(
                    f"{c}={t:.1f}us/{tb.get(c, 0):.2f}TB/s" if isinstance(t, float) else f"{c}={t}"
                    for c, t in r["us"].items()), flush=True)  # fmt: skip
                rows.append(r)
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8-reencode-sweep.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

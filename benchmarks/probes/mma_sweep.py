"""Check and time the mma16x64 NVFP4 kernels (kernels/mma_layout/gemv.py, dequant.py) on the GPU,
per config.

Every (shape, M, config) is first checked against the float64 reference (relative error
< BOUND) and only then timed (CUDA-graph replays, weights rotated past L2), next to what the
triton backend ran before (fused tl.dot kernel / dequant + cuBLAS) and bf16 cuBLAS. Also checks
and times the layout's dequantize pass (the large-M path) and fp16 activations.
Usage: python benchmarks/probes/mma_sweep.py [--shapes qkv,o,gate_up,down] [--ms 1,16,64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/: ckpt_mma_linear.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import linear as L  # benchmarks/linear.py: Problem, timing, reference
from ckpt_mma_linear import mma_ckpt_linear  # the checkpoint-layout kernel's LINEAR mode

from quantdispatch.kernels.mma_layout.dequant import mma_dequant_rows
from quantdispatch.kernels.mma_layout.gemv import gemv_config, mma_linear
from quantdispatch.kernels.mma_layout.layout import repack

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def parse_config(text: str) -> tuple[int, int, int, int, int]:
    """``WTxWKxU[xR][dD]`` (e.g. ``8x2x1``, ``2x2x2x2``, ``1x8x2d2``) -> (WT, WK, UNROLL, R,
    DEPTH): DEPTH steps of weight loads in flight (default 1)."""
    sizes, _, depth = text.partition("d")
    return (*(*map(int, sizes.split("x")), 1)[:4], int(depth or 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,4,16,32,64,128")
    ap.add_argument("--configs", default="1x8x2,1x4x2,2x4x2,4x2x2,4x4x1,8x1x2")  # WTxWKxU[xR]
    ap.add_argument("--ckpt", action="store_true", help="also the checkpoint-layout kernel")
    ap.add_argument("--no-dequant", action="store_true", help="skip the dequantize pass")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = L.copy_bandwidth()
    tbps = max(bw.values())
    L.log(f"bandwidth copy {bw['copy'] / 1e12:.2f} TB/s, sm {bw['sm_elementwise'] / 1e12:.2f} TB/s")
    cfgs = [parse_config(c) for c in args.configs.split(",")]
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        p = L.Problem(n, k, gen)
        t0 = time.time()
        packs = {}
        for dtype in (torch.bfloat16, torch.float16):
            packs[dtype] = [repack(pk, sc.view(torch.uint8), dtype) for pk, sc in p.nv[:2]]
        rot = [repack(pk, sc.view(torch.uint8), torch.bfloat16) for pk, sc in p.nv]
        torch.cuda.synchronize()
        L.log(f"{name} {n}x{k}: repack {time.time() - t0:.1f}s for {len(rot)} copies")
        w64 = p.w64["nvfp4"]
        if not args.no_dequant:
            # dequantize pass (large-M path): exactness and bandwidth
            for dtype in (torch.bfloat16, torch.float16):
                words, scales = packs[dtype][0]
                rows = min(n, 2048)
                out = torch.full((rows, k), float("nan"), dtype=dtype, device="cuda")
                mma_dequant_rows(words, scales, p.gscale, 0, rows, out)
                err = L.rel_err(out, w64[:rows])
                exact = torch.equal(out, w64[:rows].to(dtype))
                L.log(
                    f"  dequant {dtype}: rel_err {err:.2e}, equal to f64->16-bit rounding: {exact}"
                )
            out = torch.empty((n, k), dtype=torch.bfloat16, device="cuda")
            calls = [
                (lambda w=w, p=p, n=n, out=out: mma_dequant_rows(w[0], w[1], p.gscale, 0, n, out))
                for w in rot
            ]
            us = L.time_calls(calls, 10)
            L.log(
                f"  dequant full weight: {us:.1f} us, {(n * k * (0.5625 + 2)) / us / 1e6:.2f} TB/s"
            )
        for m in map(int, args.ms.split(",")):
            floor = (n * k * 0.5625 + 2 * m * (n + k)) / tbps * 1e6
            line = [f"  M={m:5d} floor {floor:6.1f}"]
            for kernel in ("bf16", "nvfp4_auto"):
                t, err = L.checked_time(p, kernel, m, gen)
                line.append(f"{kernel} {t:7.1f}" if t else f"{kernel} FAIL {err:.1e}")
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
                words, scales = packs[dtype][1]
                y = mma_linear(x, words, scales, p.gscale)
                err = L.rel_err(y, x.double() @ w64.T)
                line.append(f"err[{str(dtype)[6:]}] {err:.1e}")
                if not err < L.BOUND:
                    line.append("FAILED")
            xs = p.xs(m, len(rot), gen)
            best = None
            for wt, w, u, r, d in cfgs:
                nt = gemv_config(n // 16, k // 64, m)[0]
                cfg = (nt, wt, w, u, r, d)
                label = f"{wt}x{w}x{u}" + (f"x{r}" if r > 1 else "") + (f"d{d}" if d > 1 else "")
                if (n // 16) % (wt * r):
                    continue
                y = mma_linear(xs[0], *rot[0], p.gscale, config=cfg)
                err = L.rel_err(y, xs[0].double() @ w64.T)
                if not err < L.BOUND:
                    line.append(f"{label} BAD {err:.1e}")
                    continue
                calls = [
                    (lambda x=x, r=r, cfg=cfg, p=p: mma_linear(x, *r, p.gscale, config=cfg))
                    for x, r in zip(xs, rot, strict=True)
                ]
                t = L.time_calls(L.graph_calls(calls, m), L.replays_for(m))
                line.append(f"{label} {t:6.1f}")
                if best is None or t < best[0]:
                    best = (t, label)
            if best:
                line.append(f"| best {best[1]} {best[0]:.1f} = {best[0] / floor:.2f}x floor")
            if args.ckpt:  # the same configs on the checkpoint layout (ckpt_mma_linear.py)
                best = None
                for wt, w, u, r, d in cfgs:
                    if r > 1 or d > 1:  # the checkpoint-layout kernel has no R or DEPTH
                        continue
                    nt = gemv_config(n // 16, k // 64, m)[0]
                    cfg = (nt, wt, w, u)
                    pk, sc = p.nv[0]
                    y = mma_ckpt_linear(xs[0], pk, sc.view(torch.uint8), p.gscale, config=cfg)
                    err = L.rel_err(y, xs[0].double() @ w64.T)
                    if not err < L.BOUND:
                        line.append(f"ckpt {wt}x{w}x{u} BAD {err:.1e}")
                        continue
                    calls = [
                        (
                            lambda x=x, r=r, cfg=cfg, p=p: mma_ckpt_linear(
                                x, r[0], r[1].view(torch.uint8), p.gscale, config=cfg
                            )
                        )
                        for x, r in zip(xs, p.nv, strict=False)
                    ]
                    t = L.time_calls(L.graph_calls(calls, m), L.replays_for(m))
                    line.append(f"ckpt {wt}x{w}x{u} {t:6.1f}")
                    if best is None or t < best[0]:
                        best = (t, f"{wt}x{w}x{u}")
                if best:
                    line.append(
                        f"| ckpt best {best[1]} {best[0]:.1f} = {best[0] / floor:.2f}x floor"
                    )
            L.log(" ".join(line))


if __name__ == "__main__":
    main()

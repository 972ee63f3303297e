"""Check and time the tl.dot GEMM on the mma16x64 layout (kernels/mma_layout/gemm.py) per tile.

Every (shape, M, tile) is first checked against the float64 reference (relative error < BOUND;
fp16 activations and a poisoned output once per shape and M) and only then timed (CUDA-graph
replays, weights rotated past L2), next to bf16 cuBLAS and what the triton backend runs.
Usage: python benchmarks/probes/gemm_sweep.py [--shapes qkv,o,gate_up,down] [--ms 32,64,128]
       [--tiles BNxBMxBKwWsS[kSPLIT][rMAXNREG],...] [--pad-ab]
``--pad-ab``: TMA tiles also timed on unpadded activations (label ``/u``: the last token tile's
boxes run past row M, as before session 14).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import linear as L  # benchmarks/linear.py: Problem, timing, reference

from quantdispatch.kernels.common.device_facts import device_facts
from quantdispatch.kernels.mma_layout import gemm
from quantdispatch.kernels.mma_layout.activation_order import kappa_order, kappa_order_torch
from quantdispatch.kernels.mma_layout.gemm_tiles import parse_tile
from quantdispatch.kernels.mma_layout.layout import repack

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DEFAULT_TILES = (
    "64x32x128w4s4k4,128x32x128w4s4k2,64x64x128w4s4,64x64x128w4s4k2,64x64x128w4s4k4,"
    "128x64x128w4s4,128x64x128w8s3,128x64x128w8s3k2,64x128x128w4s3,64x128x128w4s3k2,"
    "128x128x128w8s3,128x128x128w8s3k2,128x128x64w8s4,128x256x64w8s3,64x256x64w4s3"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="16,32,64,128,256,1024,4096")
    ap.add_argument("--tiles", default=DEFAULT_TILES)
    ap.add_argument("--no-auto", action="store_true", help="skip the backend's current path")
    ap.add_argument(
        "--kappa", action="store_true", help="also time the activation permutation alone"
    )
    ap.add_argument(
        "--pad-ab", action="store_true", help="TMA tiles also on unpadded activations (/u)"
    )
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = L.copy_bandwidth()
    tbps = max(bw.values())
    L.log(f"bandwidth copy {bw['copy'] / 1e12:.2f} TB/s, sm {bw['sm_elementwise'] / 1e12:.2f} TB/s")
    if device_facts(torch.device("cuda")).rs_wgmma_hazard:
        L.log("register-operand wgmma guard: every tile settles its accumulator each K step")
    tiles = [(parse_tile(t), True) for t in args.tiles.split(",")]
    if args.pad_ab:
        tiles += [(tile, False) for tile, _ in tiles if tile.tma]
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        p = L.Problem(n, k, gen)
        t0 = time.time()
        rot = [repack(pk, sc.view(torch.uint8), torch.bfloat16) for pk, sc in p.nv]
        f16 = repack(p.nv[0][0], p.nv[0][1].view(torch.uint8), torch.float16)
        torch.cuda.synchronize()
        L.log(f"{name} {n}x{k}: repack {time.time() - t0:.1f}s for {len(rot)} copies")
        w64 = p.w64["nvfp4"]
        for m in map(int, args.ms.split(",")):
            floor = (n * k * 0.5625 + 2 * m * (n + k)) / tbps * 1e6
            line = [f"  M={m:5d} floor {floor:6.1f}"]
            kernels = ("bf16",) if args.no_auto else ("bf16", "nvfp4_auto")
            for kernel in kernels:
                t, err = L.checked_time(p, kernel, m, gen)
                line.append(f"{kernel} {t:7.1f}" if t else f"{kernel} FAIL {err:.1e}")
            # the heuristic's tile, checked with fp16 activations, an odd M and a poisoned output
            x16 = torch.randn(m - 3, k, generator=gen, device="cuda").to(torch.float16)
            y16 = gemm.mma_gemm(x16, *f16, p.gscale)
            err16 = L.rel_err(y16, x16.double() @ w64.T)
            line.append(f"err[fp16, M-3] {err16:.1e}" + ("" if err16 < L.BOUND else " FAILED"))
            xs = p.xs(m, len(rot), gen)
            if args.kappa:  # the per-call copy of x into the MMA's K order (a separate kernel)
                for label, fn in (
                    ("kappa", kappa_order),
                    ("kappa_torch", kappa_order_torch),
                ):
                    calls = [(lambda x=x, fn=fn: fn(x)) for x in xs]
                    t = L.time_calls(L.graph_calls(calls, m), L.replays_for(m))
                    line.append(f"{label} {t:5.1f}")
            ref = xs[0].double() @ w64.T
            best = None
            for tile, pad in tiles:
                if n % tile.block_n:
                    continue
                label = tile.label() + ("" if pad else "/u")
                gemm.PAD_TMA_ROWS = pad  # read at call (and capture) time
                try:
                    y = gemm.mma_gemm(xs[0], *rot[0], p.gscale, tile=tile)
                except Exception as e:  # a tile too large for shared memory or registers
                    line.append(f"{label} ERR {type(e).__name__}")
                    continue
                err = L.rel_err(y, ref)
                if not err < L.BOUND:
                    line.append(f"{label} BAD {err:.1e}")
                    continue
                calls = [
                    (lambda x=x, r=r, t=tile, p=p: gemm.mma_gemm(x, *r, p.gscale, tile=t))
                    for x, r in zip(xs, rot, strict=True)
                ]
                t = L.time_calls(L.graph_calls(calls, m), L.replays_for(m))
                gemm.PAD_TMA_ROWS = True
                line.append(f"{label} {t:6.1f}")
                if best is None or t < best[0]:
                    best = (t, label)
            if best:
                line.append(f"| best {best[1]} {best[0]:.1f} = {best[0] / floor:.2f}x floor")
            L.log(" ".join(line))


if __name__ == "__main__":
    main()

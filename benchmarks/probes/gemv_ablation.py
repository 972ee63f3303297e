"""Where the mma.sync GEMV's time goes at M = 16: the kernel with its activation loads changed.

A measurement, not a kernel: the variants below compute wrong results on purpose (only
``base`` is checked against float64), and each removes or reshapes one cost of the activation
fragment loads, which the profile blamed for M = 16 (docs/design/mma-layout.md):

* ``base``     the kernel as it ships (kernels/mma_layout/gemv.py ``_mma_gemv_kernel``);
* ``x_sector`` the 4 lanes of a token row read 64 contiguous bytes per load instruction
               (whole 32-byte sectors) instead of 4 x 16 bytes at a 32-byte stride: what a
               sector-covering K order of the layout would load;
* ``x_bcast``  all lanes of a token tile read the same 32 bytes: the load instructions stay,
               their L1 traffic is gone;
* ``no_x``     no activation loads at all (constant B fragments).

Each variant is built from the shipped kernel's source by text substitution (an assertion
stops the script when a substitution no longer applies) and timed like mma_sweep.py.
Usage: python benchmarks/probes/gemv_ablation.py [--shapes gate_up,down] [--ms 8,16] [--configs ..]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/: mma_sweep.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import linear as L  # benchmarks/linear.py: Problem, timing, reference
from mma_sweep import SHAPES, parse_config

from quantdispatch.kernels.mma_layout import gemv
from quantdispatch.kernels.mma_layout.layout import repack

_X_ROW = "x_row = (x_ptr + rows * stride_xm + (16 * t)[None, :])[None, :, :]"
_LOAD_X = "x0, x1, x2, x3, x4, x5, x6, x7 = load_x(x_row + ((c0 + cx) * 64)[:, None, :], ok, EVEN)"

VARIANTS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    "x_sector": [
        (_X_ROW, _X_ROW.replace("(16 * t)", "(8 * t)")),
        (_LOAD_X, _LOAD_X.replace("load_x(", "load_x_sector(")),
    ],
    "x_bcast": [  # one row per token tile (not one for all: the tiles' loads must stay apart)
        (_X_ROW, "x_row = (x_ptr + (tt + 0 * g[None, :]) * stride_xm + 0 * t[None, :])[None, :, :]")
    ],
    "no_x": [
        (
            _LOAD_X,
            "xc = tl.full((UNROLL, NT, 32 * WARPS), 0x3C003C00, tl.int32)\n"
            "        x0, x1, x2, x3, x4, x5, x6, x7 = xc, xc, xc, xc, xc, xc, xc, xc",
        )
    ],
}

_HEADER = """
import triton
import triton.language as tl
from quantdispatch.kernels.common.ptx import decode_chunk, load_w, load_x, mma_step_tiles
from quantdispatch.kernels.mma_layout.gemv import _store_out, _tile_sum

_SECTOR_ASM = tl.constexpr(
    "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$9];\\nld.global.nc.v4.b32 {$4, $5, $6, $7}, [$9+64];"
)


@triton.jit
def load_x_sector(x_ptrs, ok, ALL: tl.constexpr):
    return tl.inline_asm_elementwise(
        _SECTOR_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,l", [ok.to(tl.int32), x_ptrs],
        dtype=(tl.int32,) * 8, is_pure=True, pack=1,
    )

"""


def build_variant(name: str, workdir: Path):
    """The GEMV kernel with the variant's substitutions, as a fresh Triton JIT function."""
    src = inspect.getsource(gemv._mma_gemv_kernel.fn)
    for old, new in VARIANTS[name]:
        if old not in src:
            raise SystemExit(f"variant {name}: the kernel no longer contains {old!r}")
        src = src.replace(old, new)
    path = workdir / f"gemv_{name}.py"
    path.write_text(_HEADER + src)
    spec = importlib.util.spec_from_file_location(f"gemv_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._mma_gemv_kernel


def launch(kernel, x, words, scales, gscale, cfg):
    nt, wt, wk, unroll, r, depth = (*cfg, 1)[:6]
    tiles, chunks = words.shape[0], words.shape[1]
    n, m = tiles * 16, x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, 8 * nt), tiles // (wt * r))
    kernel[grid](
        x, words, scales.view(torch.int16), gscale, gscale, out, m, n, x.stride(0), out.stride(0),
        CHUNKS=chunks, NT=nt, WT=wt, WK=wk, UNROLL=unroll, R=r, BF16=True,
        HAS_BIAS=False, DEPTH=depth, num_warps=wt * wk, num_stages=1,
    )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--ms", default="8,16")
    ap.add_argument("--configs", default="", help="WTxWKxU[xR],... (default: heuristic)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    workdir = Path(tempfile.mkdtemp())
    kernels = {name: build_variant(name, workdir) for name in VARIANTS}
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        p = L.Problem(n, k, gen)
        rot = [repack(pk, sc.view(torch.uint8), torch.bfloat16) for pk, sc in p.nv]
        for m in map(int, args.ms.split(",")):
            heur = gemv.gemv_config(n // 16, k // 64, m)
            cfgs = [heur] + [(heur[0], *parse_config(c)) for c in args.configs.split(",") if c]
            xs = p.xs(m, len(rot), gen)
            for cfg in cfgs:
                label = "x".join(map(str, cfg[1:]))
                line = [f"{shape} M={m:3d} {label:10s}"]
                for name, kernel in kernels.items():
                    y = launch(kernel, xs[0], *rot[0], p.gscale, cfg)
                    if name == "base":
                        err = L.rel_err(y, xs[0].double() @ p.w64["nvfp4"].T)
                        if not err < L.BOUND:
                            line.append(f"base BAD {err:.1e}")
                            break
                    calls = [
                        (lambda x=x, w=w, kn=kernel, c=cfg, s=p.gscale: launch(kn, x, *w, s, c))
                        for x, w in zip(xs, rot, strict=True)
                    ]
                    t = L.time_calls(L.graph_calls(calls, m), L.replays_for(m))
                    line.append(f"{name} {t:6.1f}")
                L.log(" ".join(line))


if __name__ == "__main__":
    main()

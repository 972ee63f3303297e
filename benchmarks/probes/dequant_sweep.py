"""Time the NVFP4 dequantization kernels alone for a few tile shapes (H200 tuning aid).

Prints microseconds and effective bandwidth (packed + scales read, 16-bit written) for the
28672 x 4096 and 4096 x 14336 weights; each tile is checked bit-exact against the default one.
``--mma``: the mma16x64 layout's kernel (the large-M path of repacked linears) per warp count on
the four Llama-3-8B weights, whole weight, each config bit-exact against
the float64 dequantization rounded to bf16.
"""

from __future__ import annotations

import torch
import triton

from quantdispatch.kernels.checkpoint_layout.dequant import dequant_fp4_rows

TILES = [(16, 128, 4), (16, 256, 4), (32, 128, 4), (8, 128, 4), (16, 128, 2), (32, 256, 8)]


def _time(packed, scale, gs, out, tile) -> float:
    def call():
        dequant_fp4_rows(packed, scale, gs, out, scale_format="e4m3", tile=tile)

    return triton.testing.do_bench(call, return_mode="median") * 1e3


MMA_WARPS = [4, 2, 8, 16]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def mma_sweep() -> None:
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from quantdispatch.kernels.mma_layout.dequant import MmaDequantRows
    from quantdispatch.kernels.mma_layout.layout import repack

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = quantize_nvfp4(torch.randn(n, k, generator=g, device="cuda") * 0.02)
        ref = dequantize_nvfp4(w, dtype=torch.float64).to(torch.bfloat16)
        words, scales = repack(w.packed, w.block_scale.view(torch.uint8), torch.bfloat16)
        out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        nbytes = n * k * (0.5 + 1 / 16 + 2)
        for warps in MMA_WARPS:
            rows = MmaDequantRows(words, scales, w.global_scale, warps=warps)
            out.fill_(float("nan"))
            exact = torch.equal(rows(0, n, out), ref)
            call = lambda rows=rows, n=n, out=out: rows(0, n, out)
            us = triton.testing.do_bench(call, return_mode="median") * 1e3
            print(
                f"mma16x64 {name} {n}x{k} warps {warps}: {us:.1f} us, "
                f"{nbytes / us / 1e6:.2f} TB/s, exact={exact}",
                flush=True,
            )


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mma", action="store_true", help="the mma16x64 layout's kernel instead")
    if ap.parse_args().mma:
        mma_sweep()
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((28672, 4096), (4096, 14336)):
        rows = (32 * 2**20) // k // 128 * 128
        u8 = {"generator": g, "device": "cuda", "dtype": torch.uint8}
        packed = torch.randint(0, 256, (rows, k // 2), **u8)
        scale = torch.randint(0x28, 0x7F, (rows, k // 16), **u8)
        gs = torch.tensor(3e-3, device="cuda")
        out = torch.empty(rows, k, dtype=torch.bfloat16, device="cuda")
        ref = dequant_fp4_rows(packed, scale, gs, out.clone(), scale_format="e4m3", tile=TILES[0])
        nbytes = rows * k * (0.5 + 1 / 16 + 2)
        for tile in TILES:
            got = dequant_fp4_rows(packed, scale, gs, out, scale_format="e4m3", tile=tile)
            us = _time(packed, scale, gs, out, tile)
            print(
                f"{n}x{k} slab {rows} rows tile {tile}: {us:.1f} us, "
                f"{nbytes / us / 1e6:.2f} TB/s, exact={torch.equal(got, ref)}"
            )


if __name__ == "__main__":
    main()

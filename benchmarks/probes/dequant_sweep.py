"""Time the NVFP4 dequantization kernel alone for a few tile shapes (H200 tuning aid).

Prints microseconds and effective bandwidth (packed + scales read, 16-bit written) for the
28672 x 4096 and 4096 x 14336 weights; each tile is checked bit-exact against the default one.
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


def main() -> None:
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

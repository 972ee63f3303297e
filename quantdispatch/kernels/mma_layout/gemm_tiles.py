"""The tiles of the mid-M GEMM on the mma16x64 layout (:mod:`.gemm`): :class:`GemmTile`, the
tuned tables per M bucket and weight shape, and what TMA needs. No triton import at module
level (doctor and the backend read these without launching anything).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from quantdispatch.kernels.mma_layout.layout import CHUNK_K

__all__ = [
    "LONG_K",
    "WIDE_N",
    "GemmTile",
    "mma_gemm_config",
    "mma_gemm_supported",
    "parse_tile",
]


@dataclass(frozen=True)
class GemmTile:
    """Weight rows and tokens per program, K chunks (of 64) per step, warps, pipeline stages,
    K ranges (each summed in fp32 by a second pass when > 1), a cap on registers per thread
    (ptxas ``.maxnreg``; None: the compiler's choice), which decides how many programs share an
    SM, and whether the activation tiles come by TMA (SM 9.0+)."""

    block_n: int
    block_m: int
    chunks: int
    warps: int
    stages: int
    split: int = 1
    maxnreg: int | None = None
    tma: bool = False

    def label(self) -> str:
        text = f"{self.block_n}x{self.block_m}x{64 * self.chunks}w{self.warps}s{self.stages}"
        text += f"k{self.split}" if self.split > 1 else ""
        text += f"r{self.maxnreg}" if self.maxnreg else ""
        return text + ("t" if self.tma else "")


def parse_tile(text: str) -> GemmTile:
    """``GemmTile`` from its label, e.g. ``128x128x128w8s3``, ``64x64x128w4s4k4``,
    ``128x128x128w8s2r128``, ``128x128x128w8s3t`` (benchmarks and profiles name tiles this
    way)."""
    pattern = r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:k(\d+))?(?:r(\d+))?(t?)"
    found = re.fullmatch(pattern, text.strip())
    if found is None or int(found.group(3)) % CHUNK_K:
        raise ValueError(
            f"tile {text!r}: expected BNxBMxBKwWsS[kSPLIT][rMAXNREG][t] with BK a multiple of "
            f"{CHUNK_K}, e.g. 128x128x128w8s3"
        )
    bn, bm, bk, warps, stages = map(int, found.groups()[:5])
    split = int(found.group(6) or 1)
    maxnreg = int(found.group(7)) if found.group(7) else None
    return GemmTile(bn, bm, bk // CHUNK_K, warps, stages, split, maxnreg, found.group(8) == "t")


#: Weights from this many rows are wide enough to fill the H200 without a K split.
WIDE_N = 16384
#: Weights from this K on are long (down projections): fewer weight tiles, more K to split.
LONG_K = 8192


def mma_gemm_supported(n: int, k: int) -> bool:
    """Shapes the kernel takes: whole 64-row weight tiles (one warpgroup's wgmma rows) of the
    mma16x64 layout."""
    return n > 0 and k > 0 and n % 64 == 0 and k % CHUNK_K == 0


#: Which weights a tile row applies to, from the weight's width and depth (checked in row order).
_SHAPE_RULES = {
    "any": lambda n, wide, long_k: True,
    "wide": lambda n, wide, long_k: wide,
    "long": lambda n, wide, long_k: long_k,
    "tall": lambda n, wide, long_k: n >= 6144,  # qkv-sized and up
    "tall_short": lambda n, wide, long_k: n >= 6144 and not long_k,
    "long_or_narrow": lambda n, wide, long_k: long_k or n < 6144,
}


#: Pointer-load tiles, (largest M, weights, tile) rows, the first match wins: the pipelined
#: winners of the H200 sweeps (gemm-sweep-h200-*.log; devices or Tritons without TMA; settled
#: too on SM 9.x, where they were not re-swept).
_POINTER_TILES = (
    (32, "wide", GemmTile(128, 32, 2, 4, 4, 2)),
    (32, "any", GemmTile(64, 32, 2, 4, 4, 4)),
    (64, "wide", GemmTile(128, 64, 2, 4, 4, 1)),
    (64, "tall_short", GemmTile(128, 64, 2, 8, 3, 2)),
    (64, "any", GemmTile(64, 64, 2, 4, 4, 4)),
    (128, "wide", GemmTile(128, 128, 2, 8, 3, 1)),
    (128, "long", GemmTile(128, 64, 2, 8, 3, 2)),
    (128, "tall", GemmTile(128, 128, 2, 8, 3, 2)),
    (128, "any", GemmTile(64, 64, 2, 4, 4, 1)),
    (256, "long_or_narrow", GemmTile(128, 128, 2, 8, 3, 2)),
    (None, "any", GemmTile(128, 128, 2, 8, 3, 1)),
)


#: TMA tiles, same rows: the winners with the accumulator settled each K step (what SM 9.x
#: runs; benchmarks/results/gemm-sweep-h200-*-settled.log, docs/design/wgmma-gemm.md). Settled,
#: a warpgroup's decode no longer overlaps its own wgmmas, so smaller programs that let more
#: warpgroups share an SM won: 64x128 tiles of one warpgroup at M 65..256. At M 65..128 a K
#: split lets the 64x128 tile decode each weight once and still fill the SMs; at M 129..256 a
#: 2-way K split for long or narrow weights (qkv and gate_up stay unsplit). The activations are
#: padded to whole token tiles (:func:`.gemm.mma_gemm`): TMA boxes that ran past
#: row M had cost up to 2x and had made 64-token tiles win at M 129..192.
_TMA_TILES = tuple(
    (top, rule, replace(tile, tma=True))
    for top, rule, tile in (
        (32, "wide", GemmTile(64, 32, 2, 4, 3, 4)),
        (32, "any", GemmTile(64, 32, 2, 4, 4, 4)),
        (64, "wide", GemmTile(128, 64, 2, 8, 3, 1)),
        (64, "tall_short", GemmTile(64, 64, 2, 4, 4, 2)),
        (64, "any", GemmTile(64, 64, 2, 4, 4, 4)),
        (128, "wide", GemmTile(64, 128, 2, 4, 3, 1)),
        (128, "tall_short", GemmTile(64, 128, 2, 4, 3, 2)),
        (128, "any", GemmTile(64, 128, 2, 4, 3, 4)),
        (256, "long_or_narrow", GemmTile(64, 128, 2, 4, 3, 2)),
        (None, "any", GemmTile(64, 128, 2, 4, 3, 1)),
    )
)


def mma_gemm_config(n: int, k: int, m: int, *, tma: bool = False) -> GemmTile:
    """The tile for an [M, K] x [N, K]^T call: the fastest measured per M bucket on the
    H200 (:data:`_POINTER_TILES`, :data:`_TMA_TILES`; Llama-3.1-8B shapes), generalized by the
    weight's width (WIDE_N) and depth (LONG_K): narrow weights split K to fill the GPU.

    ``tma`` (the device's ``DeviceFacts.tma``): the activation tiles come by TMA, which beat
    the pointer loads in every winning tile of the sweep (benchmarks/results/
    gemm-sweep-h200-*-tma.log, docs/design/wgmma-gemm.md) and frees registers."""
    wide, long_k = n >= WIDE_N, k >= LONG_K
    tile = next(
        tile
        for top, rule, tile in (_TMA_TILES if tma else _POINTER_TILES)
        if (top is None or m <= top) and _SHAPE_RULES[rule](n, wide, long_k)
    )
    if n % tile.block_n:  # N a multiple of 64 only: one warpgroup, 64 rows per program
        tile = GemmTile(64, tile.block_m, tile.chunks, 4, 4, tile.split, tile.maxnreg, tile.tma)
    return tile

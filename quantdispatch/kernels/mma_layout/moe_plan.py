"""The regime of a MoE call on repacked (mma16x64) experts, from the static sizes only (graphs
and compile see no data dependence): single (token, slot) pairs (:class:`SmallMoeConfig`, the
kernels of :mod:`.moe_pairs`), the mma.sync kernels on 8-pair blocks or single pairs
(:class:`..common.moe_plan.MmaMoeConfig`), the grouped GEMM (:class:`MoeGemmTile`,
:mod:`.moe_gemm`), or dequantize + ``torch._grouped_mm``, by the row
:data:`..regimes.MMA_LAYOUT_MOE`; and the words doctor prints for each. No triton import at
module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantdispatch.capability import SM80_PLUS
from quantdispatch.kernels.common.device_facts import DeviceFacts
from quantdispatch.kernels.common.moe_plan import (
    DequantMoeConfig,
    MmaMoeConfig,
    dequant_buffer_bytes,
    mma_moe_config,
)
from quantdispatch.kernels.mma_layout.layout import CHUNK_K, TILE_N
from quantdispatch.kernels.regimes import MMA_LAYOUT_MOE, Family

__all__ = [
    "DOWN_MIN_WARPS",
    "GATE_UP_WIDE_MAX_PROGRAMS",
    "GATE_UP_WIDE_MIN_CHUNKS_PDL",
    "PREFETCH_MAX_BYTES",
    "MoeGemmTile",
    "SmallMoeConfig",
    "describe_moe_config",
    "mma_layout_moe_plan",
    "moe_layout_supported",
    "small_moe_config",
    "small_units",
]


def moe_layout_supported(
    inter: int, hidden: int, gated: bool, capability: tuple[int, int] | None
) -> bool:
    """Whether NVFP4 experts are repacked: a gated activation (the kernels pair gate and up
    tiles), SM 8.0+ (bf16 mma.sync), I and H multiples of 64 (whole 64-row GEMM tiles)."""
    return (
        gated
        and capability in SM80_PLUS
        and inter > 0
        and hidden > 0
        and inter % 64 == 0
        and hidden % 64 == 0
    )


@dataclass(frozen=True)
class MoeGemmTile:
    """Grouped GEMM tile: pairs per block, weight rows per program, K chunks (of 64) per step,
    warps, pipeline stages."""

    block_m: int
    block_n: int = 64
    chunks: int = 2
    warps: int = 4
    stages: int = 4
    family: ClassVar[Family] = Family.MOE_GROUPED_GEMM

    def shared_bytes(self, gate_up: bool = True) -> int:
        """Shared memory the pipelined loop needs, an upper bound: per stage the activation
        tile (block_m x 64 chunks x 2 B) and the words (32 B per weight row and chunk) and
        scale pairs (4 B) of one weight tile, two for gate/up. (Triton 3.9 compiled for sm_90
        / sm_86 uses 36-96 / 24-64 KB for the four tiles of :func:`mma_layout_moe_plan`, this
        says 39-150: it does not always stage the words.)"""
        tiles = 2 if gate_up else 1
        per_stage = self.block_m * 128 * self.chunks + tiles * self.block_n * self.chunks * 36
        return self.stages * per_stage

    def label(self) -> str:
        return f"gemm BM{self.block_m} {self.block_n}x{64 * self.chunks}w{self.warps}s{self.stages}"


#: Kept free for what the estimate does not count (epilogue layout conversions, barriers).
_SHARED_MARGIN = 8 * 1024


def _fit_shared(tile: MoeGemmTile, limit: int) -> MoeGemmTile:
    """``tile``, or the largest smaller one whose pipeline fits ``limit`` bytes by the upper
    bound of :meth:`MoeGemmTile.shared_bytes` (the 128-pair tile's is ~150 KB: kept on A100 /
    H100, the 64-pair tile on a 99 KB RTX or L40S, none of which was measured)."""
    smaller = [MoeGemmTile(64, stages=3), MoeGemmTile(32, stages=3), MoeGemmTile(16, stages=3)]
    for t in [tile, *smaller]:
        if t.block_m <= tile.block_m and t.shared_bytes() + _SHARED_MARGIN <= limit:
            return t
    return MoeGemmTile(16, stages=2)


# --------------------------------------------------------------------------------------------
# single pairs (:mod:`.moe_pairs`)


@dataclass(frozen=True)
class SmallMoeConfig:
    """Warps and chunks in flight per warp of the gate/up programs (one 16-row tile each, K
    split over the warps) and of the down programs (one 16-row output tile of one token)."""

    warps: int = 4
    unroll: int = 2
    warps_down: int = 8
    unroll_down: int = 2
    #: SM 9.0+: launch the down kernel as a programmatic dependent launch, so its programs start
    #: while the gate/up programs run and wait for the intermediate only where they read it.
    pdl: bool = False
    #: with ``pdl``: leading chunks (64 columns of I) of every (slot, output tile) the down
    #: programs prefetch into L2 before they wait (their weights do not depend on gate/up).
    prefetch: int = 0
    family: ClassVar[Family] = Family.MOE_MMA_PAIRS

    def label(self) -> str:
        early = f" pdl pf{self.prefetch}" if self.pdl else ""
        return f"topk-sum w{self.warps}u{self.unroll}/w{self.warps_down}u{self.unroll_down}{early}"


def small_units(m: int, top_k: int, inter: int, hidden: int) -> tuple[int, int]:
    """(gate/up programs, down programs): (pairs x I/16, tokens x H/16)."""
    return m * top_k * (inter // 16), m * (hidden // 16)


#: Down programs get warps until they hold at least this many warps in all (memory parallelism
#: of the output-tile-parallel kernel; at most 16 per program).
DOWN_MIN_WARPS = 3072
#: Up to this many gate/up programs (pairs x I/16), 8 warps with one chunk in flight each: a
#: grid this small holds too few warps per SM for the per-pair kernel's tuning.
GATE_UP_WIDE_MAX_PROGRAMS = 1024
#: ... but with the down kernel launched as a programmatic dependent (SM 9.0+), only where K
#: (the hidden size) has at least this many chunks: 8 per warp.
GATE_UP_WIDE_MIN_CHUNKS_PDL = 64
#: With a programmatic dependent launch the down programs prefetch at most this many bytes of
#: their weights into L2 while gate/up runs (L2 is 50 MB on the H100 / H200, more on newer
#: GPUs; gate/up streams its own weights through it at the same time).
PREFETCH_MAX_BYTES = 16 << 20
#: Bytes of one chunk (16 rows x 64 columns) of repacked weights: 4-bit codes, a byte of scale
#: per 16 of them (512 + 64).
CHUNK_BYTES = TILE_N * CHUNK_K // 2 + TILE_N * CHUNK_K // 16
#: The L2 prefetch pays only on long down loops: from this many chunks of I (I >= 2560), the
#: first eighth of them (measured on the H200, see :func:`small_moe_config`).
PREFETCH_MIN_CHUNKS = 40


def small_moe_config(
    m: int, top_k: int, inter: int, hidden: int, warps: int, unroll: int, pdl: bool = False
) -> SmallMoeConfig:
    """Gate/up: ``warps`` x ``unroll`` (the per-pair kernel's tuning for the same programs,
    :func:`..common.moe_plan.mma_moe_config`), or 8 x 1 for grids of at most
    GATE_UP_WIDE_MAX_PROGRAMS. Down: the fewest of 4 / 8 / 16 warps per program that give the
    grid DOWN_MIN_WARPS warps, two chunks in flight. Gate/up 8 x 1 pays where the grid is small
    (bigger grids keep the tuning); with ``pdl`` only from GATE_UP_WIDE_MIN_CHUNKS_PDL chunks of
    K. From the H200 sweeps (benchmarks/results/moe-sweep-h200-*-small*.json, *-s15.json,
    docs/design/moe.md).

    ``pdl`` (SM 9.0+): the down kernel as a programmatic dependent launch, its first chunks
    loaded before it waits for gate/up; an L2 prefetch of the first eighth of the chunks of
    every (slot, output tile) only where I has PREFETCH_MIN_CHUNKS chunks: it paid for Mixtral
    and gpt-oss (45 chunks) on the H200, not for Qwen3 (12) or DeepSeek-V3 (32); prefetching a
    quarter or all of them did worse (benchmarks/results/moe-sweep-h200-*-topk-pdl-*.json,
    moe-mxfp4-sweep-h200-*.json)."""
    if m * top_k * (inter // 16) <= GATE_UP_WIDE_MAX_PROGRAMS and (
        not pdl or hidden // 64 >= GATE_UP_WIDE_MIN_CHUNKS_PDL
    ):
        warps, unroll = 8, 1
    programs = m * (hidden // 16)
    down = 4
    while down < 16 and programs * down < DOWN_MIN_WARPS:
        down *= 2
    prefetch = 0
    if pdl and inter // 64 >= PREFETCH_MIN_CHUNKS:  # an eighth, within PREFETCH_MAX_BYTES
        per_chunk = m * top_k * (hidden // 16) * CHUNK_BYTES
        prefetch = min(inter // 64 // 8, PREFETCH_MAX_BYTES // per_chunk)
    return SmallMoeConfig(warps, unroll, down, 2, pdl, prefetch)


# --------------------------------------------------------------------------------------------
# the regime


#: 128-pair tiles on 128-row weight tiles where 128 divides I and H; else 64 rows, 4 warps
#: (e.g. gpt-oss's 2880).
_WIDE_128 = MoeGemmTile(128, block_n=128, warps=8, stages=3)
_NARROW_128 = MoeGemmTile(128, block_n=64, warps=4, stages=3)


def mma_layout_moe_plan(
    m: int,
    top_k: int,
    experts: int,
    inter: int,
    hidden: int,
    facts: DeviceFacts,
    *,
    pdl: bool = True,
    allow_dequant: bool = True,
) -> SmallMoeConfig | MmaMoeConfig | MoeGemmTile | DequantMoeConfig:
    """The regime from the static sizes only (graphs and compile see no data dependence), on
    the device of ``facts``, by the row :data:`..regimes.MMA_LAYOUT_MOE`; ``pdl`` (default
    True): the single-pair down kernel as a programmatic dependent launch where the device has
    them.

    Tokens per expert ``tpe = M * top_k / E``: up to the row's ``mma`` threshold the mma.sync
    kernels (single pairs, with the top-k sum in the down kernel, :func:`small_moe_config`;
    small experts up to the row's ``direct`` threshold one block per pair; else 8-pair
    blocks); from its ``dequant`` threshold on SM 9.0+ dequantize + grouped_mm for large
    experts (Mixtral's; smaller experts keep the GEMM); else the grouped GEMM on the row's
    blocks of 16 / 32 / 64 pairs (64-row weight tiles, 4 warps) and 128 pairs on 128-row tiles
    (8 warps; 64-row tiles and 4 warps where 128 does not divide I or H). From the H200 sweep
    (benchmarks/results/moe-sweep-h200-*.json, docs/design/moe.md): at 4 per expert the mma
    kernels win; at 8 it is mixed and the GEMM wins the sum; 16 per expert: 32-pair blocks; 32:
    64; 256: 128. Three stages beat four. With the accumulators settled each K step (SM 9.x,
    :mod:`..common.wgmma_guard`; moe-sweep-h200-*-settled.json) the same tiles won at 8, 16, 32,
    64 and 256 per expert, and 128 pairs on 128-row tiles already at 128 (at 64 per expert 64
    still wins). A tile whose pipeline does not fit the GPU's shared memory gives way to a
    smaller one (:func:`_fit_shared`)."""
    row = MMA_LAYOUT_MOE
    pairs = m * top_k
    tpe = pairs / max(experts, 1)
    if (
        allow_dequant
        and tpe >= row.dequant.min_tokens_per_expert
        and inter * hidden >= row.dequant.min_expert_elements
        and dequant_buffer_bytes(experts, inter, hidden) <= row.dequant.max_buffer_bytes
        and facts.grouped_mm
    ):
        return DequantMoeConfig()
    if tpe <= row.mma.max_tokens_per_expert:
        single = row.single_pairs(pairs, experts)  # the top-k sum inside the down kernel
        direct = row.direct
        small = (
            direct is not None
            and tpe <= direct.max_tokens_per_expert
            and inter * hidden <= direct.max_expert_elements
        )
        cfg = mma_moe_config(pairs, experts, inter, hidden, direct=single or small, repacked=True)
        if single:  # moe_pairs, its gate/up tuned as the per-pair mma kernels
            early = pdl and facts.dependent_launches
            return small_moe_config(m, top_k, inter, hidden, cfg.gemm1.wk, cfg.gemm1.unroll, early)
        return cfg
    step = row.step(tpe)
    if step.block_m < 128:
        tile = MoeGemmTile(step.block_m, stages=3)
    elif inter % 128 or hidden % 128:  # 128-row tiles would not divide N
        tile = _NARROW_128
    else:
        tile = _WIDE_128
    return _fit_shared(tile, facts.shared_bytes)


def describe_moe_config(cfg: SmallMoeConfig | MmaMoeConfig | MoeGemmTile | DequantMoeConfig) -> str:
    """doctor's words for one regime and its launch parameters."""
    if isinstance(cfg, SmallMoeConfig):
        return (
            "single (token, slot) pairs: mma.sync gate/up, then a down kernel that also sums "
            f"the top-k slots ({cfg.label()})"
        )
    if isinstance(cfg, MmaMoeConfig):
        g1, g2 = cfg.gemm1, cfg.gemm2
        what = "one per (token, slot) pair" if cfg.direct else f"blocks of {cfg.block_m} pairs"
        return (
            f"mma.sync kernels, {what} (gate/up / down: K split {g1.wk} / {g2.wk} ways, "
            f"{g1.unroll} / {g2.unroll} chunks in flight, {g1.wt} / {g2.wt} tiles a warp)"
        )
    if isinstance(cfg, MoeGemmTile):
        return f"grouped tl.dot GEMM decoding the repacked experts ({cfg.label()})"
    return "experts dequantized per GEMM + torch._grouped_mm"

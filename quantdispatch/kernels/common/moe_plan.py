"""The MoE plan pieces both layouts share, from the static sizes only: the mma.sync kernels'
configs (:class:`MmaMoeConfig`, :func:`mma_moe_config`; the kernels are :mod:`.moe_mma`) and the
dequantize + ``torch._grouped_mm`` regime (:class:`DequantMoeConfig`, :mod:`.moe_dequant`). Each
layout's plan (``checkpoint_layout.moe_plan``, ``mma_layout.moe_plan``) picks among them and its
own kernels. No triton import, so ``quantdispatch doctor`` explains a regime without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from quantdispatch.capability import SM80_PLUS
from quantdispatch.kernels.regimes import Family

if TYPE_CHECKING:
    from quantdispatch.kernels.common.device_facts import DeviceFacts

__all__ = [
    "FEW_PROGRAMS",
    "FEW_PROGRAMS_MIN_CHUNKS",
    "MIN_WARPS_REPACKED",
    "DequantMoeConfig",
    "MmaGemmConfig",
    "MmaMoeConfig",
    "dequant_buffer_bytes",
    "expected_experts",
    "grouped_mm_capable",
    "mma_moe_config",
    "mma_moe_supported",
]


@dataclass(frozen=True)
class MmaGemmConfig:
    """Warps of one program: WT tiles side by side, WK-way K split, UNROLL chunks in flight."""

    wt: int = 1
    wk: int = 4
    unroll: int = 2


@dataclass(frozen=True)
class MmaMoeConfig:
    """``direct``: one block per (token, slot) pair (NT = 1); else ``nt`` token tiles of 8
    expert-sorted pairs per block."""

    nt: int
    gemm1: MmaGemmConfig
    gemm2: MmaGemmConfig
    direct: bool = False
    family: ClassVar[Family] = Family.MOE_MMA_BLOCKS

    @property
    def block_m(self) -> int:
        return 8 * self.nt


def mma_moe_supported(
    inter: int, hidden: int, gated: bool, capability: tuple[int, int] | None
) -> bool:
    """SM 8.0+ and every GEMM in whole 16-row tiles and 64-column chunks."""
    return gated and capability in SM80_PLUS and inter % 64 == 0 and hidden % 64 == 0


def _gemm_config(blocks: int, tiles: int, chunks: int) -> MmaGemmConfig:
    """K split 4 ways while (block, tile) pairs are few (<= 8192: the GPU needs more warps),
    else 2 ways, but never below 16 chunks per warp (short loops pay their prologue and the
    cross-warp reduction); two chunks in flight. From the H200 sweep
    (benchmarks/results/moe-sweep-h200-*.json: Qwen3, Mixtral, DeepSeek-V3 at M = 1 and 16;
    docs/design/moe.md)."""
    wk = 4 if blocks * tiles <= 8192 else 2
    while wk > 1 and chunks < 16 * wk:
        wk //= 2
    return MmaGemmConfig(1, wk, 2 if chunks >= 4 * wk else 1)


#: Repacked experts, single pairs: warps (programs x K split) a GEMM should reach at least.
MIN_WARPS_REPACKED = 1536


def _gemm_config_repacked(blocks: int, tiles: int, chunks: int, gate_up: bool) -> MmaGemmConfig:
    """The checkpoint layout's choice, adjusted for the repacked kernels on single pairs (its
    decode is cheaper, so small experts need more warps, not longer loops). From the H200
    sweep (benchmarks/results/moe-sweep-h200-*.json, Qwen3-30B-A3B; docs/design/moe.md): at M=1
    (8 pairs) a 4-way K split for gate/up and 2 for down (too few warps: raise the split until
    MIN_WARPS_REPACKED); at M=4 (32 pairs) no split for gate/up (enough programs; two tiles per
    warp already hold many registers). Long weights (Mixtral, DeepSeek-V3) keep the first rule
    (they have the programs)."""
    cfg = _gemm_config(blocks, tiles, chunks)
    wk = cfg.wk
    while wk < 4 and blocks * tiles * wk < MIN_WARPS_REPACKED and chunks >= 8 * wk:
        wk *= 2
    if gate_up and blocks * tiles >= MIN_WARPS_REPACKED and chunks <= 32:
        wk = 1
    return MmaGemmConfig(1, wk, 2 if chunks >= 4 * wk else 1)


def _even_split(cfg: MmaGemmConfig, chunks: int) -> MmaGemmConfig:
    """No K split whose step (WK x UNROLL chunks) leaves a ragged last step: its warps then run
    the predicated loop (Nsight Compute: more instructions, same occupancy and issue rate;
    benchmarks/results/ncu-ksplit-h200-*/). On the H200 a ragged 2 x 2 split lost to no split
    for gpt-oss (45 and 46 chunks); where the split is even it is kept (benchmarks/results/
    ksplit-probe-h200-*.log, docs/design/moe.md)."""
    if cfg.wk > 1 and chunks % (cfg.wk * cfg.unroll):
        return MmaGemmConfig(cfg.wt, 1, 2 if chunks >= 4 else 1)
    return cfg


#: 8-pair blocks on repacked experts: a GEMM with at most this many (block, tile) programs (the
#: blocks counted as the experts that uniform routing is expected to touch) and at least
#: FEW_PROGRAMS_MIN_CHUNKS chunks of K splits K 4 ways with one chunk in flight per warp.
FEW_PROGRAMS = 6144
FEW_PROGRAMS_MIN_CHUNKS = 40


def expected_experts(pairs: int, experts: int) -> float:
    """Experts that ``pairs`` (token, slot) pairs touch on average under uniform routing:
    E (1 - (1 - 1/E)^pairs) (real routers are skewed: they touch fewer)."""
    return experts * (1.0 - (1.0 - 1.0 / experts) ** pairs)


def _few_programs_split(cfg: MmaGemmConfig, programs: float, chunks: int) -> MmaGemmConfig:
    """A 4-way K split with one chunk in flight where a GEMM has few programs and a long K,
    in place of a smaller split (the 16-chunks-a-warp floor of :func:`_gemm_config`, or a
    ragged split :func:`_even_split` dropped). On the H200 it won for gpt-oss-20b (45 chunks,
    ~1900..5700 programs) from M=3 to 16, tied for gpt-oss-120b at ~5650 programs and lost at
    ~9200, hence FEW_PROGRAMS (benchmarks/results/ksplit-probe-h200-*-few*.log,
    docs/design/moe.md)."""
    if cfg.wk < 4 and programs <= FEW_PROGRAMS and chunks >= FEW_PROGRAMS_MIN_CHUNKS:
        return MmaGemmConfig(cfg.wt, 4, 1)
    return cfg


def mma_moe_config(
    pairs: int,
    experts: int,
    inter: int,
    hidden: int,
    *,
    direct: bool,
    nt: int = 1,
    repacked: bool = False,
) -> MmaMoeConfig:
    """Config for ``pairs`` (token, slot) pairs: ``direct`` one block per pair, else blocks of
    8 * nt expert-sorted pairs (at most min(pairs, experts) of them hold tokens). ``repacked``:
    for the mma16x64 experts of :mod:`..mma_layout.moe_gemm` (single pairs tuned apart)."""
    blocks = pairs if direct else min(pairs, experts)
    if repacked and direct:
        g1 = _gemm_config_repacked(blocks, inter // 16, hidden // 64, True)
        g2 = _gemm_config_repacked(blocks, hidden // 16, inter // 64, False)
    elif repacked:
        g1 = _even_split(_gemm_config(blocks, inter // 16, hidden // 64), hidden // 64)
        g2 = _even_split(_gemm_config(blocks, hidden // 16, inter // 64), inter // 64)
        touched = expected_experts(pairs, experts)
        g1 = _few_programs_split(g1, touched * (inter // 16), hidden // 64)
        g2 = _few_programs_split(g2, touched * (hidden // 16), inter // 64)
    else:
        g1 = _gemm_config(blocks, inter // 16, hidden // 64)
        g2 = _gemm_config(blocks, hidden // 16, inter // 64)
    return MmaMoeConfig(1 if direct else nt, g1, g2, direct)



# --------------------------------------------------------------------------------------------
# dequantize + torch._grouped_mm


@dataclass(frozen=True)
class DequantMoeConfig:
    """Dequantize each GEMM's experts to 16-bit, then torch._grouped_mm
    (:attr:`..regimes.MoeRegime.dequant`)."""

    family: ClassVar[Family] = Family.MOE_DEQUANT


def grouped_mm_capable(facts: DeviceFacts) -> bool:
    """torch._grouped_mm runs on the device of ``facts`` (SM 9.0+, compiled kernels)."""
    return facts.grouped_mm


def dequant_buffer_bytes(experts: int, inter: int, hidden: int, gated: bool = True) -> int:
    """Bytes of the 16-bit copy of the larger GEMM's experts."""
    return experts * max((2 * inter if gated else inter) * hidden, hidden * inter) * 2

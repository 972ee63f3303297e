"""Which kernels a MoE call on the checkpoint layout runs, from the static sizes only (graphs and
compile see no data dependence): the tl.dot tiles of this layout (:class:`MoeConfig`), the
mma.sync configs (:class:`..common.moe_plan.MmaMoeConfig`), or dequantize + ``torch._grouped_mm``
(:class:`..common.moe_plan.DequantMoeConfig`). No triton import, so ``quantdispatch doctor``
explains a regime without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from quantdispatch.kernels.common.moe_plan import (
    DequantMoeConfig,
    MmaMoeConfig,
    dequant_buffer_bytes,
    grouped_mm_capable,
    mma_moe_config,
    mma_moe_supported,
)
from quantdispatch.kernels.regimes import CHECKPOINT_MOE, Family

if TYPE_CHECKING:
    from quantdispatch.kernels.common.device_facts import DeviceFacts

__all__ = [
    "MoeConfig",
    "MoeGemmConfig",
    "checkpoint_layout_moe_plan",
    "mma_capable",
]


@dataclass(frozen=True)
class MoeGemmConfig:
    """Tile of one of the two GEMMs (block_m is shared, see :class:`MoeConfig`)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    """``direct``: one block per (token, slot) pair, no alignment (decode with few pairs per
    expert); else pairs are sorted into ``block_m``-row blocks per expert."""

    block_m: int
    gemm1: MoeGemmConfig
    gemm2: MoeGemmConfig
    direct: bool = False
    family: ClassVar[Family] = Family.MOE_TL_DOT


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _narrow_n(n: int, blocks: int, sms: int, start: int) -> int:
    """Largest N tile <= start (>= 16) that still gives about two programs per SM."""
    bn = start
    while bn > 16 and blocks * _cdiv(n, bn) < 2 * sms:
        bn //= 2
    return bn


# --------------------------------------------------------------------------------------------
# the regime (:data:`..regimes.CHECKPOINT_MOE`)


def mma_capable(fmt: str, gated: bool, inter: int, hidden: int, facts: DeviceFacts) -> bool:
    """The mma.sync kernels on the checkpoint layout take this layer on the device of
    ``facts`` (a format of :attr:`..regimes.CHECKPOINT_MOE.mma`, compiled PTX)."""
    if fmt not in CHECKPOINT_MOE.mma.formats or not facts.compiled:
        return False
    return mma_moe_supported(inter, hidden, gated, facts.capability)


#: The tl.dot tiles of the blocks of 32, 64 and 128 pairs (:data:`..regimes.CHECKPOINT_MOE`
#: steps; the 16-pair block narrows its N tiles per call).
_TL_DOT_TILES = {
    32: MoeConfig(32, MoeGemmConfig(64, 128, 4, 3), MoeGemmConfig(64, 128, 4, 3)),
    64: MoeConfig(64, MoeGemmConfig(64, 64, 4, 3), MoeGemmConfig(128, 64, 8, 3)),
    128: MoeConfig(128, MoeGemmConfig(64, 64, 8, 3), MoeGemmConfig(128, 64, 8, 3)),
}


def checkpoint_layout_moe_plan(
    m: int,
    top_k: int,
    experts: int,
    inter: int,
    hidden: int,
    fmt: str,
    facts: DeviceFacts,
    *,
    gated: bool = True,
    allow_mma: bool = True,
    allow_dequant: bool = True,
) -> MoeConfig | MmaMoeConfig | DequantMoeConfig:
    """Tiles from the static sizes only (so graphs and compile see no data dependence), on the
    device of ``facts``, by the row :data:`..regimes.CHECKPOINT_MOE`.

    Tokens per expert ``tpe = M * top_k / E`` picks the regime: dequantize + grouped_mm from
    its ``dequant`` threshold (NVFP4 / MXFP4, SM 9.0+); NVFP4 on SM 8.0+ up to its ``mma``
    threshold: the mma.sync kernels on single pairs (``direct``) or 8-pair blocks
    (:func:`..common.moe_plan.mma_moe_config`). Otherwise tl.dot kernels by its steps: small
    16-row blocks with narrow N tiles (memory bound: cover every SM) and long K steps; then 32,
    64, 128-row blocks with wider tiles (compute bound: reuse each decoded weight tile across
    more rows). ``direct`` for single pairs (experts rarely repeat).
    """
    row = CHECKPOINT_MOE
    pairs = m * top_k
    tpe = pairs / max(experts, 1)
    fp8 = fmt == "fp8"
    if (
        allow_dequant
        and fmt in row.dequant.formats
        and tpe >= row.dequant.min_tokens_per_expert
        and dequant_buffer_bytes(experts, inter, hidden, gated) <= row.dequant.max_buffer_bytes
        and grouped_mm_capable(facts)
    ):
        return DequantMoeConfig()
    direct = row.single_pairs(pairs, experts)
    if (
        allow_mma
        and tpe <= row.mma.max_tokens_per_expert
        and mma_capable(fmt, gated, inter, hidden, facts)
    ):
        return mma_moe_config(pairs, experts, inter, hidden, direct=direct)
    step = row.step(tpe)
    if step.block_m in _TL_DOT_TILES:
        return _TL_DOT_TILES[step.block_m]
    blocks = pairs if direct else min(pairs, experts)
    bk = 128 if fp8 else 256
    g1 = MoeGemmConfig(_narrow_n(inter, blocks, facts.sm_count, 64), bk, 4, 3)
    g2 = MoeGemmConfig(_narrow_n(hidden, blocks, facts.sm_count, 64), bk, 4, 3)
    return MoeConfig(step.block_m, g1, g2, direct)

"""Which layout a weight is prepared in and which kernel family a call runs: pure functions of
(format, layout + meta, sizes, device facts), read from the regime table
(:mod:`quantdispatch.kernels.regimes`). The run path (:mod:`.run`) and ``kernel_ranges``
(:mod:`.facts`) both call them, so a layer and doctor cannot disagree. No triton import.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from quantdispatch.backends.base import (
    CheckpointMeta,
    KernelRange,
    Layout,
    LayoutMeta,
    Mma16x64Meta,
)
from quantdispatch.backends.triton.meta import fp8_compute_of_meta, with_fp8_compute
from quantdispatch.capability import SM80_PLUS
from quantdispatch.formats import FP4_FORMATS
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.regimes import (
    Family,
    Fp8PrefillRegime,
    LinearRegime,
    Step,
    fp8_prefill_regime,
    linear_regime,
)

if TYPE_CHECKING:
    from quantdispatch.device import DeviceProfile

__all__ = [
    "FP4",
    "facts_for",
    "fp8_row",
    "layout_moe_plan",
    "linear_family",
    "linear_layout",
    "linear_ranges",
    "linear_row",
    "linear_steps",
    "moe_layout",
    "moe_ranges",
]

FP4 = FP4_FORMATS
_16_BIT = (torch.bfloat16, torch.float16)
#: The last M the MoE ranges scan (the last range goes on beyond it).
MOE_SCAN_MAX_M = 1 << 16


def facts_for(profile: DeviceProfile) -> DeviceFacts:
    """The device facts of a profile: asked of the device when it is this machine's GPU, from
    its compute capability when simulated (or a CPU)."""
    probed = profile.kind == "cuda" and not profile.simulated and profile.torch_cuda
    if probed and torch.cuda.is_available():
        return device_facts(torch.device("cuda", profile.index or 0))
    return DeviceFacts.for_capability(profile.capability, profile.sm_count)


# --------------------------------------------------------------------------------------------
# linear


def linear_layout(
    fmt: str, n: int, k: int, act_dtype: torch.dtype, capability: tuple[int, int] | None
) -> Layout:
    """The layout prepare puts an N x K weight in: NVFP4 / MXFP4 on SM 8.0+ (bf16 mma.sync),
    N a multiple of 16 and K of 64, 16-bit activations: mma16x64 (MXFP4 also needs its
    scales to span at most 18 binades, checked when it repacks: else the checkpoint layout).
    Everything else keeps the checkpoint layout."""
    from quantdispatch.kernels.mma_layout.layout import mma_supported_shape

    if (
        fmt in FP4
        and capability in SM80_PLUS
        and mma_supported_shape(n, k)
        and act_dtype in _16_BIT
    ):
        return Layout.MMA16X64
    return Layout.CHECKPOINT


def linear_row(
    fmt: str, layout: Layout, meta: LayoutMeta, n: int, k: int, facts: DeviceFacts
) -> LinearRegime:
    """The regime table's row for this prepared weight on this device."""
    flags = meta.flags() if isinstance(meta, CheckpointMeta) else frozenset()
    return linear_regime(fmt, layout.value, facts.capability, n, k, flags)


def fp8_row(fmt: str, meta: LayoutMeta, facts: DeviceFacts) -> Fp8PrefillRegime | None:
    """The enabled FP8 compute row of a weight prepared for FP8 compute (its meta's mode, set
    by prepare where the row applies: backends.triton.fp8_compute), else None."""
    mode = fp8_compute_of_meta(meta)
    if mode == "off":
        return None
    row = fp8_prefill_regime(fmt, facts.capability, mode)
    return row if row is not None and row.min_m is not None else None


@functools.lru_cache(maxsize=1024)
def linear_steps(
    fmt: str, layout: Layout, meta: LayoutMeta, n: int, k: int, facts: DeviceFacts
) -> tuple[tuple[int | None, Family], ...]:
    """(largest M or None, family) per step of the weight's row, FP8 compute included (cached:
    the op path asks each call; the bound path once)."""
    row = linear_row(fmt, layout, meta, n, k, facts)
    return tuple((top, s.family) for top, s in row.steps_for(n, k, fp8_row(fmt, meta, facts)))


def linear_family(
    fmt: str, layout: Layout, meta: LayoutMeta, m: int, n: int, k: int, facts: DeviceFacts
) -> Family:
    """The kernel family a call with ``m`` rows runs (:meth:`LinearRegime.family`)."""
    for top, family in linear_steps(fmt, layout, meta, n, k, facts):
        if top is None or m <= top:
            return family
    raise AssertionError(f"the last step of the {fmt} {layout.value} row must take any M")


def linear_ranges(
    fmt: str, layout: Layout, meta: LayoutMeta, n: int, k: int, facts: DeviceFacts
) -> tuple[KernelRange, ...]:
    """The kernel family for every range of M (the last range goes on)."""
    row = linear_row(fmt, layout, meta, n, k, facts)
    ranges = row.ranges(n, k, fp8_row(fmt, meta, facts))
    return tuple(KernelRange(a, b, s.family, _detail(s, meta)) for a, b, s in ranges)


def _detail(step: Step, meta: LayoutMeta) -> str:
    """A range's detail; FP8 compute's says whether the weight is re-encoded per call."""
    if step.family is not Family.FP8_PREFILL:
        return step.family.detail
    resident = fp8_compute_of_meta(meta) == "prefill-resident"
    return f"{step.family.detail}; {'resident FP8 copy' if resident else 're-encoded per call'}"


def prepared_meta(layout: Layout, act_dtype: torch.dtype, fp8_compute: str = "off") -> LayoutMeta:
    """The meta prepare gives a weight of ``layout`` (the common case: no rebase, no block)
    with FP8 compute mode ``fp8_compute`` (as prepare's ``fp8_compute.mode_for`` answers)."""
    base = Mma16x64Meta(act_dtype) if layout is Layout.MMA16X64 else CheckpointMeta()
    return with_fp8_compute(base, fp8_compute)


# --------------------------------------------------------------------------------------------
# MoE


def moe_layout(
    fmt: str, inter: int, hidden: int, gated: bool, capability: tuple[int, int] | None
) -> Layout:
    """The layout prepare_moe puts the experts in: NVFP4 / MXFP4 experts of a gated layer on
    SM 8.0+ with I and H multiples of 64 are repacked (mma16x64; MXFP4 when every expert's
    scales span <= 18 binades); the rest keep the checkpoint layout."""
    from quantdispatch.kernels.mma_layout.moe_plan import moe_layout_supported

    if fmt in FP4 and moe_layout_supported(inter, hidden, gated, capability):
        return Layout.MMA16X64
    return Layout.CHECKPOINT


def layout_moe_plan(
    fmt: str,
    layout: Layout,
    m: int,
    top_k: int,
    experts: int,
    inter: int,
    hidden: int,
    facts: DeviceFacts,
    *,
    gated: bool = True,
    aligned: bool = True,
    pdl: bool = True,
) -> object:
    """The launch config a MoE call runs (its ``family`` names the kernel family), by the
    layout's plan. ``aligned``: the checkpoint stacks' rows suit the mma kernels."""
    if layout is Layout.MMA16X64:
        from quantdispatch.kernels.mma_layout.moe_plan import mma_layout_moe_plan

        return mma_layout_moe_plan(m, top_k, experts, inter, hidden, facts, pdl=pdl)
    from quantdispatch.kernels.checkpoint_layout.moe_plan import checkpoint_layout_moe_plan

    return checkpoint_layout_moe_plan(
        m, top_k, experts, inter, hidden, fmt, facts, gated=gated, allow_mma=aligned
    )


@functools.lru_cache(maxsize=256)
def moe_ranges(
    fmt: str,
    layout: Layout,
    top_k: int,
    experts: int,
    inter: int,
    hidden: int,
    facts: DeviceFacts,
    *,
    pdl: bool = True,
) -> tuple[KernelRange, ...]:
    """The kernel family for every range of M of a gated MoE layer (the last range goes on).
    Repacked experts: one range per launch config (its words as the detail); the checkpoint
    layout: one range per kernel family."""
    from quantdispatch.kernels.mma_layout.moe_plan import describe_moe_config

    def key(m: int) -> object:
        cfg = layout_moe_plan(fmt, layout, m, top_k, experts, inter, hidden, facts, pdl=pdl)
        return cfg if layout is Layout.MMA16X64 else cfg.family  # type: ignore[attr-defined]

    def range_of(first: int, last: int | None, k: object) -> KernelRange:
        if isinstance(k, Family):
            return KernelRange(first, last, k, k.detail)
        return KernelRange(first, last, k.family, describe_moe_config(k))  # type: ignore[attr-defined,arg-type]

    out: list[KernelRange] = []
    start, prev = 1, key(1)
    for m in range(2, MOE_SCAN_MAX_M + 1):
        now = key(m)
        if now != prev:
            out.append(range_of(start, m - 1, prev))
            start, prev = m, now
    out.append(range_of(start, None, prev))
    return tuple(out)

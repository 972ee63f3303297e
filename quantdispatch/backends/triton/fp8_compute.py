"""FP8 compute for prefill in the triton backend (opt-in, lossy; ``QUANTDISPATCH_FP8_COMPUTE``).

Which weights take it: an NVFP4 / MXFP4 linear whose FP8 compute row in the regime table
(:data:`quantdispatch.kernels.regimes.FP8_PREFILL_REGIMES`) is enabled on the device and that
``kernels.native.fp8_prefill.prefill_reasons`` accepts with the block-scaled recipe (the enabled
rows are SM 9.0 ones: the H200 sweep timed those recipes). :func:`mode_for` is that rule;
``prepare`` records its answer in the weight's meta (:mod:`.meta`) and ``kernel_ranges``
asks it for the meta prepare would give, so a layer and doctor agree. The mode comes from the
backend's options (:class:`.options.TritonOptions`). With
``prefill-resident`` the re-encoded weight is kept as two more tensors (:data:`RESIDENT_NAMES`).
Also the words for the decision trace. No triton import at module level: the FP8 prefill
kernels' module (which imports triton) is imported when a rule is asked, which only happens for
a request the triton backend accepted (its provider, triton, importable).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from quantdispatch.backends.base import CheckpointMeta, Layout, PreparedWeight, op_view
from quantdispatch.backends.triton.meta import with_fp8_compute
from quantdispatch.backends.triton.tensors import linear_tensors
from quantdispatch.capability import fmt_sm
from quantdispatch.errors import WeightFormatError
from quantdispatch.format_facts import FP4_FORMATS
from quantdispatch.kernels.regimes import Fp8PrefillRegime, fp8_prefill_regime
from quantdispatch.settings import FP8_COMPUTE_MODES

if TYPE_CHECKING:
    from quantdispatch.kernels.native.fp8_handoff import ActivationHandoff
    from quantdispatch.kernels.native.fp8_prefill import PrefillWeight

__all__ = [
    "OFF",
    "PREFILL",
    "RESIDENT",
    "RESIDENT_NAMES",
    "add_fp8_compute",
    "availability",
    "cuda_of",
    "handing_off",
    "handoff_in_use",
    "mode_for",
    "recipe_for",
    "resident_bytes",
    "resident_weight",
    "trace_note",
]

logger = logging.getLogger("quantdispatch")

OFF, PREFILL, RESIDENT = FP8_COMPUTE_MODES
#: The resident copy's buffers, after the weight's own: e4m3 [N, K] and its fp32 block scales
#: stored contiguous (:func:`resident_weight` views them as the GEMM takes them).
RESIDENT_NAMES = ("fp8_weight", "fp8_scale")
_FP4 = FP4_FORMATS
_SETTING = "QUANTDISPATCH_FP8_COMPUTE"


_handoff: contextvars.ContextVar[ActivationHandoff | None] = contextvars.ContextVar(
    "quantdispatch_fp8_handoff", default=None
)


@contextlib.contextmanager
def handing_off(handoff: ActivationHandoff) -> Iterator[None]:
    """While open, the FP8 prefill kernels of this thread take x's codes from ``handoff`` and
    offer theirs to it (its owner, e.g. the HF integration's scope, promises what
    kernels/native/fp8_handoff.py asks)."""
    token = _handoff.set(handoff)
    try:
        yield
    finally:
        _handoff.reset(token)


def handoff_in_use() -> ActivationHandoff | None:
    """The handoff a caller opened with :func:`handing_off`, else None (each linear quantizes
    its own input)."""
    return _handoff.get()


def _kernels() -> ModuleType:
    from quantdispatch.kernels.native import fp8_prefill

    return fp8_prefill


def cuda_of(version: str | None) -> tuple[int, int] | None:
    """``"12.8"`` -> (12, 8); None or unreadable: None (then this torch's build is asked)."""
    try:
        major, minor = (version or "").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def recipe_for(k: int) -> str:
    """The recipe FP8 compute runs (the enabled rows are SM 9.0 ones): block-scaled."""
    return _kernels().block_recipe(k)


def availability(
    fmt: str,
    n: int | None,
    k: int | None,
    act_dtype: torch.dtype,
    capability: tuple[int, int] | None,
    mode: str,
    cuda_version: tuple[int, int] | None = None,
) -> tuple[Fp8PrefillRegime | None, list[str]]:
    """(the FP8 compute row for ``mode`` here, why it cannot apply: empty when it does). An
    unknown shape (``n`` / ``k`` None) is checked on the smallest one FP8 compute takes."""
    row = fp8_prefill_regime(fmt, capability, mode)
    fp8p = _kernels()
    n, k = n or 16, k or 128
    if row is None:
        reasons = fp8p.prefill_reasons(fmt, n, k, act_dtype, capability, None, cuda_version)
        where = f"SM {fmt_sm(capability)}" if capability else "this device"
        return None, reasons or [f"no FP8 compute row for {fmt} on {where}"]
    if row.min_m is None:
        return row, [f"off on SM {fmt_sm(capability)} ({row.why})"]  # type: ignore[arg-type]
    recipe = recipe_for(k)
    return row, fp8p.prefill_reasons(fmt, n, k, act_dtype, capability, recipe, cuda_version)


def mode_for(
    fmt: str,
    n: int,
    k: int,
    act_dtype: torch.dtype,
    capability: tuple[int, int] | None,
    mode: str,
    cuda_version: tuple[int, int] | None = None,
) -> str:
    """The FP8 compute mode a weight gets: ``mode`` where its row applies, else off."""
    if mode == OFF:
        return OFF
    _row, reasons = availability(fmt, n, k, act_dtype, capability, mode, cuda_version)
    return OFF if reasons else mode


def resident_bytes(n: int, k: int) -> int:
    """Bytes of an N x K weight's resident FP8 copy (e4m3 weight + fp32 block scales)."""
    return _kernels().resident_nbytes(n, k, recipe_for(k))


def resident_weight(q: torch.Tensor, scale: torch.Tensor) -> PrefillWeight:
    """The resident copy from its two buffers, as the GEMM takes it."""
    recipe = recipe_for(q.shape[1])
    natural = scale.t() if recipe == "1x128" else scale  # 1x128 scales are [K/128, N] stored
    return _kernels().PrefillWeight(op_view(q, torch.float8_e4m3fn), natural, recipe)


def _build_resident(prepared: PreparedWeight, fmt: str, recipe: str) -> PrefillWeight:
    fp8p = _kernels()
    meta = prepared.meta
    a, b, c = linear_tensors(prepared.tensors, fmt, prepared.layout, meta)  # type: ignore[misc]
    if prepared.layout is Layout.MMA16X64:
        act = meta.packed_for  # type: ignore[union-attr]
        return fp8p.make_resident_mma(a, b, c, recipe=recipe, act_dtype=act)
    return fp8p.make_resident(a, b, c, fmt=fmt, recipe=recipe)


def add_fp8_compute(
    prepared: PreparedWeight,
    fmt: str,
    act_dtype: torch.dtype,
    capability: tuple[int, int] | None,
    mode: str,
) -> PreparedWeight:
    """``prepared`` with its FP8 compute mode in the meta (off where :func:`mode_for` says so,
    for fp16-rebased MXFP4 scales, and for MXFP4 scales outside the re-encoder's range), and
    for ``prefill-resident`` the resident copy appended (:data:`RESIDENT_NAMES`)."""
    n, k = prepared.out_features, prepared.in_features
    mode = mode_for(fmt, n, k, act_dtype, capability, mode)
    meta = prepared.meta
    if mode == OFF or (isinstance(meta, CheckpointMeta) and meta.fp16_rebased):
        return prepared
    if prepared.layout is Layout.CHECKPOINT and fmt == "mxfp4":
        from quantdispatch.formats.fp8_prefill import check_mx_exponents

        try:
            named = linear_tensors(prepared.tensors, fmt, prepared.layout, meta)
            check_mx_exponents(named[1], "FP8 compute")
        except WeightFormatError as exc:
            logger.warning("quantdispatch: FP8 compute off for this %dx%d weight: %s", n, k, exc)
            return prepared
    names, tensors = prepared.names, prepared.tensors
    extra = dict(prepared.extra)
    if mode == RESIDENT:
        res = _build_resident(prepared, fmt, recipe_for(k))
        stored = (res.scale.t() if res.recipe == "1x128" else res.scale).contiguous()
        names, tensors = (*names, *RESIDENT_NAMES), (*tensors, res.q, stored)
        extra["fp8_resident_bytes"] = res.nbytes()
    return dataclasses.replace(
        prepared,
        names=names,
        tensors=tensors,
        meta=with_fp8_compute(meta, mode),  # type: ignore[arg-type]
        extra=extra,
    )


def trace_note(
    fmt: str,
    n: int | None,
    k: int | None,
    act_dtype: torch.dtype,
    capability: tuple[int, int] | None,
    mode: str,
    cuda_version: tuple[int, int] | None = None,
) -> str:
    """The decision trace's words on FP8 compute for a linear of ``fmt`` here: from which M it
    runs when on, why not when on and it cannot, one clause that it exists when off and it
    could, nothing otherwise."""
    ask = RESIDENT if mode == OFF else mode
    row, reasons = availability(fmt, n, k, act_dtype, capability, ask, cuda_version)
    if mode == OFF:
        return "" if reasons else f"lossy FP8 compute for prefill available ({_SETTING})"
    if reasons:
        return f"FP8 compute ({mode}) not used: {'; '.join(reasons)}"
    assert row is not None and row.min_m is not None
    how = "FP4 weight re-encoded per call" if mode == PREFILL else "resident FP8 copy"
    if n is None or k is None:
        where = " where N % 16 == 0 and K % 128 == 0"
        if mode == RESIDENT:
            how += ", 1 byte per weight + scales"
    else:
        where = ""
        if mode == RESIDENT:
            how += f", {resident_bytes(n, k) / 1e6:.1f} MB"
    return f"lossy: FP8 compute from M >= {row.min_m}{where} ({how}; {_SETTING}={mode})"

"""What the triton backend can run and why not, and the words doctor prints for its kernels:
all read from the regime table (:mod:`quantdispatch.kernels.regimes`) through
:mod:`.dispatch`. No triton import at module level (doctor explains without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantdispatch.backends.facts import BackendFacts, KernelRange
from quantdispatch.backends.prepared import Layout
from quantdispatch.backends.triton import dispatch
from quantdispatch.backends.triton import fp8_compute as _fp8
from quantdispatch.backends.triton.options import TritonOptions, options_of
from quantdispatch.capability import (
    ANY_DEVICE,
    SM9X,
    SM75_PLUS,
    SM80_PLUS,
    SM90_PLUS,
    CapabilitySet,
)
from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.formats.mxfp4 import FP16_MX_EXPONENTS
from quantdispatch.kernels.mma_layout.layout import CHUNK_K, MX_SCALE_SPAN, TILE_N
from quantdispatch.kernels.regimes import (
    LINEAR_REGIMES,
    MMA_LAYOUT_MOE,
    Family,
    LinearRegime,
)
from quantdispatch.request import Op, Request

if TYPE_CHECKING:
    from quantdispatch.device import DeviceProfile
    from quantdispatch.kernels.common.device_facts import DeviceFacts
    from quantdispatch.policy import Policy
    from quantdispatch.settings import Settings

__all__ = ["TritonFacts"]

_CHECKPOINT_LAYOUT_TEXT = (
    "tl.dot kernels on the checkpoint layout; large M: dequantized slabs + cuBLAS"
)
#: The MXFP4 weights the mma16x64 layout takes (the rest keep the checkpoint layout).
_MX_SPAN_TEXT = f"weights whose block scales span <= {MX_SCALE_SPAN} binades"


def _mode(options: object) -> str:
    """The FP8 compute mode of the backend's options (None: the defaults')."""
    return (options if isinstance(options, TritonOptions) else TritonOptions()).fp8_compute


def _row(fmt: str, layout: str, sm: CapabilitySet) -> LinearRegime:
    """The table's row (without a meta flag) for doctor's words."""
    return next(
        r for r in LINEAR_REGIMES
        if fmt in r.formats and r.layout == layout and r.sm is sm and r.when is None
    )  # fmt: skip


def _top(row: LinearRegime, family: Family, large: bool = False) -> int | None:
    """The largest M of ``family``'s step in ``row`` (for weights of its large class)."""
    i = next(i for i, s in enumerate(row.steps) if s.family is family)
    if large:
        assert row.large is not None
        return row.large.max_m[i]
    return row.steps[i].max_m


def _rs_wgmma_note(facts: DeviceFacts) -> str:
    """doctor's note while the installed Triton is not known to pipeline register-operand
    wgmma safely (kernels/common/wgmma_guard.py)."""
    if not facts.rs_wgmma_hazard:
        return ""
    from quantdispatch.kernels.common import wgmma_guard as wh

    have = ".".join(map(str, wh.triton_version()))
    if wh.triton_version() < wh.UPSTREAM_FIX:
        why = f"Triton {have} overlaps register-operand wgmma unsafely (triton-lang/triton#9433)"
    else:
        why = f"Triton {have}'s fix of triton-lang/triton#9433 is not yet verified by us"
    return f", each K step waits for its wgmmas: {why}"


def _fp4_ranges_text(mma_top: str, gemm_top: str | None, facts: DeviceFacts) -> str:
    """doctor's words for a repacked FP4 linear's kernels by M: the mma kernel up to
    ``mma_top``, the wgmma GEMM up to ``gemm_top`` (None: no GEMM), then dequantized slabs."""
    text = (
        f"M <= {mma_top}: mma.sync kernel with PTX decode on a repacked weight (mma16x64, "
        "same bytes)"
    )
    if gemm_top is not None:
        text += f"; M <= {gemm_top}: tl.dot (wgmma) GEMM decoding the same weight"
        text += ", activation tiles by TMA" if facts.tma else ""
        text += _rs_wgmma_note(facts)
    return text + "; larger M: dequantized slabs + cuBLAS"


_ALL = frozenset({Op.LINEAR, Op.MOE})


class TritonFacts(BackendFacts):
    """The triton backend's facts: device and shape rules, doctor's words, kernel ranges."""

    name = "triton"
    title = "quantdispatch Triton weight-only GEMM (weights dequantized in registers)"
    supports = {"nvfp4": _ALL, "mxfp4": _ALL, "fp8": _ALL}
    implemented = {"nvfp4": _ALL, "mxfp4": _ALL, "fp8": _ALL}
    provider = "triton"
    weight_only = True
    min_sm = (SM75_PLUS, SM80_PLUS)  # no bf16 tensor cores before Ampere

    def shape_reasons(self, request: Request) -> list[str]:
        return self.group_reasons(request)

    def variant(self, request: Request, profile: DeviceProfile) -> str | None:
        if request.format == "fp8" and request.op is Op.LINEAR:
            from quantdispatch.kernels.common.configs import SMALL_M_MAX, WIDE_N_MIN

            row = _row("fp8", "checkpoint", ANY_DEVICE)
            assert row.large is not None
            first = _top(row, Family.FP8_TL_DOT)
            first_large = _top(row, Family.FP8_TL_DOT, large=True)
            assert first is not None and first_large is not None
            return (
                "W8A16: a tl.dot kernel with K split inside each program or a tiled one, per "
                f"shape and M from the tuned table or the heuristics (these split up to M = "
                f"{SMALL_M_MAX} below {WIDE_N_MIN} rows); from M = {first + 1} "
                f"({first_large + 1} for weights {row.large.describe()}): "
                "dequantized slabs + cuBLAS"
            )
        if request.format not in dispatch.FP4:
            return None
        if request.op is Op.MOE:
            return self._moe_text(request, profile)
        if request.op is not Op.LINEAR:
            return None
        text = self._fp4_linear_text(request, profile)
        if request.format == "mxfp4" and request.act_dtype == torch.float16:
            lo, hi = FP16_MX_EXPONENTS
            text += (
                f"; fp16 on the checkpoint layout: a weight whose block scales leave "
                f"2^{lo}..2^{hi} is rebased at load (2^d in the fused kernels' fp32 epilogue, "
                "which it then runs at every M)"
            )
        return text

    def _moe_text(self, request: Request, profile: DeviceProfile) -> str:
        if profile.capability not in SM80_PLUS:
            return "fused tl.dot kernels on the checkpoint layout"
        row = MMA_LAYOUT_MOE
        few = f"<= {row.mma.max_tokens_per_expert}"
        many = (
            f"{row.dequant.min_tokens_per_expert}+ tokens per expert on experts of "
            f"2^{row.dequant.min_expert_elements.bit_length() - 1}+ elements"
        )
        spans = (
            f" whose scales span <= {MX_SCALE_SPAN} binades" if request.format == "mxfp4" else ""
        )
        text = (
            f"gated layers with I and H multiples of {CHUNK_K}{spans}: experts repacked once "
            f"(mma16x64, same bytes); {few} tokens per expert: mma.sync kernels with PTX "
            "decode (the top-k sum inside the down kernel where each pair has its own "
            "expert); more: a grouped tl.dot GEMM decoding the same weight"
        )
        if profile.capability in SM90_PLUS:
            text += (
                f"; {many}: experts dequantized per GEMM + torch._grouped_mm; the "
                "single-pair down kernel is a programmatic dependent launch (it loads its "
                "weights while gate/up runs)"
            )
        return text + "; other layers: the checkpoint layout and fused tl.dot kernels"

    def _fp4_linear_text(self, request: Request, profile: DeviceProfile) -> str:
        if request.n is None or request.k is None:
            return self._linear_rules_text(request, profile)
        n, k = request.n, request.k
        fmt, cap = request.format, profile.capability
        layout = dispatch.linear_layout(fmt, n, k, request.act_dtype, cap)
        if layout is not Layout.MMA16X64:
            return _CHECKPOINT_LAYOUT_TEXT
        facts = dispatch.facts_for(profile)
        meta = dispatch.prepared_meta(layout, request.act_dtype)
        row = dispatch.linear_row(fmt, layout, meta, n, k, facts)
        tops = dict(zip((s.family for s in row.steps), row.max_ms(n, k), strict=True))
        gemm_top = tops.get(Family.WGMMA_GEMM)
        text = _fp4_ranges_text(
            str(tops[Family.MMA_GEMV]), str(gemm_top) if gemm_top else None, facts
        )
        if fmt == "mxfp4":
            return f"{_MX_SPAN_TEXT}: {text}; wider spans: tl.dot kernels on the checkpoint layout"
        return text

    def _linear_rules_text(self, request: Request, profile: DeviceProfile) -> str:
        """The kernel ranges of an FP4 linear whose shape is not given (doctor without
        ``--shape``): the rules by weight size, not one made-up shape's answer."""
        cap, fmt = profile.capability, request.format
        granule = (TILE_N, CHUNK_K)
        if dispatch.linear_layout(fmt, *granule, request.act_dtype, cap) is not Layout.MMA16X64:
            return _CHECKPOINT_LAYOUT_TEXT
        facts = dispatch.facts_for(profile)
        if cap in SM9X:
            row = _row(fmt, "mma16x64", SM9X)
            assert row.large is not None
            big = f"for weights {row.large.describe()}"
            mma = Family.MMA_GEMV
            gemm = Family.WGMMA_GEMM
            text = _fp4_ranges_text(
                f"{_top(row, mma)} ({_top(row, mma, True)} {big})",
                f"{_top(row, gemm)} ({_top(row, gemm, True)} {big}) where N is a multiple of "
                f"{row.multiple_of[0]}",
                facts,
            )
        else:
            row = _row(fmt, "mma16x64", ANY_DEVICE)
            assert row.large is not None
            big = f"for weights {row.large.describe()}"
            mma = Family.MMA_GEMV
            text = _fp4_ranges_text(f"{_top(row, mma)} ({_top(row, mma, True)} {big})", None, facts)
        where = f"N a multiple of {TILE_N} and K of {CHUNK_K}"
        if fmt == "mxfp4":
            where = f"{_MX_SPAN_TEXT}, {where}"
        return (
            f"{where}: {text}; other shapes: tl.dot kernels on the checkpoint layout (doctor "
            "--shape NxK answers for one layer)"
        )

    def kernel_ranges(
        self,
        request: Request,
        profile: DeviceProfile,
        *,
        top_k: int | None = None,
        pdl: bool = True,
        options: object = None,
    ) -> tuple[KernelRange, ...]:
        """Linear: needs the request's N and K. MoE: needs ``top_k``, the request's experts,
        N = I and K = H (gated experts assumed). The layout and meta are the ones prepare gives
        such a weight (MXFP4: scales within the layout's span, and fp16's range in fp16),
        the options' FP8 compute included where it applies (:func:`.fp8_compute.mode_for`)."""
        if request.op is Op.MOE:
            return self._moe_ranges(request, profile, top_k, pdl)
        if request.n is None or request.k is None:
            raise ConfigurationError(
                format_error(
                    f"{request.describe()} has no weight shape",
                    "the triton backend's kernel for a given M depends on N x K",
                    "pass n= and k= to select() (doctor: --shape NxK)",
                )
            )
        n, k, fmt, act = request.n, request.k, request.format, request.act_dtype
        layout = dispatch.linear_layout(fmt, n, k, act, profile.capability)
        cuda = _fp8.cuda_of(profile.cuda_version)
        mode = _fp8.mode_for(fmt, n, k, act, profile.capability, _mode(options), cuda)
        meta = dispatch.prepared_meta(layout, act, mode)
        return dispatch.linear_ranges(fmt, layout, meta, n, k, dispatch.facts_for(profile))

    def options(self, settings: Settings, policy: Policy) -> TritonOptions:
        return options_of(settings, policy)

    def accepted_note(
        self, request: Request, profile: DeviceProfile, options: object = None
    ) -> str:
        """The base note, then FP8 compute's clause for an FP4 linear (from which M it runs,
        or that it exists)."""
        note = super().accepted_note(request, profile, options)
        if request.op is not Op.LINEAR or request.format not in dispatch.FP4:
            return note
        extra = _fp8.trace_note(
            request.format, request.n, request.k, request.act_dtype, profile.capability,
            _mode(options), _fp8.cuda_of(profile.cuda_version),
        )  # fmt: skip
        return f"{note}; {extra}" if extra else note

    def option_facts(self, request: Request, profile: DeviceProfile, options: object) -> dict:
        """``fp8_resident_bytes``: what a resident FP8 copy of this linear's weight would take
        here (FP8 compute's ``prefill-resident``; None: no such copy for it)."""
        n, k = request.n, request.k
        if request.op is not Op.LINEAR or n is None or k is None:
            return {"fp8_resident_bytes": None}
        cuda = _fp8.cuda_of(profile.cuda_version)
        _row, reasons = _fp8.availability(
            request.format, n, k, request.act_dtype, profile.capability, _fp8.RESIDENT, cuda
        )
        return {"fp8_resident_bytes": None if reasons else _fp8.resident_bytes(n, k)}

    def _moe_ranges(
        self, request: Request, profile: DeviceProfile, top_k: int | None, pdl: bool
    ) -> tuple[KernelRange, ...]:
        e, inter, hidden = request.experts, request.n, request.k
        if top_k is None or e is None or inter is None or hidden is None:
            raise ConfigurationError(
                format_error(
                    f"{request.describe()} with top_k={top_k}",
                    "the MoE kernel for a given M depends on experts, top-k, I and H",
                    "pass experts=, n=I, k=H to select() and top_k= here (doctor: --moe)",
                )
            )
        fmt = request.format
        layout = dispatch.moe_layout(fmt, inter, hidden, True, profile.capability)
        facts = dispatch.facts_for(profile)
        return dispatch.moe_ranges(fmt, layout, top_k, e, inter, hidden, facts, pdl=pdl)

"""The triton backend's prepare step: the layout a weight (or a MoE layer's experts) is put in,
once, at load (:func:`.dispatch.linear_layout`, :func:`.dispatch.moe_layout`), and the repack
into it. The mma16x64 layout holds the same bytes as the checkpoint (no second copy). With FP8
compute on (:mod:`.fp8_compute`), the weight's meta (:mod:`.meta`) records the mode it runs and
``prefill-resident`` adds the resident FP8 copy.
"""

from __future__ import annotations

import torch

from quantdispatch.backends.base import (
    CheckpointMeta,
    ExpertStacks,
    Layout,
    Mma16x64Meta,
    PreparedMoe,
    PreparedWeight,
)
from quantdispatch.backends.triton import dispatch
from quantdispatch.backends.triton import fp8_compute as _fp8
from quantdispatch.backends.triton.tensors import prepared
from quantdispatch.errors import WeightFormatError, format_error
from quantdispatch.kernels.common.device_facts import device_facts
from quantdispatch.request import Request

__all__ = ["canonical_moe_check", "prepare_linear", "prepare_moe"]


def _capability(device: torch.device) -> tuple[int, int] | None:
    return device_facts(device).capability


def prepare_linear(weight, request: Request, fp8_compute: str = "off") -> PreparedWeight:  # type: ignore[no-untyped-def]
    """The backend's tensors for the NVFP4 / MXFP4 / FP8 weight of ``request``'s format
    (checked by ``Backend.check_weight``); ``fp8_compute``: the options' FP8 compute mode (FP4
    weights)."""
    fmt = request.format
    if fmt == "fp8":
        return _fp8_weight(weight)
    prepared = _nvfp4(weight, request) if fmt == "nvfp4" else _mxfp4(weight, request)
    if fp8_compute == _fp8.OFF:
        return prepared
    cap = _capability(weight.packed.device)
    return _fp8.add_fp8_compute(prepared, fmt, request.act_dtype, cap, fp8_compute)


def _fp8_weight(weight) -> PreparedWeight:  # type: ignore[no-untyped-def]
    block = tuple(weight.block_size) if weight.block_size else None
    meta = CheckpointMeta(block_size=block)  # type: ignore[arg-type]
    leading = (weight.weight, weight.scale)
    return prepared("fp8", leading, meta, weight.shape, weight.input_scale)


def _nvfp4(weight, request: Request) -> PreparedWeight:  # type: ignore[no-untyped-def]
    n, k = weight.shape
    cap = _capability(weight.packed.device)
    act = request.act_dtype
    if dispatch.linear_layout("nvfp4", n, k, act, cap) is Layout.MMA16X64:
        from quantdispatch.kernels.mma_layout.layout import repack

        words, scales = repack(weight.packed, weight.block_scale.view(torch.uint8), act)
        leading = (words, scales, weight.global_scale)
        return prepared("mma", leading, Mma16x64Meta(act), (n, k), weight.input_scale)
    leading = (weight.packed, weight.block_scale, weight.global_scale)
    return prepared("nvfp4", leading, CheckpointMeta(), (n, k), weight.input_scale)


def _mxfp4(weight, request: Request) -> PreparedWeight:  # type: ignore[no-untyped-def]
    n, k = weight.shape
    device = weight.packed.device
    act = request.act_dtype
    if dispatch.linear_layout("mxfp4", n, k, act, _capability(device)) is Layout.MMA16X64:
        from quantdispatch.kernels.mma_layout.layout import repack_mx

        try:
            words, scales, global_scale = repack_mx(weight.packed, weight.block_scale, act)
        except WeightFormatError:  # scales too wide apart: the checkpoint layout
            pass
        else:
            return prepared("mma", (words, scales, global_scale), Mma16x64Meta(act), (n, k))
    if act == torch.float16:
        from quantdispatch.formats.mxfp4 import rebase_mx_scales_for_fp16

        codes, d = rebase_mx_scales_for_fp16(weight.packed, weight.block_scale)
        if d:  # scales outside fp16's exact range: rebased, 2^d in the fp32 epilogue
            factor = torch.tensor(2.0**d, dtype=torch.float32, device=device)
            meta = CheckpointMeta(fp16_rebased=True)
            return prepared("mxfp4_rebased", (weight.packed, codes, factor), meta, (n, k))
    return prepared("mxfp4", (weight.packed, weight.block_scale), CheckpointMeta(), (n, k))


def prepare_moe(stacks: ExpertStacks, request: Request) -> PreparedMoe:
    """NVFP4 and MXFP4 experts of a gated layer on an SM 8.0+ GPU (I and H multiples of 64;
    MXFP4: each expert's scales spanning <= 18 binades) are repacked into the mma16x64 layout
    (kernels/mma_layout/moe_stacks.py; same bytes, one copy that every token count reads);
    everything else keeps the canonical stacks."""
    w13, w2, gated = stacks.w13, stacks.w2, stacks.gated
    canonical = PreparedMoe(tuple(stacks.names), tuple(w13), tuple(w2), Layout.CHECKPOINT,
                            stacks.meta)  # fmt: skip
    if request.format not in dispatch.FP4:
        return canonical_moe_check(canonical, request)
    inter, hidden = w2[0].shape[2] * 2, w2[0].shape[1]  # w2 is [E, H, I/2] packed
    cap = _capability(w13[0].device)
    if dispatch.moe_layout(request.format, inter, hidden, gated, cap) is not Layout.MMA16X64:
        return canonical_moe_check(canonical, request)
    from quantdispatch.kernels.mma_layout.moe_stacks import repack_experts, repack_experts_mx

    act = request.act_dtype
    out_names = ("mma_words", "mma_scales", "global_scale")
    if request.format == "mxfp4":
        try:
            m13 = repack_experts_mx(w13[0], w13[1], act)
            m2 = repack_experts_mx(w2[0], w2[1], act)
        except WeightFormatError:  # an expert's scales too wide apart: canonical stacks
            return canonical_moe_check(canonical, request)
        return PreparedMoe(out_names, m13, m2, Layout.MMA16X64, Mma16x64Meta(act))
    r13 = repack_experts(w13[0], w13[1], act)
    r2 = repack_experts(w2[0], w2[1], act)
    return PreparedMoe(out_names, (*r13, w13[2]), (*r2, w2[2]), Layout.MMA16X64, Mma16x64Meta(act))


def canonical_moe_check(prepared: PreparedMoe, request: Request) -> PreparedMoe:
    """The stacked checkpoint tensors for the fused tl.dot MoE kernels. Those round each
    decoded MXFP4 weight to the activation dtype: in fp16, experts whose block scales leave
    fp16's exact range are refused here rather than run into inf (linear layers rebase their
    scales instead: formats.mxfp4.rebase_mx_scales_for_fp16)."""
    if request.format == "mxfp4" and request.act_dtype == torch.float16:
        from quantdispatch.formats.mxfp4 import FP16_MX_EXPONENTS, mx_scale_range

        low, high = FP16_MX_EXPONENTS
        for which, stack in (("w13", prepared.w13), ("w2", prepared.w2)):
            found = mx_scale_range(stack[0], stack[1].view(torch.uint8))
            if found is None:
                continue
            lo, hi = found[0], found[1]  # per expert (an expert using no block: in range)
            bad = ((lo < low) | (hi > high)).nonzero().flatten().tolist()
            if bad:
                e = bad[0]
                raise WeightFormatError(
                    format_error(
                        f"MXFP4 expert {e} of {which} has block scales 2^{int(lo[e])} .. "
                        f"2^{int(hi[e])} ({len(bad)} experts of {which} outside "
                        f"2^{low} .. 2^{high})",
                        "the fused MoE kernels of the checkpoint layout round each "
                        "decoded weight to fp16, which holds e2m1 x scale exactly only "
                        f"for scales 2^{low} .. 2^{high}",
                        "run the layer in bfloat16 (SM 8.0+), or force the reference "
                        "backend for mxfp4 (QUANTDISPATCH_BACKEND_MXFP4=reference)",
                    )
                )
    return prepared

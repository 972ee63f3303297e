"""The triton backend's run step: a call -> its kernel family (:mod:`.dispatch`, read from the
regime table) -> one kernel file's launcher. The family depends only on host-side shapes, so
nothing synchronizes. The device facts are asked once per call (a cached lookup) and handed
down with the decision's PDL switch. A weight prepared for FP8 compute (its meta, :mod:`.meta`)
runs the FP8 prefill linear from its row's M on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantdispatch.backends.base import (
    CheckpointMeta,
    Layout,
    LayoutMeta,
    LinearBinding,
    Mma16x64Meta,
    MoeCall,
)
from quantdispatch.backends.triton import dispatch, fp8_compute
from quantdispatch.backends.triton.meta import fp8_compute_of_meta
from quantdispatch.backends.triton.tensors import Resident, linear_tensors
from quantdispatch.errors import InputError, format_error
from quantdispatch.kernels.checkpoint_layout.dequant import dequant_fp4_rows, dequant_fp8_rows
from quantdispatch.kernels.checkpoint_layout.fp8 import fp8_weight_only_linear
from quantdispatch.kernels.checkpoint_layout.linear import fp4_linear
from quantdispatch.kernels.checkpoint_layout.moe import fused_moe
from quantdispatch.kernels.checkpoint_layout.moe_stacks import weights_aligned
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.common.slabs import dequant_gemm
from quantdispatch.kernels.mma_layout.dequant import mma_dequant_rows
from quantdispatch.kernels.mma_layout.gemm import mma_gemm
from quantdispatch.kernels.mma_layout.gemv import mma_linear
from quantdispatch.kernels.mma_layout.layout import CHUNK_K, TILE_N
from quantdispatch.kernels.mma_layout.moe_gemm import mma_layout_moe
from quantdispatch.kernels.native.fp8_prefill import fp8_prefill_linear, fp8_prefill_linear_mma
from quantdispatch.kernels.regimes import Family
from quantdispatch.moe.activations import get_activation

__all__ = ["linear", "moe"]


def linear(x: torch.Tensor, w: LinearBinding) -> torch.Tensor:
    """Fused weight-streaming kernels for small M, dequantized slabs + cuBLAS for large M, as
    the regime table says for this weight on this device."""
    tensors, bias, fmt, layout, meta, pdl = w.tensors, w.bias, w.fmt, w.layout, w.meta, w.pdl
    facts = device_facts(x.device)
    if layout is Layout.MMA16X64:
        assert isinstance(meta, Mma16x64Meta), meta
        return _mma_layout(x, tensors, bias, fmt, meta, pdl, facts)
    assert isinstance(meta, CheckpointMeta), meta
    if fmt in dispatch.FP4:
        return _checkpoint_fp4(x, tensors, bias, fmt, meta, facts)
    return _checkpoint_fp8(x, tensors, bias, meta, facts)


def _mma_layout(
    x: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    fmt: str,
    meta: Mma16x64Meta,
    pdl: bool,
    facts: DeviceFacts,
) -> torch.Tensor:
    words, scales, global_scale = linear_tensors(tensors, fmt, Layout.MMA16X64, meta)
    if x.dtype != meta.packed_for:
        raise InputError(
            format_error(
                f"input is {x.dtype} but this weight was repacked for {meta.packed_for}",
                "the mma16x64 layout places the codes for one 16-bit format",
                f"pass {meta.packed_for} activations (QuantLinear checks this itself)",
            )
        )
    n, k = words.shape[0] * TILE_N, x.shape[1]
    family = dispatch.linear_family(fmt, Layout.MMA16X64, meta, x.shape[0], n, k, facts)
    if family is Family.FP8_PREFILL:
        return fp8_prefill_linear_mma(
            x, words, scales, global_scale, fmt=fmt, bias=bias, recipe=fp8_compute.recipe_for(k),
            resident=_resident(tensors, meta), capability=facts.capability,
            handoff=fp8_compute.handoff_in_use(),
        )  # fmt: skip
    if family is Family.MMA_GEMV:
        return mma_linear(x, words, scales, global_scale, bias)
    if family is Family.WGMMA_GEMM:
        return mma_gemm(x, words, scales, global_scale, bias, pdl=pdl, facts=facts)
    assert family is Family.DEQUANT_CUBLAS, family

    def rows(a: int, b: int, out: torch.Tensor) -> None:
        mma_dequant_rows(words, scales, global_scale, a, b, out)

    return dequant_gemm(x, n, k, rows, bias)


def _checkpoint_fp4(
    x: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    fmt: str,
    meta: CheckpointMeta,
    facts: DeviceFacts,
) -> torch.Tensor:
    scale_format = "e4m3" if fmt == "nvfp4" else "e8m0"
    packed, block_scale, global_scale = linear_tensors(tensors, fmt, Layout.CHECKPOINT, meta)
    # A rebased MXFP4 weight keeps the fused kernels at every M (its own row of the table):
    # their fp32 epilogue applies 2^d, where dequantized fp16 slabs would need it inside cuBLAS
    # (a host scalar, and fp16 partial sums of 2^|d| times the output when d < 0).
    n, k = packed.shape[0], x.shape[1]
    family = dispatch.linear_family(fmt, Layout.CHECKPOINT, meta, x.shape[0], n, k, facts)
    if family is Family.FP8_PREFILL:
        return fp8_prefill_linear(
            x, packed, block_scale, global_scale, fmt=fmt, bias=bias,
            recipe=fp8_compute.recipe_for(k), resident=_resident(tensors, meta),
            capability=facts.capability, handoff=fp8_compute.handoff_in_use(),
        )  # fmt: skip
    if family is Family.CHECKPOINT_TL_DOT:
        return fp4_linear(
            x, packed, block_scale, global_scale, scale_format=scale_format, bias=bias, facts=facts
        )
    assert family is Family.DEQUANT_CUBLAS, family

    def rows(a: int, b: int, out: torch.Tensor) -> None:
        scales = block_scale[a:b]
        dequant_fp4_rows(packed[a:b], scales, global_scale, out, scale_format=scale_format)

    return dequant_gemm(x, packed.shape[0], packed.shape[1] * 2, rows, bias)


def _resident(tensors: Sequence[torch.Tensor], meta: LayoutMeta):  # type: ignore[no-untyped-def]
    """The resident FP8 copy (the last two tensors) of a ``prefill-resident`` weight, else
    None (re-encoded per call)."""
    if fp8_compute_of_meta(meta) != fp8_compute.RESIDENT:
        return None
    return fp8_compute.resident_weight(*Resident.from_list(tensors))


def _checkpoint_fp8(
    x: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    meta: CheckpointMeta,
    facts: DeviceFacts,
) -> torch.Tensor:
    weight, scale = linear_tensors(tensors, "fp8", Layout.CHECKPOINT, meta)
    block = meta.block_size
    n, k = weight.shape[0], x.shape[1]
    family = dispatch.linear_family("fp8", Layout.CHECKPOINT, meta, x.shape[0], n, k, facts)
    if family is Family.FP8_TL_DOT:
        return fp8_weight_only_linear(x, weight, scale, block_size=block, bias=bias, facts=facts)
    assert family is Family.DEQUANT_CUBLAS, family

    def rows(a: int, b: int, out: torch.Tensor) -> None:
        dequant_fp8_rows(weight[a:b], scale, a, out, block_size=block)

    return dequant_gemm(x, weight.shape[0], weight.shape[1], rows, bias)


def moe_call_plan(call: MoeCall, facts: DeviceFacts) -> object | None:
    """The launch config the layout's plan picks for this call (its ``family`` is the kernel
    family); None for an empty batch (nothing runs) or malformed inputs (the launcher then says
    what is wrong)."""
    x, ids, w13, w2 = call.x, call.topk_ids, call.w13, call.w2
    if x.dim() != 2 or ids.dim() != 2 or x.shape[0] == 0 or not w13 or not w2:
        return None
    if w13[0].dim() < 3 or w2[0].dim() < 3:
        return None
    m, top_k, experts = x.shape[0], ids.shape[1], w13[0].shape[0]
    if call.layout is Layout.MMA16X64:  # words [E, N/16, K/64, ...]
        inter, hidden = w2[0].shape[2] * CHUNK_K, w13[0].shape[2] * CHUNK_K
        return dispatch.layout_moe_plan(
            call.fmt, call.layout, m, top_k, experts, inter, hidden, facts, pdl=call.pdl
        )
    if call.fmt not in ("nvfp4", "mxfp4", "fp8"):
        return None
    gated = get_activation(call.activation).gated
    n13, hidden = w13[0].shape[1], x.shape[1]
    inter = n13 // 2 if gated else n13
    aligned = weights_aligned(call.fmt, w13[0], w2[0])
    return dispatch.layout_moe_plan(
        call.fmt, call.layout, m, top_k, experts, inter, hidden, facts, gated=gated,
        aligned=aligned,
    )  # fmt: skip


def moe(call: MoeCall) -> torch.Tensor:
    """Fused MoE on the stacked canonical expert tensors (quantdispatch.moe), or on the
    repacked ones prepare_moe made: the plan's config (its kernel family) goes to the layout's
    launcher, which runs that family's kernels."""
    facts = device_facts(call.x.device)
    cfg = moe_call_plan(call, facts)
    if call.layout is Layout.MMA16X64:
        meta = call.meta
        assert isinstance(meta, Mma16x64Meta), meta
        return mma_layout_moe(
            call.x, call.topk_ids, call.topk_weights, call.w13, call.w2,
            call.w13_bias, call.w2_bias, activation=call.activation, params=call.params,
            packed_for=meta.packed_for, config=cfg, pdl=call.pdl, facts=facts,  # type: ignore[arg-type]
        )  # fmt: skip
    meta = call.meta
    assert isinstance(meta, CheckpointMeta), meta
    return fused_moe(
        call.x, call.topk_ids, call.topk_weights, list(call.w13), list(call.w2),
        call.w13_bias, call.w2_bias, fmt=call.fmt, activation=call.activation,
        params=call.params, block_size=meta.block_size, config=cfg, facts=facts,  # type: ignore[arg-type]
    )  # fmt: skip

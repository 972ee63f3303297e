"""The triton backend's bound call path (:mod:`quantdispatch.backends.bound`): a prepared weight's
steps of the regime table, each bound once to its kernel file's launcher object.

The op path (:mod:`.run`) asks the table for the family of every call and builds the launch
arguments each time; here the steps of this weight on this device are read once, each family's
launcher object is built once over the weight's tensors, and a call runs the step of its M.
Both paths call the same launcher classes, so they give the same bits. FP8 compute's steps run
the op path's function (large M only, where a call is long next to its host time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quantdispatch.backends.base import (
    CheckpointMeta,
    Layout,
    Mma16x64Meta,
    MoeCall,
)
from quantdispatch.backends.bound import BoundLinear, BoundMoe, LinearBinding
from quantdispatch.backends.triton import dispatch
from quantdispatch.backends.triton.tensors import (
    Fp4Tensors,
    Fp8Tensors,
    MmaTensors,
    linear_tensors,
)
from quantdispatch.errors import InputError, format_error
from quantdispatch.kernels.checkpoint_layout.dequant import Fp4DequantRows, Fp8DequantRows
from quantdispatch.kernels.checkpoint_layout.fp8 import Fp8Linear
from quantdispatch.kernels.checkpoint_layout.linear import Fp4Linear
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.common.slabs import DequantGemm
from quantdispatch.kernels.mma_layout.dequant import MmaDequantRows
from quantdispatch.kernels.mma_layout.gemm import MmaGemm
from quantdispatch.kernels.mma_layout.gemv import MmaGemv
from quantdispatch.kernels.regimes import Family

__all__ = ["bind_linear", "bind_moe"]

Run = Callable[[torch.Tensor], torch.Tensor]


def bind_linear(w: LinearBinding) -> BoundLinear:
    """The weight's steps on its device (the regime table's row, as :mod:`.run` reads it per
    call), each bound to its launcher object."""
    facts = device_facts(w.device)
    tensors, bias, fmt, layout, meta, pdl = w.tensors, w.bias, w.fmt, w.layout, w.meta, w.pdl
    named = linear_tensors(tensors, fmt, layout, meta)
    n, k = named.nk
    if isinstance(named, MmaTensors):
        assert isinstance(meta, Mma16x64Meta), meta
        make = _mma_layout(named, bias, meta, pdl, facts)
    elif isinstance(named, Fp4Tensors):
        make = _checkpoint_fp4(named, bias, fmt, facts)
    else:
        assert isinstance(meta, CheckpointMeta), meta
        make = _checkpoint_fp8(named, bias, meta, facts)
    steps, families = [], []
    made: dict[Family, Run] = {}
    for top, family in dispatch.linear_steps(fmt, layout, meta, n, k, facts):
        if family is Family.FP8_PREFILL:
            run = _op_path(w)
        else:
            run = made.get(family) or make(family, n, k)
        made[family] = run
        steps.append((top, run))
        families.append(family.value)
    return BoundLinear(steps, families)


def _mma_layout(
    named: MmaTensors,
    bias: torch.Tensor | None,
    meta: Mma16x64Meta,
    pdl: bool,
    facts: DeviceFacts,
) -> Callable[[Family, int, int], Run]:
    words, scales, gs = named

    def make(family: Family, n: int, k: int) -> Run:
        if family is Family.MMA_GEMV:
            run: Run = MmaGemv(words, scales, gs, bias)
        elif family is Family.WGMMA_GEMM:
            run = MmaGemm(words, scales, gs, bias, pdl=pdl, facts=facts)
        else:
            assert family is Family.DEQUANT_CUBLAS, family
            run = DequantGemm(n, k, MmaDequantRows(words, scales, gs), bias)
        return _packed_for(run, meta.packed_for)

    return make


def _packed_for(run: Run, dtype: torch.dtype) -> Run:
    """``run`` refusing activations of another dtype than the mma16x64 codes were placed for."""

    def checked(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != dtype:
            raise InputError(
                format_error(
                    f"input is {x.dtype} but this weight was repacked for {dtype}",
                    "the mma16x64 layout places the codes for one 16-bit format",
                    f"pass {dtype} activations (QuantLinear checks this itself)",
                )
            )
        return run(x)

    return checked


def _checkpoint_fp4(
    named: Fp4Tensors, bias: torch.Tensor | None, fmt: str, facts: DeviceFacts
) -> Callable[[Family, int, int], Run]:
    scale_format = "e4m3" if fmt == "nvfp4" else "e8m0"
    packed, block_scale, gs = named

    def make(family: Family, n: int, k: int) -> Run:
        if family is Family.CHECKPOINT_TL_DOT:
            return Fp4Linear(
                packed, block_scale, gs, scale_format=scale_format, bias=bias, facts=facts
            )
        assert family is Family.DEQUANT_CUBLAS, family
        rows = Fp4DequantRows(packed, block_scale, gs, scale_format=scale_format)
        return DequantGemm(n, k, rows, bias)

    return make


def _checkpoint_fp8(
    named: Fp8Tensors, bias: torch.Tensor | None, meta: CheckpointMeta, facts: DeviceFacts
) -> Callable[[Family, int, int], Run]:
    weight, scale = named
    block = meta.block_size

    def make(family: Family, n: int, k: int) -> Run:
        if family is Family.FP8_TL_DOT:
            return Fp8Linear(weight, scale, block_size=block, bias=bias, facts=facts)
        assert family is Family.DEQUANT_CUBLAS, family
        return DequantGemm(n, k, Fp8DequantRows(weight, scale, block_size=block), bias)

    return make


def _op_path(w: LinearBinding) -> Run:
    from quantdispatch.backends.triton import run as op

    def run(x: torch.Tensor) -> torch.Tensor:
        return op.linear(x, w)

    return run


def bind_moe(template: MoeCall) -> BoundMoe:
    """A MoE layer's call with the plan of each (M, top-k) made once (the op path asks the
    layout's plan per call), then the layout's launcher with that plan, as :mod:`.run` calls
    it."""
    from dataclasses import replace

    from quantdispatch.backends.triton import run

    facts = device_facts(template.w13[0].device)
    plans: dict[tuple[int, int], object] = {}
    w13, w2, b13, b2 = list(template.w13), list(template.w2), template.w13_bias, template.w2_bias
    act, params, fmt, pdl = template.activation, template.params, template.fmt, template.pdl

    def plan(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> object:
        key = (x.shape[0], ids.shape[1] if ids.dim() == 2 else -1)
        cfg = plans.get(key)
        if cfg is None:
            call = replace(template, x=x, topk_ids=ids, topk_weights=weights)
            cfg = run.moe_call_plan(call, facts)
            if cfg is not None:  # None: an empty batch or malformed input (the launcher says)
                if len(plans) > 4096:
                    plans.clear()
                plans[key] = cfg
        return cfg

    if template.layout is Layout.MMA16X64:
        meta = template.meta
        assert isinstance(meta, Mma16x64Meta), meta
        from quantdispatch.kernels.common.moe_stages import ExpertWeights
        from quantdispatch.kernels.mma_layout.moe_bound import MmaLayoutMoe

        layer = MmaLayoutMoe(
            ExpertWeights(w13, w2, b13, b2), activation=act, params=params,
            packed_for=meta.packed_for, pdl=pdl, facts=facts,
        )  # fmt: skip

        def mma(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return layer(x, ids, weights, plan(x, ids, weights))

        return BoundMoe(mma)
    meta = template.meta
    assert isinstance(meta, CheckpointMeta), meta
    from quantdispatch.kernels.checkpoint_layout.moe import fused_moe

    def checkpoint(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fused_moe(
            x, ids, weights, w13, w2, b13, b2, fmt=fmt, activation=act, params=params,
            block_size=meta.block_size, config=plan(x, ids, weights), facts=facts,  # type: ignore[arg-type]
        )  # fmt: skip

    return BoundMoe(checkpoint)

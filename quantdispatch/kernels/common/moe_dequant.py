"""Experts for very many tokens per expert: each GEMM's experts dequantized to 16-bit by the
layout's own dequantizer, then ``torch._grouped_mm`` (:class:`DequantExperts`; SM 9.0+). It
sorts the pairs itself (torch, no host sync) and finalizes with
:func:`.moe_finalize.weight_and_sum`, so it skips the align and reduce stages of :mod:`.moe_stages`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.activation import apply_activation
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.common.moe_finalize import local_pairs, weight_and_sum
from quantdispatch.kernels.common.moe_stages import ExpertWeights, MoeExperts, MoeInputs, MoeWork

__all__ = ["DequantExperts"]


@triton.jit
def _act_rows_kernel(h_ptr, a_ptr, e_ptr, bias_ptr, inter, stride_h, stride_a, stride_be,
                     alpha, limit, ACT: tl.constexpr, GATED: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """a[row] = act(h[row, :inter] (+ bias), h[row, inter:] (+ bias)) in fp32, stored 16-bit (the
    dequantize path's activation: one pass over the first GEMM's output)."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = n < inter
    g = tl.load(h_ptr + row * stride_h + n, mask=ok, other=0.0).to(tl.float32)
    u = g
    if GATED:
        u = tl.load(h_ptr + row * stride_h + inter + n, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = bias_ptr + tl.load(e_ptr + row).to(tl.int64) * stride_be
        g += tl.load(b + n, mask=ok, other=0.0)
        if GATED:
            u += tl.load(b + inter + n, mask=ok, other=0.0)
    a = apply_activation(g, u, alpha, limit, ACT)
    tl.store(a_ptr + row * stride_a + n, a.to(a_ptr.dtype.element_ty), mask=ok)


class DequantExperts(MoeExperts):
    """Many tokens per expert: pairs sorted by expert (device-side, no host sync), each GEMM's
    experts dequantized to x.dtype and run as one torch._grouped_mm, activation and biases in
    fp32, then the shared finalize (routing weights, fp32 top-k sum). Pairs whose id this layer
    does not hold run through expert 0 with weight 0 (finite, so they add exactly 0).

    The stacks of ``weights`` are callables that return each GEMM's experts in the dtype they
    are given, [E, N, K] (one layout's dequantizer; called one after the other, so only one
    copy is alive)."""

    whole_call = True

    def __init__(self, weights: ExpertWeights) -> None:
        self.weights = weights

    def apply(self, inp: MoeInputs, work: MoeWork) -> None:
        dequant13, dequant2, b13, b2 = self.weights
        x, ids, e, act, top_k = inp.x, inp.ids, inp.experts, inp.act, inp.top_k
        _, key = local_pairs(ids, e)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(e, dtype=torch.int32, device=x.device)
        counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        sorted_expert = key[order]
        xs = x.index_select(0, order // top_k)
        w = dequant13(x.dtype)
        h = torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
        del w
        inter = h.shape[1] // 2 if act.gated else h.shape[1]
        a = checks.empty((h.shape[0], inter), x.dtype, x.device)
        bn = min(1024, triton.next_power_of_2(inter))
        launch(_act_rows_kernel, (h.shape[0], triton.cdiv(inter, bn)),
            h, a, sorted_expert, b13 if b13 is not None else h, inter, h.stride(0), a.stride(0),
            b13.stride(0) if b13 is not None else 0, float(act.alpha), float(act.limit),
            ACT=act.code, GATED=act.gated, HAS_BIAS=b13 is not None, BN=bn, num_warps=4,
        )  # fmt: skip
        del h
        w = dequant2(x.dtype)
        ys = torch._grouped_mm(a, w.transpose(1, 2), offs=offs).float()
        del w
        y = torch.empty_like(ys)
        y[order] = ys  # back in pair order
        work.out.copy_(weight_and_sum(y, ids, inp.tw, e, b2))

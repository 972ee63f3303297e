"""Large-M path: dequantize a bounded slab of weight rows to 16-bit, then a cuBLAS GEMM.

Why: from a few hundred tokens on, a GEMM is bound by tensor-core math, not by weight bytes, and
cuBLAS's bf16/fp16 GEMM is the fastest tensor-core code torch has. Dequantizing costs one pass
over the packed weight (0.5625 B/weight read, 2 B/weight written to a slab that stays in L2 for
small slabs), which is small next to the GEMM once M is large.

Memory: the slab holds at most ``WORKSPACE_ELEMENTS`` 16-bit values (64 MiB), taken per call from
torch's caching allocator, like any temporary of a torch op: stream-ordered, so two streams never
share one, and under CUDA graph capture taken from the graph's private pool, which the graph
keeps for its replays. (A workspace cached per device would be shared by every stream and
every graph: two large-M calls running concurrently would dequantize into the same slab.) The
layer itself holds only packed weights.

Numerics: each weight is decoded exactly in fp32 (e2m1 * block scale * global scale), rounded
once to the activation dtype, and the GEMM accumulates in fp32: the same as a bf16 / fp16 model
whose weights are the dequantized checkpoint. The global scale is applied before the 16-bit
cast, so fp16 never sees unscaled (overflowing) products.

MoE: with very many tokens per expert, :func:`run_dequant_moe` dequantizes each GEMM's experts
(the layout's own dequantizer, one stack alive at a time) and runs ``torch._grouped_mm``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.activation import apply_activation
from quantdispatch.kernels.common.launch import launch

__all__ = ["WORKSPACE_ELEMENTS", "DequantGemm", "dequant_gemm", "run_dequant_moe"]


WORKSPACE_ELEMENTS = 32 * 2**20


class DequantGemm:
    """:func:`dequant_gemm` bound to one weight (the bound call path): the slabs are planned
    once and the bias is cast once per activation dtype; a call allocates the output and the
    slab, dequantizes and multiplies."""

    def __init__(
        self,
        n: int,
        k: int,
        dequant_rows: Callable[[int, int, torch.Tensor], object],
        bias: torch.Tensor | None = None,
    ) -> None:
        self.n, self.k = n, k
        # Slabs of a multiple of 128 rows: every slab's output columns start 256-byte aligned,
        # which cuBLAS needs for its fast kernels (an unaligned column offset tripled the GEMM
        # time).
        rows = max(1, min(n, WORKSPACE_ELEMENTS // k))
        if 128 <= rows < n:
            rows = rows // 128 * 128
        self.rows = rows
        self._slabs = tuple((a, min(n, a + rows)) for a in range(0, n, rows))
        self._dequant_rows = dequant_rows
        self._bias = bias
        self._bias16: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, n, k = x.shape[0], self.n, self.k
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        ws = torch.empty(self.rows * k, dtype=x.dtype, device=x.device)  # per call: module doc
        bias16 = None
        if self._bias is not None:
            bias16 = self._bias16.get(x.dtype)
            if bias16 is None:
                bias16 = self._bias16[x.dtype] = self._bias.to(x.dtype)
        for a, b in self._slabs:
            slab = ws[: (b - a) * k].view(b - a, k)
            self._dequant_rows(a, b, slab)
            if bias16 is not None:
                torch.addmm(bias16[a:b], x, slab.t(), out=out[:, a:b])
            else:
                torch.mm(x, slab.t(), out=out[:, a:b])
        return out


def dequant_gemm(
    x: torch.Tensor,
    n: int,
    k: int,
    dequant_rows,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ W.T (+ bias), W produced slab by slab by ``dequant_rows(a, b, out)``."""
    return DequantGemm(n, k, dequant_rows, bias)(x)


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


def run_dequant_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    tw: torch.Tensor,
    e: int,
    dequant13: Callable[[], torch.Tensor],
    dequant2: Callable[[], torch.Tensor],
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    act_code: int,
    gated: bool,
    alpha: float,
    limit: float,
    out: torch.Tensor,
) -> None:
    """Many tokens per expert: pairs sorted by expert (device-side, no host sync), each GEMM's
    experts dequantized to x.dtype and run as one torch._grouped_mm, activation and biases in
    fp32, routing weights applied and the slots summed in fp32. Pairs whose id this layer does
    not hold run through expert 0 with weight 0 (finite, so they add exactly 0).
    ``dequant13`` / ``dequant2`` return each GEMM's experts as x.dtype [E, N, K] (one layout's
    dequantizer; called one after the other so only one copy is alive)."""
    m, hidden = x.shape
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    key = torch.where(valid, flat, 0)
    weight = torch.where(valid, tw.reshape(-1), 0.0)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device)
    counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    sorted_expert = key[order]
    xs = x.index_select(0, order // top_k)
    w = dequant13()
    h = torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
    del w
    inter = h.shape[1] // 2 if gated else h.shape[1]
    a = checks.empty((h.shape[0], inter), x.dtype, x.device)
    bn = min(1024, triton.next_power_of_2(inter))
    launch(_act_rows_kernel, (h.shape[0], triton.cdiv(inter, bn)),
        h, a, sorted_expert, b13 if b13 is not None else h, inter, h.stride(0), a.stride(0),
        b13.stride(0) if b13 is not None else 0, float(alpha), float(limit),
        ACT=act_code, GATED=gated, HAS_BIAS=b13 is not None, BN=bn, num_warps=4,
    )  # fmt: skip
    del h
    w = dequant2()
    ys = torch._grouped_mm(a, w.transpose(1, 2), offs=offs).float()
    del w
    if b2 is not None:
        ys = ys + b2[sorted_expert]
    ys = ys * weight[order][:, None]
    y = torch.empty_like(ys)
    y[order] = ys
    out.copy_(y.view(m, top_k, hidden).sum(1))

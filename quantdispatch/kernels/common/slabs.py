"""Large-M path: dequantize a bounded slab of weight rows to 16-bit, then a cuBLAS GEMM.

Why: from a few hundred tokens on, a GEMM is bound by tensor-core math, not by weight bytes, and
cuBLAS's bf16/fp16 GEMM is the fastest tensor-core code torch has. Dequantizing costs one pass
over the packed weight (0.5625 B/weight read, 2 B/weight written to a slab that stays in L2 for
small slabs), which is small next to the GEMM once M is large.

Memory: the slab holds at most ``WORKSPACE_ELEMENTS`` 16-bit values (256 MiB), taken per call from
torch's caching allocator, like any temporary of a torch op: stream-ordered, so two streams never
share one, and under CUDA graph capture taken from the graph's private pool, which the graph
keeps for its replays. (A workspace cached per device would be shared by every stream and
every graph: two large-M calls running concurrently would dequantize into the same slab.) The
layer itself holds only packed weights.

Numerics: each weight is decoded exactly in fp32 (e2m1 * block scale * global scale), rounded
once to the activation dtype, and the GEMM accumulates in fp32: the same as a bf16 / fp16 model
whose weights are the dequantized checkpoint. The global scale is applied before the 16-bit
cast, so fp16 never sees unscaled (overflowing) products.

MoE: with very many tokens per expert the experts are dequantized the same way per GEMM
(:mod:`.moe_dequant`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["WORKSPACE_ELEMENTS", "DequantGemm", "dequant_gemm"]


#: The slab bound: large enough that a Llama-3-8B weight runs as one GEMM, which beats row slabs
#: of it (docs/design/checkpoint-layout.md, "Slab size").
WORKSPACE_ELEMENTS = 128 * 2**20


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
        workspace_elements: int | None = None,
    ) -> None:
        self.n, self.k = n, k
        # Slabs of a multiple of 128 rows: every slab's output columns start 256-byte aligned,
        # which cuBLAS needs for its fast kernels (an unaligned column offset tripled the GEMM
        # time).
        rows = max(1, min(n, (workspace_elements or WORKSPACE_ELEMENTS) // k))
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

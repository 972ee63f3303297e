"""The activations of the mma16x64 GEMMs in the MMA's K order ("kappa"): within each chunk of 64
columns, column 16 j + 8 cc + 2 t + h holds x's column 16 t + 4 j + 2 cc + h, so the decoded
weight registers and the activation tile meet in one K order (:mod:`.tile_decode`). One Triton
pass over 32-bit pairs per call; the output keeps its natural order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.launch import Launcher
from quantdispatch.kernels.common.pdl import gdc_launch_dependents
from quantdispatch.kernels.mma_layout.layout import CHUNK_K

__all__ = ["KappaOrder", "kappa_order", "kappa_order_torch", "kappa_order_triton"]


def kappa_order_torch(x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The reference of :func:`kappa_order` (one generic torch copy; the CPU path)."""
    m, k = x.shape
    out = x.reshape(m, k // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k)
    return out if rows is None or rows == m else torch.nn.functional.pad(out, (0, 0, 0, rows - m))


@triton.jit
def _kappa_kernel(x_ptr, out_ptr, M, M_OUT, stride_xm, W: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_W: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """x viewed as 32-bit pairs [M, W] -> the same pairs in the MMA's K order, in an [M_OUT, W]
    output whose rows past M are zeros. Within each
    chunk (32 pairs), destination pair d = 8 j + 4 cc + t comes from pair 8 t + 2 j + cc; a
    warp reads and writes whole 128-byte chunk rows (the gather stays inside one line).
    PDL: let the GEMM launch once every program is past its store (it waits for this kernel
    before it reads anything). Released at the top instead, it was slower on the H200 (likely
    the GEMM's programs were placed while these still held SMs, onto fewer SMs; see
    :mod:`..common.pdl`)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    within = d % 32
    src = d - within + 8 * (within % 4) + 2 * (within // 8) + (within // 4) % 2
    in_w = (d < W)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    v = tl.load(x_ptr + r64 * stride_xm + src[None, :], mask=(rows < M)[:, None] & in_w, other=0)
    tl.store(out_ptr + r64 * W + d[None, :], v, mask=(rows < M_OUT)[:, None] & in_w)
    if PDL:
        gdc_launch_dependents()


def kappa_order(
    x: torch.Tensor, *, release_next: bool = False, rows: int | None = None
) -> torch.Tensor:
    """x [M, K] -> a contiguous copy whose columns follow the MMA's K order within each chunk of
    64: column 16 j + 8 cc + 2 t + h holds x's column 16 t + 4 j + 2 cc + h. ``rows`` (>= M):
    the copy has that many rows, those past M zero (whole TMA boxes, see :func:`.gemm.mma_gemm`).

    On a GPU one Triton pass over 32-bit pairs (:func:`kappa_order_triton`): torch's generic
    copy of the 6-D permuted view was far slower, a large part of the GEMM call
    (docs/design/wgmma-gemm.md)."""
    if x.device.type != "cuda" or x.shape[0] == 0:
        return kappa_order_torch(x, rows)
    return kappa_order_triton(x, release_next=release_next, rows=rows)


class KappaOrder:
    """:func:`kappa_order_triton` for activations of width ``k`` with the launch bound once
    (the bound call path). ``release_next``: as there."""

    def __init__(self, k: int, *, release_next: bool = False) -> None:
        if k % CHUNK_K:
            raise ValueError(
                f"kappa_order_triton: K = {k}; it permutes 16-bit activations whose K is a "
                f"multiple of {CHUNK_K} (pad K, or use kappa_order_torch)"
            )
        self.k = k
        self._w = k // 2
        self._launch = Launcher(
            _kappa_kernel,
            ("x_ptr", "out_ptr", "M", "M_OUT", "stride_xm"),
            dict(W=self._w, BLOCK_M=_BLOCK_M, BLOCK_W=_BLOCK_W, PDL=release_next),
            dict(num_warps=4),
        )

    def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        m, k = x.shape
        rows = m if rows is None else rows
        if rows < m:
            raise ValueError(f"kappa_order_triton: rows={rows} is fewer than x's {m} rows")
        if x.element_size() != 2 or k != self.k:
            raise ValueError(
                f"kappa_order_triton: x is {x.dtype} [{m}, {k}]; it permutes 16-bit "
                f"activations [M, {self.k}]"
            )
        if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
            x = x.contiguous()
        pairs = x.view(torch.int32)  # [M, K/2], row stride x.stride(0) / 2
        out = torch.empty((rows, k), dtype=x.dtype, device=x.device)
        grid = ((rows + _BLOCK_M - 1) // _BLOCK_M, (self._w + _BLOCK_W - 1) // _BLOCK_W)
        self._launch(grid, pairs, out.view(torch.int32), m, rows, pairs.stride(0))
        return out


_BLOCK_M, _BLOCK_W = 16, 128


def kappa_order_triton(
    x: torch.Tensor, *, release_next: bool = False, rows: int | None = None
) -> torch.Tensor:
    """:func:`kappa_order` by :func:`_kappa_kernel` (any device Triton runs on; the CPU tests
    run it in the interpreter). x [M, K] 16-bit, K a multiple of 64. ``release_next``: the
    next launch is a programmatic dependent one that waits for this kernel (SM 9.0+)."""
    if x.element_size() != 2 or x.dim() != 2 or x.shape[1] % CHUNK_K:
        raise ValueError(
            f"kappa_order_triton: x is {x.dtype} {list(x.shape)}; it permutes 16-bit "
            f"activations whose K is a multiple of {CHUNK_K} (pad K, or use kappa_order_torch)"
        )
    return KappaOrder(x.shape[1], release_next=release_next)(x, rows)

"""Block-scaled FP8 GEMM in Triton: ``y = (A * sa) @ (B * sb)^T (+ bias)`` on FP8 tensor cores.

An experiment, not part of the package: on the H200 it runs at 0.6-0.75x the speed of cuBLAS's
block-scaled GEMM that FP8 prefill uses (benchmarks/probes/fp8_gemm_sweep.py,
docs/design/fp8-prefill.md), because each 128-column step waits for its tensor-core product
before scaling it into the accumulator. Kept to re-measure with later Triton versions.

A is e4m3 [M, K] with fp32 scales per row and per 128 columns (``sa`` [M, K/128]); B is e4m3
[N, K] with fp32 scales per 128 columns and per ``SB_ROWS`` rows (128: the 128x128 recipe,
``sb`` [ceil(N/128), K/128]; 1: the 1x128 recipe, ``sb`` [N, K/128]). Scales may have any
strides (cuBLAS's column-major ``scale_a`` is read as is).

Each program owns one BLOCK_M x BLOCK_N output tile and walks K in 128-column blocks: one
tensor-core product per block into a fresh fp32 tile, then ``acc += part * sa * sb`` in fp32
(the scales change per block, so they are applied before the next block is added; this also
keeps FP8 tensor cores' narrower internal adder to 128 products). The epilogue adds the bias in
fp32 and rounds once to the output dtype, the same arithmetic as ``torch._scaled_mm``'s.

On SM 9.0 with Triton's host tensor descriptors the A and B tiles come by TMA; elsewhere by
pointer loads. Off the GPU (the interpreter) the codes are loaded as bytes and decoded exactly
to fp32, since the interpreter has no FP8 dot, and bf16 outputs are rounded to nearest even by
integer operations, since its bf16 cast truncates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.device_facts import device_facts
from quantdispatch.kernels.native.fp8_prefill_quant import e4m3_value

__all__ = ["BlockGemmTile", "fp8_block_gemm"]

BLOCK_K = 128  # one scale block per step


@dataclass(frozen=True)
class BlockGemmTile:
    """Launch shape: output tile, software-pipeline depth, warps, grouped ordering."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 4
    warps: int = 8
    group_m: int = 8
    tma: bool = True

    def label(self) -> str:
        tail = "t" if self.tma else ""
        return f"{self.block_m}x{self.block_n}s{self.stages}w{self.warps}g{self.group_m}{tail}"


@triton.jit
def _decode_bytes(c):
    """e4m3 codes (uint8) -> exact fp32 (the interpreter's operand path)."""
    ci = c.to(tl.int32)
    v = e4m3_value(ci & 0x7F)
    return tl.where((ci & 0x80) != 0, -v, v)


@triton.jit
def _fp8_block_gemm_kernel(
    a_src, b_src, sa_ptr, sb_ptr, bias_ptr, c_ptr, M, N, K_BLOCKS,
    stride_a, stride_b, stride_c, stride_sa_m, stride_sa_k, stride_sb_r, stride_sb_k,
    SB_ROWS: tl.constexpr, SB_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr, DECODE: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # programs of GROUP_M row tiles sweep the columns together (L2)
    first_m = (pid // width) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_in_group
    pid_n = (pid % width) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, 128)
    sa_ptrs = sa_ptr + offs_m.to(tl.int64) * stride_sa_m
    if SB_SCALAR:  # one weight scale block covers this tile's columns
        sb_ptrs = sb_ptr + (pid_n * BLOCK_N // SB_ROWS) * stride_sb_r
    else:
        sb_ptrs = sb_ptr + (offs_n // SB_ROWS).to(tl.int64) * stride_sb_r
    if not TMA:
        a_ptrs = a_src + offs_m.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
        b_ptrs = b_src + offs_n.to(tl.int64)[:, None] * stride_b + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(K_BLOCKS):
        if TMA:
            a = a_src.load([pid_m * BLOCK_M, kb * 128])
            b = b_src.load([pid_n * BLOCK_N, kb * 128])
        else:
            # rows past M / N only reach outputs the store masks
            a = tl.load(a_ptrs + kb * 128, mask=m_ok[:, None])
            b = tl.load(b_ptrs + kb * 128, mask=n_ok[:, None])
        sa = tl.load(sa_ptrs + kb * stride_sa_k, mask=m_ok, other=0.0)
        if DECODE:
            part = tl.dot(_decode_bytes(a), tl.trans(_decode_bytes(b)), input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(b))
        if SB_SCALAR:
            acc += part * (sa * tl.load(sb_ptrs + kb * stride_sb_k))[:, None]
        else:
            sb = tl.load(sb_ptrs + kb * stride_sb_k, mask=n_ok, other=0.0)
            acc += part * (sa[:, None] * sb[None, :])  # powers of two: their product is exact
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :]
    if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates: round to nearest even here
        bits = acc.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        y = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptrs, y, mask=m_ok[:, None] & n_ok[None, :])


def _descriptor(t: torch.Tensor, box: list[int]) -> object:
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, box)


def fp8_block_gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    *,
    sb_rows: int,
    m: int | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    tile: BlockGemmTile | None = None,
) -> torch.Tensor:
    """``out[:m]`` = (a * sa) @ (b * sb)^T (+ bias), fp32 accumulation, one rounding.

    ``a`` e4m3 (or its uint8 codes) [Ma, K] with ``sa`` [>= Ma, K/128]; ``b`` e4m3 [N, K] rows
    contiguous with ``sb`` [ceil(N / sb_rows), K/128]; ``m``: rows of ``a`` to compute (default
    all: padding rows past it are not read); ``out``: [m, N] with unit column stride (a column
    slice of a wider output is fine), or new of ``out_dtype``. Trusts its caller
    (:mod:`.fp8_prefill` checks shapes once): K % 128 == 0, N % 16 == 0."""
    m = a.shape[0] if m is None else m
    n, k = b.shape
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    tile = tile or BlockGemmTile()
    on_gpu = a.device.type == "cuda"
    tma = tile.tma and device_facts(a.device).tma
    if tma:
        av = a.view(torch.float8_e4m3fn)
        bv = b.view(torch.float8_e4m3fn)
        if m < av.shape[0]:
            av = av[:m]
        a_src = _descriptor(av, [tile.block_m, BLOCK_K])
        b_src = _descriptor(bv, [tile.block_n, BLOCK_K])
    elif on_gpu:
        a_src, b_src = a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn)
    else:
        a_src, b_src = a.view(torch.uint8), b.view(torch.uint8)
    sb_scalar = sb_rows >= tile.block_n and sb_rows % tile.block_n == 0
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    _fp8_block_gemm_kernel[grid](
        a_src, b_src, sa, sb, bias if bias is not None else sa, out, m, n, k // BLOCK_K,
        a.stride(0), b.stride(0), out.stride(0), sa.stride(0), sa.stride(1), sb.stride(0),
        sb.stride(1), SB_ROWS=sb_rows, SB_SCALAR=sb_scalar, HAS_BIAS=bias is not None,
        TMA=tma, DECODE=not on_gpu, ROUND_BF16=not on_gpu and out.dtype == torch.bfloat16,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        GROUP_M=tile.group_m, num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip
    return out

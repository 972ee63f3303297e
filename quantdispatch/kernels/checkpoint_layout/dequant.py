"""Checkpoint-layout FP4 and FP8 weights dequantized to 16-bit rows: the slabs of the large-M
linear path (:func:`..common.slabs.dequant_gemm`) and the expert stacks of the MoE's dequantize
path (:func:`dequant_experts`).

Numerics: each weight is decoded exactly in fp32 (e2m1 * block scale * global scale), rounded
once to the activation dtype, and the GEMM accumulates in fp32: the same as a bf16 / fp16 model
whose weights are the dequantized checkpoint. The global scale is applied before the 16-bit
cast, so fp16 never sees unscaled (overflowing) products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.decode import (
    e2m1_pair_to_f32,
    e4m3_to_f32_scaled,
    e4m3_to_f32_scaled_finite,
    e8m0_to_f32_scaled,
)
from quantdispatch.kernels.common.launch import Launcher

__all__ = [
    "Fp4DequantRows",
    "Fp8DequantRows",
    "dequant_experts",
    "dequant_fp4_rows",
    "dequant_fp8_rows",
]


@triton.jit
def _dequant_fp4_grouped_kernel(
    packed_ptr,
    scale_ptr,
    gs_ptr,
    out32_ptr,
    n_rows,
    n_groups,
    stride_p,
    stride_s,
    stride_o32,
    BYTES_PER_GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HAS_GS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    # A [rows, groups, bytes] tile: each scale is loaded once (a contiguous [rows, groups] load)
    # and broadcast over its group's bytes, faster than a per-byte scale gather
    # (benchmarks/results/dequant-sweep-h200-*.txt). Each packed byte (elements 2j, 2j + 1)
    # becomes one 32-bit word of two 16-bit values: 2-byte stores were slower.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, BYTES_PER_GROUP)
    m2 = (rows[:, None] < n_rows) & (groups[None, :] < n_groups)
    sbits = tl.load(scale_ptr + rows[:, None] * stride_s + groups[None, :], mask=m2, other=0)
    if SCALE_E8M0:
        scale = e8m0_to_f32_scaled(sbits, 14)
    else:
        scale = e4m3_to_f32_scaled_finite(sbits) * 4194304.0  # e4m3 * 2^-8 * 2^22
    if HAS_GS:
        scale = scale * tl.load(gs_ptr)
    scale3 = scale[:, :, None]
    byte_off = groups[None, :, None] * BYTES_PER_GROUP + j[None, None, :]
    m3 = m2[:, :, None]
    byte = tl.load(packed_ptr + rows[:, None, None] * stride_p + byte_off, mask=m3, other=0)
    lo, hi = e2m1_pair_to_f32(byte)
    if OUT_BF16:
        lo16 = (lo * scale3).to(tl.bfloat16).to(tl.uint16, bitcast=True)
        hi16 = (hi * scale3).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    else:
        lo16 = (lo * scale3).to(tl.float16).to(tl.uint16, bitcast=True)
        hi16 = (hi * scale3).to(tl.float16).to(tl.uint16, bitcast=True)
    word = lo16.to(tl.uint32) | (hi16.to(tl.uint32) << 16)
    tl.store(
        out32_ptr + rows[:, None, None] * stride_o32 + byte_off,
        word.to(tl.int32, bitcast=True),
        mask=m3,
    )


@triton.jit
def _dequant_fp8_kernel(
    w_ptr,
    scale_ptr,
    out_ptr,
    n_rows,
    k,
    row0,
    stride_w,
    stride_s,
    stride_o,
    SCALE_KIND: tl.constexpr,  # 0 tensor, 1 channel, 2 block
    BLOCK_SN: tl.constexpr,
    BLOCK_SK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < k)
    bits = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0)
    if SCALE_KIND == 0:
        scale = tl.load(scale_ptr)
    elif SCALE_KIND == 1:
        scale = tl.load(scale_ptr + (row0 + rows)[:, None], mask=rows[:, None] < n_rows, other=0.0)
    else:
        sr = (row0 + rows) // BLOCK_SN
        sc = cols // BLOCK_SK
        scale = tl.load(scale_ptr + sr[:, None] * stride_s + sc[None, :], mask=mask, other=0.0)
    vals = e4m3_to_f32_scaled(bits) * (scale * 256.0)
    tl.store(
        out_ptr + rows[:, None] * stride_o + cols[None, :],
        vals.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


class Fp4DequantRows:
    """:func:`dequant_fp4_rows` over one weight with the launch bound once (the slabs of a bound
    large-M linear): ``rows(a, b, out)`` writes weight rows a..b into ``out`` (bf16 or fp16)."""

    def __init__(
        self,
        packed: torch.Tensor,
        block_scale_u8: torch.Tensor,
        global_scale: torch.Tensor | None,
        *,
        scale_format: str,
        tile: tuple[int, int, int] = (16, 128, 4),
    ) -> None:
        half_k = packed.shape[1]
        self._block_r, block_b, self._warps = tile
        per_group = (32 if scale_format == "e8m0" else 16) // 2  # packed bytes per scale
        self._n_groups = half_k // per_group
        self._block_g = max(1, block_b // per_group)
        self._packed, self._scales = packed, block_scale_u8
        self._fixed = dict(
            gs_ptr=global_scale if global_scale is not None else packed,
            n_groups=self._n_groups, stride_p=packed.stride(0),
            stride_s=block_scale_u8.stride(0), BYTES_PER_GROUP=per_group,
            SCALE_E8M0=scale_format == "e8m0", HAS_GS=global_scale is not None,
            BLOCK_R=self._block_r, BLOCK_G=self._block_g,
        )  # fmt: skip
        self._launchers: dict[torch.dtype, Launcher] = {}

    def _launcher(self, dtype: torch.dtype) -> Launcher:
        launcher = self._launchers[dtype] = Launcher(
            _dequant_fp4_grouped_kernel,
            ("packed_ptr", "scale_ptr", "out32_ptr", "n_rows", "stride_o32"),
            dict(self._fixed, OUT_BF16=dtype == torch.bfloat16),
            dict(num_warps=self._warps),
        )
        return launcher

    def __call__(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        launch = self._launchers.get(out.dtype) or self._launcher(out.dtype)
        out32 = out.view(torch.int32)  # [rows, K / 2]: one word per packed byte
        grid = (triton.cdiv(b - a, self._block_r), triton.cdiv(self._n_groups, self._block_g))
        launch(grid, self._packed[a:b], self._scales[a:b], out32, b - a, out32.stride(0))
        return out


def dequant_fp4_rows(
    packed: torch.Tensor,
    block_scale_u8: torch.Tensor,
    global_scale: torch.Tensor | None,
    out: torch.Tensor,
    *,
    scale_format: str,
    tile: tuple[int, int, int] = (16, 128, 4),
) -> torch.Tensor:
    """Write the dequantized rows of an NVFP4 / MXFP4 weight into ``out`` [rows, K] (16-bit,
    rows contiguous). ``tile`` = (rows, packed bytes, warps) per program; the default is from
    benchmarks/probes/dequant_sweep.py on the H200 (docs/design/checkpoint-layout.md)."""
    rows = Fp4DequantRows(
        packed, block_scale_u8, global_scale, scale_format=scale_format, tile=tile
    )
    return rows(0, packed.shape[0], out)


class Fp8DequantRows:
    """:func:`dequant_fp8_rows` over one weight with the launch bound once: ``rows(a, b, out)``
    writes weight rows a..b into ``out``."""

    def __init__(
        self, weight_u8: torch.Tensor, scale: torch.Tensor, *, block_size: tuple[int, int] | None
    ) -> None:
        self._k = weight_u8.shape[1]
        kind = 2 if block_size is not None else (0 if scale.dim() == 0 else 1)
        bn, bk = block_size or (1, 1)
        self._weight = weight_u8
        self._launch = Launcher(
            _dequant_fp8_kernel,
            ("w_ptr", "out_ptr", "n_rows", "row0", "stride_o"),
            dict(
                scale_ptr=scale, k=self._k, stride_w=weight_u8.stride(0),
                stride_s=scale.stride(0) if scale.dim() == 2 else 0, SCALE_KIND=kind,
                BLOCK_SN=bn, BLOCK_SK=bk, BLOCK_R=_FP8_BLOCK_R, BLOCK_K=_FP8_BLOCK_K,
            ),
            dict(num_warps=4),
        )  # fmt: skip

    def __call__(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        grid = (triton.cdiv(b - a, _FP8_BLOCK_R), triton.cdiv(self._k, _FP8_BLOCK_K))
        self._launch(grid, self._weight[a:b], out, b - a, a, out.stride(0))
        return out


_FP8_BLOCK_R, _FP8_BLOCK_K = 32, 128


def dequant_fp8_rows(
    weight_u8: torch.Tensor,
    scale: torch.Tensor,
    row0: int,
    out: torch.Tensor,
    *,
    block_size: tuple[int, int] | None,
) -> torch.Tensor:
    """Dequantize FP8 rows ``row0 .. row0 + len(weight_u8)`` (scales indexed from row0)."""
    rows = Fp8DequantRows(weight_u8, scale, block_size=block_size)
    n = weight_u8.shape[0]
    rows._launch(
        (triton.cdiv(n, _FP8_BLOCK_R), triton.cdiv(weight_u8.shape[1], _FP8_BLOCK_K)),
        weight_u8, out, n, row0, out.stride(0),
    )  # fmt: skip
    return out


def dequant_experts(
    fmt: str, codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """All experts of one stacked FP4 weight as 16-bit [E, N, K] (each value rounded once)."""
    e, n, k = codes.shape[0], codes.shape[1], codes.shape[2] * 2
    out = checks.empty((e, n, k), dtype, codes.device)
    for i in range(e):
        dequant_fp4_rows(
            codes[i],
            scales[i],
            gs[i] if gs is not None else None,
            out[i],
            scale_format="e4m3" if fmt == "nvfp4" else "e8m0",
        )
    return out

"""NVFP4 activation quantization in one Triton launch, bit-equal with the plain-torch rule.

The rule (quantdispatch.formats.nvfp4_act, sources in docs/design/native-fp4.md): per 16
elements, sf = S * (amax * fl32(1/6)) rounded to e4m3 (nearest even, saturating at 448),
os = 1 / (sf8 * (1/S)) (0 for a zero scale), codes = e2m1(x * os) with ties to even. Every
step is an IEEE fp32 operation: divisions use ``div_rn`` (Triton's ``/`` is approximate on the
GPU), and the e4m3 / e2m1 encodings are done with integer and compare ops, so the kernel runs on
any GPU Triton supports (no FP8 conversion hardware) and in the interpreter.

One program quantizes BLOCK_M rows x BLOCK_G groups of 16. Block scales are written either
[M, K/16] row-major or straight into the swizzled 128x4 layout of the block-scaled GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.formats.nvfp4_act import (
    GROUP,
    quantize_nvfp4_activations_raw,
    swizzled_scale_shape,
)
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.native.fp8_prefill_quant import e4m3_code, e4m3_value

__all__ = ["quantize_nvfp4_activations_triton"]

_DEFAULT_BLOCKS = (16, 16)  # rows, groups of 16 per program: 4096 elements


@triton.jit
def _e4m3_rne_code(v):
    """fp32 v >= 0 (or +inf) -> e4m3 code 0..126: nearest even, saturating at 448."""
    return e4m3_code(tl.minimum(v, 448.0))


@triton.jit
def _e2m1_code(y):
    """fp32 -> e2m1 code (int32): nearest, ties to the even code, saturating, sign bit kept."""
    a = tl.abs(y)
    idx = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    idx += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    idx += (a > 5.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return idx | (sign << 3)


@triton.jit
def _nvfp4_act_quant_kernel(
    x_ptr,
    s_ptr,
    q_ptr,
    sf_ptr,
    m,
    groups,
    stride_xm,
    stride_qm,
    k_tiles,
    r6,
    SWIZZLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    grps = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    elem = tl.arange(0, 16)
    rows64 = rows.to(tl.int64)
    mask2 = (rows < m)[:, None] & (grps < groups)[None, :]
    mask3 = mask2[:, :, None]

    offs = rows64[:, None, None] * stride_xm + grps[None, :, None] * 16 + elem[None, None, :]
    x = tl.load(x_ptr + offs, mask=mask3, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)

    s = tl.load(s_ptr)
    sf = s * (amax * r6)
    code8 = _e4m3_rne_code(sf)
    p = e4m3_value(code8) * tl.math.div_rn(1.0, s)
    zero = code8 == 0
    os = tl.where(zero, 0.0, tl.math.div_rn(1.0, tl.where(zero, 1.0, p)))

    codes = _e2m1_code(x * os[:, :, None])
    lo, hi = tl.split(tl.reshape(codes, (BLOCK_M, BLOCK_G, 8, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    pair = tl.arange(0, 8)
    q_offs = rows64[:, None, None] * stride_qm + grps[None, :, None] * 8 + pair[None, None, :]
    tl.store(q_ptr + q_offs, packed, mask=mask3)

    if SWIZZLE:
        tile = (rows64 // 128)[:, None] * k_tiles + (grps // 4)[None, :]
        inner = ((rows64 % 32) * 16 + ((rows64 // 32) % 4) * 4)[:, None] + (grps % 4)[None, :]
        sf_offs = tile * 512 + inner
    else:
        sf_offs = rows64[:, None] * groups + grps[None, :]
    tl.store(sf_ptr + sf_offs, code8.to(tl.uint8), mask=mask2)


def quantize_nvfp4_activations_triton(
    x: torch.Tensor,
    encode_scale: torch.Tensor,
    *,
    swizzle: bool = False,
    blocks: tuple[int, int] = _DEFAULT_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and bits as ``quantize_nvfp4_activations_raw``, in one kernel launch.

    x [M, K] bf16/fp16/fp32 with unit stride along K; ``encode_scale`` the trusted 0-dim fp32 S on
    x's device. Returns (packed uint8 [M, K/2], e4m3 scales [M, K/16] or the flat swizzled
    buffer, zero-padded). ``blocks`` (rows, groups per program; powers of two) exists for tests.
    """
    if x.ndim != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        # one set of error messages: the torch version raises them
        return quantize_nvfp4_activations_raw(x, encode_scale, swizzle=swizzle)
    if x.shape[1] % GROUP != 0 or x.shape[1] == 0:
        return quantize_nvfp4_activations_raw(x, encode_scale, swizzle=swizzle)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = k // GROUP
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    if swizzle:
        rp, gp = swizzled_scale_shape(m, groups)
        scales = torch.zeros((rp * gp,), dtype=torch.uint8, device=x.device)
    else:
        gp = 4
        scales = torch.empty((m, groups), dtype=torch.uint8, device=x.device)
    if m > 0:
        s = encode_scale.to(device=x.device, dtype=torch.float32).reshape(1)
        bm, bg = blocks
        grid = (triton.cdiv(m, bm), triton.cdiv(groups, bg))
        launch(_nvfp4_act_quant_kernel, grid,
            x,
            s,
            packed,
            scales,
            m,
            groups,
            x.stride(0),
            packed.stride(0),
            gp // 4,
            1.0 / 6.0,
            SWIZZLE=swizzle,
            BLOCK_M=bm,
            BLOCK_G=bg,
            num_warps=4,
        )
    return packed, scales.view(torch.float8_e4m3fn)

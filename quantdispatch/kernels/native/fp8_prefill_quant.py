"""FP8 prefill operands in Triton, bit-equal with the plain-torch rule of
:mod:`quantdispatch.formats.fp8_prefill` (power-of-two block scales, one rounding to e4m3):

* :func:`reencode_fp4_triton`: checkpoint-layout NVFP4 / MXFP4 rows -> e4m3 codes and fp32 block
  scales, one program per block row range and column block. Pass 1 takes each block-16 (32)
  group's largest magnitude code with integer max (codes 0..7 are ordered like their values)
  and times its scale; pass 2 decodes, multiplies by scale * 2^-e (exact) and rounds.
* :func:`quantize_blocks_triton`: any 16/32-bit matrix -> the same (activations per token and
  per 128, or the exact unit rows another layout's dequantizer wrote).

The rounding (:func:`e4m3_pair`) is the GPU's ``cvt.rn.satfinite.e4m3x2.f32`` in inline PTX
where FP8 conversion exists (``HW``: SM 8.9+; the scaled values are at most 448, so nothing
saturates; non-finite values are set to the rule's codes after it), and integer code elsewhere,
the interpreter included. Triton's own fp32 -> fp8e4nv cast is not used: it did not round to
nearest even on the H200. Both paths give the same bits (tests/gpu/test_fp8_prefill_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.capability import SM89_PLUS
from quantdispatch.kernels.common.decode import e2m1_pair_to_f32
from quantdispatch.kernels.common.device_facts import device_facts
from quantdispatch.kernels.common.launch import launch

__all__ = [
    "block_exponent",
    "e2m1_magnitude",
    "e4m3_bytes",
    "e4m3_code",
    "e4m3_pair",
    "e4m3_value",
    "hw_rounding",
    "pow2",
    "quantize_blocks_triton",
    "reencode_fp4_triton",
    "widen16",
]


@triton.jit
def pow2(e):
    """2^e as exact fp32 for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def block_exponent(amax):
    """Smallest e with amax <= 448 * 2^e (0 for amax == 0), clamped to [-126, 126]."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(amax == 0.0, 0, e)
    return tl.minimum(tl.maximum(e, -126), 126)


@triton.jit
def e4m3_code(v):
    """fp32 (|v| <= 448 or non-finite) -> e4m3 code as int32 0..255: nearest, ties to even,
    subnormals kept, sign kept; +-inf -> 0x7F | sign, NaN -> 0x7F."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    ab = bits & 0x7FFFFFFF
    # integer encoding: exact on every GPU (no FP8 conversion instruction needed) and in the
    # CPU interpreter, whose FP8 cast does not round to nearest even
    ex = ab >> 23
    # normal results (>= 2^-6): drop 20 mantissa bits, half to even, rebias 127 -> 7
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal results: round v / 2^-9 to an integer, half to even (8 is 2^-6, code 8)
    mant = tl.where(ex > 0, (ab & 0x7FFFFF) | 0x800000, ab & 0x7FFFFF)
    sh = tl.minimum(tl.maximum(141 - tl.maximum(ex, 1), 1), 31)
    q = mant >> sh
    rem = mant - (q << sh)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    mag = tl.where(ex >= 121, normal, q + up.to(tl.int32))
    mag = tl.where(ab >= 0x7F800000, 0x7F, mag)
    return tl.where(ab > 0x7F800000, 0x7F, mag | (sign << 7))  # NaN signs are not kept


@triton.jit
def _special_code(v):
    """The rule's code for a non-finite v: +-inf -> 0x7F | sign, NaN -> 0x7F."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7F, 0x7F | ((bits >> 24) & 0x80))


@triton.jit
def e4m3_pair(lo, hi, HW: tl.constexpr):
    """Two fp32 tensors (|v| <= 448 or non-finite) -> int32 ``code(lo) | code(hi) << 8``, the
    codes as :func:`e4m3_code` gives them. ``HW``: one ``cvt.rn.satfinite.e4m3x2.f32`` per
    pair (SM 8.9+), then the non-finite inputs (which it saturates) set to the rule's codes."""
    if HW:
        pair = tl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $2, $1; cvt.u32.u16 $0, t; }",
            "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
        lo_ab = lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        hi_ab = hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        pair = tl.where(lo_ab >= 0x7F800000, (pair & 0xFF00) | _special_code(lo), pair)
        return tl.where(hi_ab >= 0x7F800000, (pair & 0xFF) | (_special_code(hi) << 8), pair)
    else:
        return e4m3_code(lo) | (e4m3_code(hi) << 8)


@triton.jit
def e4m3_bytes(v, HW: tl.constexpr):
    """fp32 tensor (|v| <= 448 or non-finite) -> uint8 codes as :func:`e4m3_code` gives them.
    ``HW``: two ``cvt.rn.satfinite.e4m3x2.f32`` per four elements, non-finite inputs fixed
    after."""
    if HW:
        c = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,f,f,f,f", [v], dtype=tl.uint8, is_pure=True, pack=4,
        )  # fmt: skip
        ab = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.where(ab >= 0x7F800000, _special_code(v).to(tl.uint8), c)
    else:
        return e4m3_code(v).to(tl.uint8)


def hw_rounding(device: torch.device) -> bool:
    """Whether kernels on ``device`` round with the FP8 conversion instruction (an NVIDIA GPU of
    SM 8.9+; the instruction is PTX, so not on ROCm builds)."""
    facts = device_facts(device)  # cached per device: no driver call per launch
    cap = facts.capability
    return facts.compiled and torch.version.hip is None and cap in SM89_PLUS


@triton.jit
def e2m1_magnitude(i):
    """E2M1 magnitude code 0..7 (int32) -> its value 0, 0.5, 1, 1.5, 2, 3, 4, 6 (fp32)."""
    big = (((i >> 1) + 126) << 23) | ((i & 1) << 22)
    return tl.where(i < 2, i.to(tl.float32) * 0.5, big.to(tl.float32, bitcast=True))


@triton.jit
def e4m3_value(c):
    """Non-negative e4m3 code (int32) -> its fp32 value, exactly."""
    e = c >> 3
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _fp4_load(p_ptr, s_ptr, rows64, rmask, kc, stride_p, stride_s,
              BPG: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """Scale bits [R, G] and packed bytes [R, G, BPG] of 128-column chunk ``kc``."""
    grp = tl.arange(0, G)
    j = tl.arange(0, BPG)
    sbits = tl.load(
        s_ptr + rows64[:, None] * stride_s + kc * G + grp[None, :], mask=rmask[:, None], other=0
    ).to(tl.int32)
    offs = rows64[:, None, None] * stride_p + kc * 64 + grp[None, :, None] * BPG + j[None, None, :]
    byte = tl.load(p_ptr + offs, mask=rmask[:, None, None], other=0).to(tl.int32)
    return sbits, byte


@triton.jit
def _fp4_group_max(sbits, byte, MX: tl.constexpr):
    """Largest |unit value| of each group [R, G]: the largest magnitude code times the scale."""
    mag = tl.max(tl.maximum(byte & 7, (byte >> 4) & 7), axis=2)
    if MX:  # noqa: SIM108 (constexpr branches read better in kernel code)
        sv = pow2(sbits - 127)
    else:
        sv = e4m3_value(sbits)
    return e2m1_magnitude(mag) * sv


@triton.jit
def _fp4_encode(q32_ptr, sbits, byte, e_rows, rows64, rmask, kc, stride_q32, MX: tl.constexpr,
                BPG: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
                HW: tl.constexpr):  # fmt: skip
    """Codes of one chunk: e2m1 * 2^-14 (decoded) times scale * 2^(14 - e) (exact), rounded;
    stored as 32-bit words of four codes."""
    if MX:
        ge = tl.minimum(tl.maximum(sbits - 113 - e_rows[:, None], -100), 127)
        gm = pow2(ge)
    else:
        gm = e4m3_value(sbits) * pow2(14 - e_rows[:, None])
    lo, hi = e2m1_pair_to_f32(byte)
    # one 16-bit pair per packed byte, element 2j in the low byte
    w16 = e4m3_pair(lo * gm[:, :, None], hi * gm[:, :, None], HW)
    a, b = tl.split(tl.reshape(w16, (BLOCK_R, G, BPG // 2, 2)))
    w32 = a | (b << 16)
    grp = tl.arange(0, G)
    jj = tl.arange(0, BPG // 2)
    offs = rows64[:, None, None] * stride_q32 + kc * 32 + grp[None, :, None] * (BPG // 2)
    tl.store(q32_ptr + offs + jj[None, None, :], w32, mask=rmask[:, None, None])


@triton.jit
def _block_scales(amax, mult_ptr, qs_ptr, pid_r, rows64, mask, kb, stride_qs_r, stride_qs_k,
                  HAS_MULT: tl.constexpr, SHARE_ROWS: tl.constexpr,
                  BLOCK_R: tl.constexpr):  # fmt: skip
    """From each row's largest |value| [BLOCK_R] of block column ``kb``: store the block scales
    (2^e times the multiplier; 0 for an all-zero block), one for the program's rows
    (``SHARE_ROWS``) or one per row, and return each row's exponent e."""
    if SHARE_ROWS:
        bmax = tl.max(amax, axis=0)
        e = block_exponent(bmax)
        scale = pow2(e)
        if HAS_MULT:
            scale = scale * tl.load(mult_ptr)
        scale = tl.where(bmax == 0.0, 0.0, scale)
        tl.store(qs_ptr + pid_r * stride_qs_r + kb * stride_qs_k, scale)
        return tl.zeros((BLOCK_R,), dtype=tl.int32) + e
    else:
        e_rows = block_exponent(amax)
        scale = pow2(e_rows)
        if HAS_MULT:
            scale = scale * tl.load(mult_ptr)
        scale = tl.where(amax == 0.0, 0.0, scale)
        tl.store(qs_ptr + rows64 * stride_qs_r + kb * stride_qs_k, scale, mask=mask)
        return e_rows


@triton.jit
def _fp4_to_fp8_kernel(p_ptr, s_ptr, gs_ptr, q32_ptr, qs_ptr, n_rows, chunks, stride_p,
                       stride_s, stride_q32, stride_qs_r, stride_qs_k, MX: tl.constexpr,
                       HAS_GS: tl.constexpr, SHARE_ROWS: tl.constexpr, ONE_CHUNK: tl.constexpr,
                       BPG: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
                       HW: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64)
    if ONE_CHUNK:
        sbits, byte = _fp4_load(p_ptr, s_ptr, rows64, rmask, kb, stride_p, stride_s, BPG, G)
        amax = tl.max(_fp4_group_max(sbits, byte, MX), axis=1)
    else:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c in range(chunks):
            sb, by = _fp4_load(p_ptr, s_ptr, rows64, rmask, kb * chunks + c, stride_p, stride_s,
                               BPG, G)  # fmt: skip
            amax = tl.maximum(amax, tl.max(_fp4_group_max(sb, by, MX), axis=1))
    e_rows = _block_scales(amax, gs_ptr, qs_ptr, pid_r, rows64, rmask, kb, stride_qs_r,
                           stride_qs_k, HAS_GS, SHARE_ROWS, BLOCK_R)  # fmt: skip
    if ONE_CHUNK:
        _fp4_encode(q32_ptr, sbits, byte, e_rows, rows64, rmask, kb, stride_q32, MX, BPG, G,
                    BLOCK_R, HW)  # fmt: skip
    else:
        for c in range(chunks):
            sb, by = _fp4_load(p_ptr, s_ptr, rows64, rmask, kb * chunks + c, stride_p, stride_s,
                               BPG, G)  # fmt: skip
            _fp4_encode(q32_ptr, sb, by, e_rows, rows64, rmask, kb * chunks + c, stride_q32, MX,
                        BPG, G, BLOCK_R, HW)  # fmt: skip


@triton.jit
def widen16(raw, BF16_BITS: tl.constexpr):
    """Loaded 16-bit values -> fp32. bf16 comes in as its int16 bits and is widened by a shift
    (exact for subnormals too, which the interpreter's bf16 conversion gets wrong)."""
    if BF16_BITS:
        return ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _dense_load(x_ptr, rows64, valid, kc, stride_x, BF16_BITS: tl.constexpr):
    """One 128-column chunk as fp32 (:func:`widen16`)."""
    cols = tl.arange(0, 128)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + kc * 128 + cols[None, :],
                mask=valid[:, None], other=0)  # fmt: skip
    return widen16(x, BF16_BITS)


@triton.jit
def _dense_amax(x):
    a = tl.abs(x)
    return tl.max(tl.where(a != a, float("inf"), a), axis=1)  # NaN counts as infinite


@triton.jit
def _dense_encode(q_ptr, x, e_rows, rows64, inside, kc, stride_q, HW: tl.constexpr):
    """One byte per code; the hardware path rounds four values per two instructions."""
    cols = tl.arange(0, 128)
    tl.store(q_ptr + rows64[:, None] * stride_q + kc * 128 + cols[None, :],
             e4m3_bytes(x * pow2(-e_rows)[:, None], HW), mask=inside[:, None])  # fmt: skip


@triton.jit
def _dense_to_fp8_kernel(x_ptr, mult_ptr, q_ptr, qs_ptr, n_valid, n_rows, chunks, stride_x,
                         stride_q, stride_qs_r, stride_qs_k, HAS_MULT: tl.constexpr,
                         SHARE_ROWS: tl.constexpr, ONE_CHUNK: tl.constexpr,
                         BF16_BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                         HW: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < n_valid  # rows past n_valid (up to n_rows) are written as zeros, scale 0
    inside = rows < n_rows
    rows64 = rows.to(tl.int64)
    if ONE_CHUNK:
        x = _dense_load(x_ptr, rows64, valid, kb, stride_x, BF16_BITS)
        amax = _dense_amax(x)
    else:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c in range(chunks):
            x = _dense_load(x_ptr, rows64, valid, kb * chunks + c, stride_x, BF16_BITS)
            amax = tl.maximum(amax, _dense_amax(x))
    e_rows = _block_scales(amax, mult_ptr, qs_ptr, pid_r, rows64, inside, kb, stride_qs_r,
                           stride_qs_k, HAS_MULT, SHARE_ROWS, BLOCK_R)  # fmt: skip
    if ONE_CHUNK:
        _dense_encode(q_ptr, x, e_rows, rows64, inside, kb, stride_q, HW)
    else:
        for c in range(chunks):
            x = _dense_load(x_ptr, rows64, valid, kb * chunks + c, stride_x, BF16_BITS)
            _dense_encode(q_ptr, x, e_rows, rows64, inside, kb * chunks + c, stride_q, HW)


def _as_words(q: torch.Tensor) -> torch.Tensor:
    """The uint8 / e4m3 codes [rows, K] as int32 words [rows, K / 4] (rows 16-byte aligned)."""
    return q.view(torch.uint8).view(torch.int32)


def reencode_fp4_triton(
    packed: torch.Tensor,
    block_scale_u8: torch.Tensor,
    global_scale: torch.Tensor | None,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    scale_format: str,
    block_rows: int,
    block_cols: int,
    rows_per_program: int = 32,
    hw: bool | None = None,
) -> None:
    """Re-encode FP4 rows into ``q`` (uint8 or e4m3 [rows, K], rows contiguous) and ``scale``
    (fp32 [row blocks, K / block_cols], any strides: the GEMM's scale layout is a view).

    Trusts its caller (:mod:`.fp8_prefill` checks shapes once): K % 128 == 0, block_rows 1 or
    128, block_cols a multiple of 128 dividing K, MXFP4 exponents within
    :data:`quantdispatch.formats.fp8_prefill.MX_EXPONENT_RANGE`. ``hw``: round with the FP8
    conversion instruction (None: where the device has it; False: the integer path)."""
    rows, k = packed.shape[0], packed.shape[1] * 2
    if rows == 0:
        return
    mx = scale_format == "e8m0"
    bpg = 16 if mx else 8
    share = block_rows > 1
    block_r = block_rows if share else rows_per_program
    q32 = _as_words(q)
    grid = (triton.cdiv(rows, block_r), k // block_cols)
    launch(_fp4_to_fp8_kernel, grid,
        packed, block_scale_u8, global_scale if global_scale is not None else scale, q32, scale,
        rows, block_cols // 128, packed.stride(0), block_scale_u8.stride(0), q32.stride(0),
        scale.stride(0), scale.stride(1), MX=mx, HAS_GS=global_scale is not None,
        SHARE_ROWS=share, ONE_CHUNK=block_cols == 128, BPG=bpg, G=64 // bpg,
        BLOCK_R=block_r, HW=hw_rounding(q.device) if hw is None else hw,
        num_warps=8 if block_r >= 64 else 4,
    )  # fmt: skip


def quantize_blocks_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_rows: int = 1,
    block_cols: int = 128,
    mult: torch.Tensor | None = None,
    rows_per_program: int = 16,
    hw: bool | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize x [M, K] (16/32-bit, K contiguous) into ``q`` [Mq, K] (Mq >= M; rows M.. are
    written as zero codes with scale 0, the padding the GEMM may need) and ``scale``
    (fp32 [row blocks of Mq, K / block_cols], any strides). Same trust and ``hw`` as above."""
    m, k = x.shape
    rows = q.shape[0]
    if rows == 0:
        return
    share = block_rows > 1
    block_r = block_rows if share else rows_per_program
    qb = q.view(torch.uint8)
    grid = (triton.cdiv(rows, block_r), k // block_cols)
    bf16 = x.dtype == torch.bfloat16
    launch(_dense_to_fp8_kernel, grid,
        x.view(torch.int16) if bf16 else x, mult if mult is not None else scale, qb, scale, m,
        rows, block_cols // 128, x.stride(0), qb.stride(0), scale.stride(0), scale.stride(1),
        HAS_MULT=mult is not None, SHARE_ROWS=share, ONE_CHUNK=block_cols == 128,
        BF16_BITS=bf16, BLOCK_R=block_r, HW=hw_rounding(q.device) if hw is None else hw,
        num_warps=num_warps or (8 if block_r >= 64 else 4),
    )  # fmt: skip

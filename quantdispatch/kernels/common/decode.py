"""Shared ``@triton.jit`` decoders for the low-precision codes quantdispatch reads.

Why integer ops: SM75-SM86 have no hardware fp8/fp4 conversion and Triton rejects ``fp8e4nv``
below SM89, so every code is turned into a float by placing its bits into an fp16 bit pattern
and letting an exact conversion (fp16 -> fp32) or an exact power-of-two multiply do the rest.

Why fp16 patterns: an fp16 exponent field holds the 2-bit E2M1 and the 4-bit E4M3 exponents with
their subnormals landing exactly on fp16 subnormals, and ``cvt.f32.f16`` converts fp16
subnormals exactly. After that conversion every value is a *normal* fp32 number, so nothing
depends on whether the compiler flushes fp32 denormals (Triton builds libdevice with ftz).

Scaled outputs are documented per helper: kernels fold the power of two into a per-group or
per-tensor fp32 scale instead of spending one multiply per element.
"""

from __future__ import annotations

import triton
import triton.language as tl

# e2m1 magnitude bits (e1 e0 m) land on fp16 bits 11..9, so the fp16 value is e2m1 * 2^-14
# (code 1, 0.5, lands on the fp16 subnormal 2^-15). Kernels multiply by E2M1_F16_FOLD.
E2M1_F16_FOLD = 16384.0  # 2^14
# e4m3 bits (eeee mmm) land on fp16 bits 13..7, so the fp16 value is e4m3 * 2^-8.
E4M3_F16_FOLD = 256.0  # 2^8


@triton.jit
def e2m1_pair_to_f32(byte):
    """Decode both E2M1 codes of each packed byte to fp32, each scaled by 2^-14 (exact).

    ``byte`` holds values 0..255 (any integer dtype); returns ``(low, high)``: the low nibble
    is the element with the even index. Both halves are built at once in one 32-bit word
    (low nibble -> fp16 bits 0..15, high nibble -> bits 16..31): 2 integer ops per code.
    """
    b = byte.to(tl.uint32)
    # magnitudes: low nibble bits 0..2 -> 9..11, high nibble bits 4..6 -> 25..27
    mag = ((b << 9) | (b << 21)) & 0x0E000E00
    # signs: bit 3 -> 15, bit 7 -> 31
    sgn = ((b << 12) | (b << 24)) & 0x80008000
    word = mag | sgn
    lo = (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (word >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def e2m1_pair_to_16bit(byte, BF16: tl.constexpr):
    """Decode both E2M1 codes of each byte straight to 16-bit floats, no conversion at all.

    Returns ``(low, high)`` as bf16 holding e2m1 * 2^-126 or fp16 holding e2m1 * 2^-14: the
    magnitude bits land on the bottom of the exponent field, so code 1 (0.5) is a 16-bit
    subnormal. That is exact for 16-bit arithmetic: PTX has no flush-to-zero form for bf16
    and Triton emits none for fp16. The caller folds the power of two into its scale.
    """
    b = byte.to(tl.uint32)
    # high nibble -> bits 0..15, low nibble -> bits 16..31
    sgn = ((b << 8) | (b << 28)) & 0x80008000
    if BF16:
        word = (((b << 2) | (b << 22)) & 0x01C001C0) | sgn
        hi = (word & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        lo = (word >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        word = (((b << 5) | (b << 25)) & 0x0E000E00) | sgn
        hi = (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        lo = (word >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def e4m3_to_f32_scaled_finite(bits):
    """Like :func:`e4m3_to_f32_scaled` without the NaN test (3 fewer ops): for block scales,
    which are finite and non-negative by the NVFP4 definition (0x7F would decode as 480)."""
    b = bits.to(tl.uint32)
    f16 = (b & 0x7F) << 7
    return f16.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_to_16bit(bits, BF16: tl.constexpr):
    """E4M3 (fn) code -> its exact value as bf16 or fp16 (NaN codes decode as +-480).

    The 7 magnitude bits are placed at the bottom of the 16-bit exponent/mantissa fields
    (value e4m3 * 2^-120 for bf16, * 2^-8 for fp16; e4m3 subnormals land on 16-bit
    subnormals), then one exact 16-bit multiply by a power of two restores the value.
    """
    b = bits.to(tl.uint32)
    sgn = (b & 0x80) << 8
    if BF16:
        v = (((b & 0x7F) << 4) | sgn).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return v * tl.full(v.shape, 1.329227995784916e36, tl.bfloat16)  # 2^120, in bf16
    else:
        v = (((b & 0x7F) << 7) | sgn).to(tl.uint16).to(tl.float16, bitcast=True)
        return v * tl.full(v.shape, 256.0, tl.float16)


@triton.jit
def e2m1_to_f32(nibble):
    """Exact fp32 value of an E2M1 code 0..15 (bit 3 = sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    n = nibble.to(tl.uint32)
    bits = ((n & 0x7) << 9) | ((n & 0x8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e4m3_to_f32_scaled(bits):
    """E4M3 (fn) code 0..255 -> fp32 value * 2^-8, exact, subnormals included; NaN kept.

    Used for per-element weights (FP8) where the 2^8 is folded into the per-tensor scale.
    """
    b = bits.to(tl.uint32)
    f16 = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    v = f16.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    nan = tl.full(b.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, nan, v)


@triton.jit
def e4m3_to_f32(bits):
    """Exact fp32 value of an E4M3 (fn) code: max 448, subnormals down to 2^-9, NaN kept."""
    return e4m3_to_f32_scaled(bits) * 256.0


@triton.jit
def e8m0_to_f32_scaled(bits, LOG2_FACTOR: tl.constexpr):
    """E8M0 exponent s -> 2^(s - 127 + LOG2_FACTOR) in fp32; s = 255 is NaN (OCP MX).

    Built straight from the exponent field, so it is exact while the biased result stays a
    normal fp32 (1 <= s + LOG2_FACTOR <= 254); beyond that it saturates to 0 / inf.
    """
    s = bits.to(tl.int32) + LOG2_FACTOR
    e = tl.minimum(tl.maximum(s, 0), 255)
    v = (e << 23).to(tl.float32, bitcast=True)
    nan = tl.full(e.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
    return tl.where(bits.to(tl.int32) == 255, nan, v)


@triton.jit
def e8m0_to_f32(bits):
    """Exact fp32 value 2^(s-127) of an E8M0 exponent for s in 1..254; 0 -> 0 (2^-127 is an
    fp32 subnormal that a flushing compiler would lose anyway), 255 -> NaN."""
    return e8m0_to_f32_scaled(bits, 0)


__all__ = [
    "E2M1_F16_FOLD",
    "E4M3_F16_FOLD",
    "e2m1_pair_to_16bit",
    "e2m1_pair_to_f32",
    "e2m1_to_f32",
    "e4m3_to_16bit",
    "e4m3_to_f32",
    "e4m3_to_f32_scaled",
    "e4m3_to_f32_scaled_finite",
    "e8m0_to_f32",
    "e8m0_to_f32_scaled",
]

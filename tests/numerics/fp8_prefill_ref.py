"""Float64 reference of the FP8 prefill operands, written from the rule alone
(docs/design/fp8-prefill.md): per block, e = the smallest integer with amax <= 448 * 2^e (0 for
an all-zero block, clamped to [-126, 126]); code = the e4m3 value nearest to u * 2^-e, ties to
the even code, sign kept; 0x7F | sign for +-inf, 0x7F for NaN; scale = fl32(2^e * mult), 0
for an all-zero block.

Every step is exact in float64 (u has at most 24 significant bits, scaling by 2^-e is exact),
and the e4m3 rounding is done on the value grid: spacing 2^(E - 3) in [2^E, 2^(E + 1)), 2^-9
below 2^-6. Nothing here imports quantdispatch.
"""

from __future__ import annotations

import torch
from ref64 import e2m1_from_bits, e4m3_from_bits, e8m0_from_bits, unpack_low_first

F64 = torch.float64
E4M3_VALUES = e4m3_from_bits(torch.arange(127))  # codes 0..126, 126 = 448


def block_exponent64(amax: torch.Tensor) -> torch.Tensor:
    """int64 e: smallest integer with amax <= 448 * 2^e; 0 for 0; clamped to [-126, 126]."""
    a = amax.to(F64)
    mant, ex = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    e0 = ex.to(torch.int64) - 1  # a = (2 mant) * 2^e0, 2 mant in [1, 2)
    e = torch.where(2 * mant <= 1.75, e0 - 8, e0 - 7)
    e = torch.where(torch.isinf(a), torch.full_like(e, 120), e)  # exponent field 255
    return torch.where(a == 0, torch.zeros_like(e), e).clamp(-126, 126)


def e4m3_round64(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 v with |v| <= 448 -> (rounded float64 value, e4m3 code int64 with sign)."""
    a = v.abs()
    _, ex = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    spacing = torch.where(
        a >= 2.0**-6, torch.pow(2.0, (ex - 4).to(F64)), torch.full_like(a, 2.0**-9)
    )
    r = torch.round(a / spacing) * spacing  # torch.round: half to even, a / spacing exact
    code = torch.searchsorted(E4M3_VALUES, r)
    assert bool((E4M3_VALUES[code.clamp(max=126)] == r).all()), "value off the e4m3 grid"
    sign = torch.signbit(v).to(torch.int64)
    return torch.where(sign == 1, -r, r), code + 128 * sign


def encode64(
    u: torch.Tensor, block_rows: int, block_cols: int, mult: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """u [rows, K] (exact values, any float dtype) -> (codes int64 [rows, K], scales float64
    [row blocks, K / block_cols], each already an fp32 value)."""
    u = u.to(F64)
    rows, k = u.shape
    rb = -(-rows // block_rows)
    up = torch.cat([u, u.new_zeros(rb * block_rows - rows, k)])
    blocks = up.reshape(rb, block_rows, k // block_cols, block_cols)
    finite = torch.isfinite(blocks)
    amax = torch.where(finite, blocks.abs(), torch.full_like(blocks, float("inf")))
    e = block_exponent64(amax.amax(dim=(1, 3)))
    scaled = blocks * torch.pow(2.0, -e.to(F64))[:, None, :, None]
    _, codes = e4m3_round64(torch.where(finite, scaled, torch.zeros_like(scaled)))
    nan = torch.where(torch.signbit(blocks) & ~torch.isnan(blocks), 0xFF, 0x7F)
    codes = torch.where(finite, codes, nan).reshape(rb * block_rows, k)[:rows]
    scale = torch.pow(2.0, e.to(F64)) * (1.0 if mult is None else float(mult))
    scale = torch.where(amax.amax(dim=(1, 3)) == 0, 0.0, scale)
    return codes, scale.to(torch.float32).to(F64)


def unit_values64(packed: torch.Tensor, scale_bits: torch.Tensor, fmt: str) -> torch.Tensor:
    """Exact unit values of an FP4 weight: e2m1 x block scale (no global scale)."""
    vals = e2m1_from_bits(unpack_low_first(packed))
    if fmt == "nvfp4":
        return vals * e4m3_from_bits(scale_bits).repeat_interleave(16, dim=-1)
    return vals * e8m0_from_bits(scale_bits).repeat_interleave(32, dim=-1)


def decode64(codes: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int):
    """e4m3 codes [rows, K] and their block scales -> the float64 matrix they stand for."""
    rows, k = codes.shape
    full = scale.to(F64).repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)
    return e4m3_from_bits(codes.to(torch.int64)) * full[:, :k]


def linear_bound64(x, w, x_scale_full, w_scale_full, y_ref, w_rel: float = 1 / 21):
    """Componentwise bound on |y_fp8 - y_ref| for y_ref = x @ w.T (float64, exact operands):

    per element, |x^ - x| <= ex = max(|x| / 17, 2^-10 s_x) and |w^ - w| <= ew = max(w_rel |w|,
    2^-10 s_w) (the proven bounds; s the block scale), so |x^ w^ - x w| <= ex (|w| + ew) + |x|
    ew; plus 2^-10 sum |x^ w^| for the GEMM's accumulation (fp32, or FP8 tensor cores' narrower
    adder inside a 128-block: generous) and 2^-8 |y| + 2^-24 for the 16-bit output."""
    ax, aw = x.abs(), w.abs()
    ex = torch.maximum(ax / 17, 2.0**-10 * x_scale_full)
    ew = torch.maximum(aw * w_rel, 2.0**-10 * w_scale_full)
    term = ex @ (aw + ew).T + ax @ ew.T
    acc = (ax + ex) @ (aw + ew).T
    return term + 2.0**-10 * acc + 2.0**-8 * y_ref.abs() + 2.0**-24


def fp4_weight(n: int, k: int, fmt: str, seed: int):
    """Random codes; NVFP4 scales over the whole e4m3 range (subnormals, zeros, 448), MXFP4
    exponents over 2^-100 .. 2^100 (spread within rows so blocks differ); zero groups and -0."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    packed[1, :8] = 0x88  # -0 codes
    packed[2] = 0  # an all-zero row
    if fmt == "nvfp4":
        scale = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)
        scale[3] = torch.randint(0, 8, (k // 16,), generator=g, dtype=torch.uint8)  # subnormal
        scale[4, 0] = 0x7E  # 448
        return packed, scale, torch.tensor(3.7e-3, dtype=torch.float32)
    base = torch.randint(100, 155, (n, 1), generator=g)
    scale = (base + torch.randint(-6, 7, (n, k // 32), generator=g)).to(torch.uint8)
    scale[5, 0], scale[6, 0] = 27, 227  # the range ends
    return packed, scale, None

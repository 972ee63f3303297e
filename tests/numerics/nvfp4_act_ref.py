"""Float64 reference of NVFP4 activation quantization, written from the rule alone.

The rule (vLLM / TensorRT-LLM ``scaled_fp4_quant``; docs/design/native-fp4.md), per block of 16:
sf = fl32(S * fl32(amax * fl32(1/6))); sf8 = nearest e4m3 (ties to the even code, saturating at
448); os = 0 if sf8 == 0 else fl32(1 / fl32(sf8 * fl32(1/S))); code = nearest e2m1 of
fl32(x * os) (ties to the even code, saturating at 6), sign bit from the sign of that product.

Every fp32 operation is evaluated exactly in float64 and rounded once to float32: a product of
two floats fits in 53 bits, and a float64 quotient rounded to float32 is the correctly rounded
float32 quotient. Value tables come from the bit-field decoders in ref64.py. Nothing here
imports quantdispatch.
"""

from __future__ import annotations

import torch
from ref64 import e2m1_from_bits, e4m3_from_bits

F64 = torch.float64
E4M3_VALUES = e4m3_from_bits(torch.arange(127))  # codes 0..126, non-negative, 126 = 448
E2M1_VALUES = e2m1_from_bits(torch.arange(8))  # magnitudes of codes 0..7


def f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 to the nearest float32 (ties to even), kept in float64."""
    return t.to(torch.float32).to(F64)


def _nearest_even(v: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest table entry to each v (table ascending); ties -> the even index."""
    d = (v.unsqueeze(-1) - table).abs()
    best = d.min(dim=-1, keepdim=True).values
    ties = d == best
    idx = torch.arange(table.numel())
    even = ties & (idx % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, ties)
    return pick.to(torch.int64).argmax(dim=-1)


def ref_encode_scale(*, input_scale: float | None = None, input_global_scale: float | None = None):
    """S from a ModelOpt multiplier (fl32(1/s)) or a compressed-tensors divisor (as is)."""
    if input_scale is not None:
        return float(f32(1.0 / f32(torch.tensor(input_scale, dtype=F64))))
    return float(f32(torch.tensor(input_global_scale, dtype=F64)))


def ref_quantize(x: torch.Tensor, s_enc: float):
    """-> (codes int64 [M, K] 0..15, e4m3 codes int64 [M, K/16], e4m3 values float64)."""
    m, k = x.shape
    xd = x.to(F64).reshape(m, k // 16, 16)
    s = torch.tensor(s_enc, dtype=F64)
    r6 = f32(torch.tensor(1.0, dtype=F64) / 6.0)
    sf = f32(s * f32(xd.abs().amax(-1) * r6))
    sf_code = _nearest_even(sf.clamp(max=448.0), E4M3_VALUES)
    sf8 = E4M3_VALUES[sf_code]
    p = f32(sf8 * f32(1.0 / s))
    os = torch.where(sf8 == 0, torch.zeros_like(p), f32(1.0 / torch.where(sf8 == 0, 1.0, p)))
    y = f32(xd * os.unsqueeze(-1))
    mag = _nearest_even(y.abs().clamp(max=6.0), E2M1_VALUES)
    codes = mag + 8 * torch.signbit(y).to(torch.int64)
    return codes.reshape(m, k), sf_code, sf8


def ref_unpack(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int64)
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def ref_swizzle_offset(r: int, c: int, groups: int) -> int:
    """Byte offset of scale (row r, column c) in the 128x4-tiled buffer of a [rows, groups]
    scale matrix: 512-byte tiles of 128 rows x 4 columns, tiles ordered row-tile major; inside,
    row r sits at 16 * (r mod 32) + 4 * ((r mod 128) div 32), column c at c mod 4."""
    col_tiles = (groups + 3) // 4
    tile = (r // 128) * col_tiles + c // 4
    return 512 * tile + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4


def ref_w4a4(x, s_enc, a_mult, w_codes, w_sf, w_mult, bias=None) -> torch.Tensor:
    """float64 y = (a_mult * w_mult) * sum(e2m1(qa) sf_a e2m1(qw) sf_w) + bias, where the
    multipliers are applied as one fp32 product (alpha) like the GEMM epilogue."""
    codes, _, sf8 = ref_quantize(x, s_enc)
    m, k = x.shape
    a = (e2m1_from_bits(codes).reshape(m, k // 16, 16) * sf8.unsqueeze(-1)).reshape(m, k)
    n = w_codes.shape[0]
    wv = e2m1_from_bits(w_codes).reshape(n, k // 16, 16)
    w = (wv * e4m3_from_bits(w_sf.view(torch.uint8)).unsqueeze(-1)).reshape(n, k)
    alpha = f32(torch.tensor(a_mult, dtype=F64) * torch.tensor(w_mult, dtype=F64))
    y = (a @ w.T) * alpha
    return y if bias is None else y + bias.to(F64)

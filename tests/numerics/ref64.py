"""Float64 reference maths for the tests, written from the format definitions alone.

Nothing here imports quantdispatch: these decoders are the independent oracle the library's
reference backend (and through it every kernel) is checked against.
"""

from __future__ import annotations

import torch


def e2m1_from_bits(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 code (uint8, 0..15) -> float64 by its bit fields: s eem, bias 1, subnormal at e=0."""
    c = codes.to(torch.int64)
    sign = torch.where((c >> 3) & 1 == 1, -1.0, 1.0).to(torch.float64)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float64)
    normal = (1.0 + m / 2.0) * torch.pow(2.0, (e - 1).to(torch.float64))
    sub = m / 2.0
    return sign * torch.where(e == 0, sub, normal)


def unpack_low_first(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes [..., K]; element 2j is the low nibble."""
    p = packed.to(torch.int64)
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def e4m3_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bit pattern -> float64: s eeee mmm, bias 7, subnormal at e=0, no inf."""
    b = bits.to(torch.int64)
    sign = torch.where((b >> 7) & 1 == 1, -1.0, 1.0).to(torch.float64)
    e = (b >> 3) & 0xF
    m = (b & 7).to(torch.float64)
    normal = (1.0 + m / 8.0) * torch.pow(2.0, (e - 7).to(torch.float64))
    sub = (m / 8.0) * 2.0**-6
    return sign * torch.where(e == 0, sub, normal)


def e8m0_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, bits.to(torch.float64) - 127.0)


def nvfp4_weight64(packed, block_scale, global_scale) -> torch.Tensor:
    """W [N, K] float64 from NVFP4 tensors (block_scale as float8_e4m3fn or its uint8 bits)."""
    vals = e2m1_from_bits(unpack_low_first(packed))
    bits = block_scale.view(torch.uint8) if block_scale.dtype != torch.uint8 else block_scale
    scale = e4m3_from_bits(bits).repeat_interleave(16, dim=-1)
    return vals * scale * float(global_scale)


def mxfp4_weight64(packed, block_scale) -> torch.Tensor:
    vals = e2m1_from_bits(unpack_low_first(packed))
    return vals * e8m0_from_bits(block_scale).repeat_interleave(32, dim=-1)


def fp8_weight64(weight, scale, block=None) -> torch.Tensor:
    w = e4m3_from_bits(weight.view(torch.uint8))
    s = scale.to(torch.float64)
    if s.dim() == 0:
        return w * s
    if s.dim() == 1:
        return w * s[:, None]
    bn, bk = block
    n, k = w.shape
    full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return w * full


def linear64(x: torch.Tensor, w64: torch.Tensor, bias=None) -> torch.Tensor:
    y = x.to(torch.float64) @ w64.T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, with NaN/inf anywhere counting as a failure (inf)."""
    o = out.to(torch.float64)
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float((o - ref).norm() / ref.norm())


def random_e4m3_scales(shape, generator, *, with_extremes: bool = True) -> torch.Tensor:
    """Random positive e4m3 block scales over a wide range, incl. subnormals and 448."""
    exps = torch.randint(-9, 8, shape, generator=generator).to(torch.float32)
    mant = 1 + torch.rand(shape, generator=generator)
    s = (mant * torch.pow(2.0, exps)).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
    if with_extremes:
        flat = s.view(-1)
        flat[0] = torch.tensor(448.0).to(torch.float8_e4m3fn)
        if flat.numel() > 2:
            flat[1] = torch.tensor(2.0**-9).to(torch.float8_e4m3fn)  # smallest subnormal
            flat[2] = torch.tensor(3 * 2.0**-9).to(torch.float8_e4m3fn)
    return s


def random_codes(n: int, k: int, generator) -> torch.Tensor:
    """Packed uint8 [n, k/2] with random nibbles (all 16 codes occur)."""
    return torch.randint(0, 256, (n, k // 2), generator=generator, dtype=torch.int64).to(
        torch.uint8
    )

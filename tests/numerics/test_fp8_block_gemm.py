"""The Triton block-scaled FP8 GEMM that benchmarks/probes/fp8_gemm_sweep.py times beside cuBLAS
(benchmarks/probes/fp8_block_gemm_triton.py) in the interpreter, against
a float64 product of the same e4m3 operands and fp32 block scales: both weight recipes, the
scalar and per-column weight-scale paths, subnormal and large scales, M / N not multiples of
the tile, N != K, several scale blocks, padding rows of A that must not be read, bias, a
column slice of a wider output, bf16 / fp16 / fp32 outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ref64 import e4m3_from_bits

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))
from fp8_block_gemm_triton import BlockGemmTile, fp8_block_gemm

F64 = torch.float64


def codes(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 codes (every code but the two NaNs), zeros included."""
    c = torch.randint(0, 254, (rows, k), generator=g, dtype=torch.int32)
    c = torch.where(c >= 127, c + 1, c)  # skip 0x7F
    return c.to(torch.uint8)


def scales(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Powers of two from 2^-60 to 2^40, plus zeros: every product of two stays an fp32 normal
    (the kernel multiplies them in fp32; the extremes 2^-126 / 2^126 are the next test's)."""
    e = torch.randint(-60, 41, shape, generator=g)
    s = torch.pow(2.0, e.to(F64)).float()
    s[torch.rand(shape, generator=g) < 0.05] = 0.0
    return s


def reference(a, sa, b, sb, sb_rows, m, bias):
    """float64: sum over 128-column blocks of (A_blk @ B_blk^T) * sa * sb."""
    k = a.shape[1]
    av = e4m3_from_bits(a[:m]) * sa[:m].to(F64).repeat_interleave(128, 1)
    sbf = sb.to(F64).repeat_interleave(sb_rows, 0)[: b.shape[0]].repeat_interleave(128, 1)
    bv = e4m3_from_bits(b) * sbf
    y = av @ bv.T
    mag = av.abs() @ bv.abs().T
    if bias is not None:
        y = y + bias.to(F64)
    assert k % 128 == 0
    return y, mag


def tolerance(y, mag, dtype):
    """fp32 accumulation (a 128-term fp32 sum per block, then the running sum: at most 2^-16 of
    the summed magnitudes) plus one rounding to the output dtype, and fp32's subnormal
    spacing."""
    out_ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    # below fp32's normal range the running sum and the output are spaced 2^-149 (bf16 2^-133)
    floor = {torch.float32: 2.0**-145, torch.bfloat16: 2.0**-132, torch.float16: 2.0**-24}[dtype]
    return 2.0**-16 * mag + out_ulp * y.abs() + floor


def scale_operand(rb: int, kb: int, g, transposed: bool) -> torch.Tensor:
    s = scales((kb, rb) if transposed else (rb, kb), g)
    return s.t() if transposed else s


CASES = [
    # m, n, k, sb_rows, tile
    (40, 96, 256, 128, BlockGemmTile(32, 64, 1, 4, 2, tma=False)),  # scalar weight scale
    (40, 96, 384, 1, BlockGemmTile(32, 64, 1, 4, 2, tma=False)),  # per-row weight scale
    (17, 272, 128, 128, BlockGemmTile(16, 256, 1, 4, 1, tma=False)),  # per-column, 2 blocks
    (3, 48, 512, 128, BlockGemmTile(16, 32, 1, 4, 8, tma=False)),
]


@pytest.mark.parametrize(("m", "n", "k", "sb_rows", "tile"), CASES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_block_gemm_matches_float64(m, n, k, sb_rows, tile, out_dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k + sb_rows)
    pad = 16 - m % 16 if m % 16 else 0
    a = codes(m + pad, k, g)
    a[m:] = 0x7F  # padding rows hold NaN codes: reading them would poison the output
    sa = scale_operand(m + pad, k // 128, g, transposed=True)  # cuBLAS's column-major scale_a
    b = codes(n, k, g)
    rb = -(-n // sb_rows)
    sb = scale_operand(rb, k // 128, g, transposed=sb_rows == 1)
    bias = torch.randn(n, generator=g).to(out_dtype) if out_dtype != torch.float32 else None
    y = fp8_block_gemm(
        a, sa, b, sb, sb_rows=sb_rows, m=m, bias=bias, out_dtype=out_dtype, tile=tile
    )
    assert y.shape == (m, n) and y.dtype == out_dtype
    ref, mag = reference(a, sa, b, sb, sb_rows, m, bias)
    err = (y.to(F64) - ref).abs()
    finite = torch.isfinite(ref) & (ref.abs() < 1e38)
    assert bool(torch.isfinite(y.to(F64)[finite]).all())
    assert bool((err[finite] <= tolerance(ref, mag, out_dtype)[finite]).all()), float(
        (err[finite] / tolerance(ref, mag, out_dtype)[finite]).max()
    )


def test_subnormal_operands_and_column_slice():
    """Subnormal e4m3 codes with the smallest and largest scales, written into columns 32..96
    of a wider output (the slab path's out[:, a:b])."""
    g = torch.Generator().manual_seed(7)
    m, n, k = 20, 64, 256
    a = torch.randint(1, 8, (32, k), generator=g, dtype=torch.uint8)  # subnormal codes only
    b = codes(n, k, g)
    sa = torch.full((32, k // 128), 2.0**126)
    sb = torch.full((1, k // 128), 2.0**-126)
    wide = torch.full((m, 160), float("nan"), dtype=torch.float32)
    fp8_block_gemm(a, sa, b, sb, sb_rows=128, m=m, out=wide[:, 32:96],
                   tile=BlockGemmTile(16, 64, 1, 4, 1, tma=False))  # fmt: skip
    ref, mag = reference(a, sa, b, sb, 128, m, None)
    err = (wide[:, 32:96].to(F64) - ref).abs()
    assert bool((err <= tolerance(ref, mag, torch.float32)).all())
    assert bool(torch.isnan(wide[:, :32]).all()) and bool(torch.isnan(wide[:, 96:]).all())


def test_empty_m():
    a = torch.zeros((0, 128), dtype=torch.uint8)
    y = fp8_block_gemm(a, torch.zeros((0, 1)), torch.zeros((16, 128), dtype=torch.uint8),
                       torch.ones((1, 1)), sb_rows=128)  # fmt: skip
    assert y.shape == (0, 16)

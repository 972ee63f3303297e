"""FP8 prefill operands against the float64 rule in fp8_prefill_ref.py: the re-encoding of NVFP4 /
MXFP4 weights and the activation quantizer (plain torch and Triton, interpreted here) bit-equal
for every recipe's blocks, with subnormal / zero block scales, zero blocks, -0, ties, NaN / inf,
padding rows and partial row blocks; the error bounds proven exhaustively; the block-exponent
rule at its edges."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from fp8_prefill_ref import (
    E4M3_VALUES,
    block_exponent64,
    decode64,
    e4m3_round64,
    encode64,
    fp4_weight,
    unit_values64,
)
from ref64 import e2m1_from_bits, e4m3_from_bits

from quantdispatch.errors import InputError, WeightFormatError
from quantdispatch.formats import fp8_prefill as rule
from quantdispatch.kernels.mma_layout.layout import repack, repack_mx
from quantdispatch.kernels.native.fp8_prefill_mma import reencode_mma_triton
from quantdispatch.kernels.native.fp8_prefill_quant import (
    quantize_blocks_triton,
    reencode_fp4_triton,
)

F64 = torch.float64
BLOCKS = [(128, 128), (1, 128), (1, None), (128, 256)]  # None: the whole row (K)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("blocks", BLOCKS)
def test_reencode_bit_equal(fmt, blocks):
    n, k = (200, 256) if blocks[0] == 128 else (40, 256)  # 200: a partial 128-row block
    br, bc = blocks[0], blocks[1] or k
    packed, scale, gs = fp4_weight(n, k, fmt, seed=br + bc)
    codes64, scale64 = encode64(unit_values64(packed, scale, fmt), br, bc, gs)
    sf = "e4m3" if fmt == "nvfp4" else "e8m0"
    q_t, s_t = rule.reencode_fp4_torch(packed, scale, gs, scale_format=sf, block_rows=br,
                                       block_cols=bc)  # fmt: skip
    assert torch.equal(q_t.to(torch.int64), codes64)
    assert torch.equal(s_t.to(F64), scale64)
    q = torch.empty(n, k, dtype=torch.uint8)
    s = torch.empty(s_t.shape, dtype=torch.float32)
    reencode_fp4_triton(packed, scale, gs, q, s, scale_format=sf, block_rows=br, block_cols=bc)
    assert torch.equal(q.to(torch.int64), codes64)
    assert torch.equal(s.to(F64), scale64)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("blocks", [(128, 128), (1, 128), (1, None)])
def test_mma_layout_reencode_bit_equal(fmt, act, blocks):
    """The re-encoder on the mma16x64 layout's words writes the checkpoint path's bits (a zero
    NVFP4 block's -0 codes, which the layout drops, excepted: +0 there)."""
    n, k = (208, 256) if blocks[0] == 128 else (32, 256)  # 208: a partial 128-row block
    br, bc = blocks[0], blocks[1] or k
    packed, scale, gs = fp4_weight(n, k, fmt, seed=bc + n)
    if fmt == "nvfp4":
        words, scales = repack(packed, scale, act)
        layout_gs = gs
    else:
        scale = torch.randint(118, 136, scale.shape, generator=torch.Generator().manual_seed(1))
        scale = scale.to(torch.uint8)
        words, scales, layout_gs = repack_mx(packed, scale, act)
    codes64, scale64 = encode64(unit_values64(packed, scale, fmt), br, bc, gs)
    if fmt == "nvfp4":  # the layout drops the codes of zero-scale blocks: +0
        zero = (scale == 0).repeat_interleave(16, dim=1)
        codes64 = torch.where(zero, torch.zeros_like(codes64), codes64)
    q = torch.empty(n, k, dtype=torch.uint8)
    s = torch.empty(-(-n // br), k // bc)
    reencode_mma_triton(words, scales, layout_gs, 0, n, q, s, act_dtype=act, block_rows=br,
                        block_cols=bc)  # fmt: skip
    assert torch.equal(q.to(torch.int64), codes64)
    assert torch.equal(s.to(F64), scale64)


def special_rows(k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows over 8 decades, a zero block, ties, subnormal and extreme values, NaN and inf."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(21, k, generator=g) * torch.logspace(-4, 4, k)[torch.randperm(k, generator=g)]
    x[1, :128] = 0.0
    x[2, :128] = -0.0
    x[3, 0] = 448.0  # block exponent 0: the rest of the row rounds on e4m3's own grid
    x[3, 1:16] = torch.tensor([1.0625, 1.1875, 2.0**-7 * 1.5, 2.0**-10, 3 * 2.0**-10, -1.0625,
                               2.0**-9 * 2.5, 240.0, 232.0, 0.0, 2.0**-6 * 1.0625, 5.5, 11.0,
                               13.0, 2.0**-8])  # fmt: skip
    finfo = torch.finfo(dtype)
    x[4, :4] = torch.tensor([finfo.max, -finfo.max, finfo.tiny, -finfo.tiny])
    x[5] = finfo.tiny * torch.randn(k, generator=g)  # all tiny (16-bit subnormals)
    x[6, 5], x[7, 9], x[8, 130] = float("nan"), float("inf"), float("-inf")
    x[9, 128:256] = 2.0**-130 if dtype != torch.float16 else 2.0**-24
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("blocks", [(1, 128), (1, None), (128, 128)])
def test_quantize_blocks_bit_equal(dtype, blocks):
    k = 384
    br, bc = blocks[0], blocks[1] or k
    x = special_rows(k, dtype)
    codes64, scale64 = encode64(x, br, bc)
    q_t, s_t = rule.quantize_blocks_torch(x, block_rows=br, block_cols=bc)
    assert torch.equal(q_t.to(torch.int64), codes64)
    assert torch.equal(s_t.to(F64), scale64)
    rows = x.shape[0] + 11  # padding rows: zero codes, scale 0
    q = torch.full((rows, k), 0x55, dtype=torch.uint8)
    s = torch.empty((-(-rows // br), k // bc), dtype=torch.float32)
    quantize_blocks_triton(x, q, s, block_rows=br, block_cols=bc)
    assert torch.equal(q[: x.shape[0]].to(torch.int64), codes64)
    assert bool((q[x.shape[0] :] == 0).all())
    full64, _ = encode64(torch.cat([x, x.new_zeros(11, k)]), br, bc)
    assert torch.equal(s.to(F64), encode64(torch.cat([x, x.new_zeros(11, k)]), br, bc)[1])
    assert full64.shape[0] == rows


def test_activation_scale_layout_and_mult():
    """The GEMM's strided scale view is written correctly, and mult folds into the scales."""
    x = special_rows(256, torch.bfloat16)[:8]
    buf = torch.zeros(2, 16)
    s = buf.t()  # [16, 2] with strides (1, 16): torch._scaled_mm's 1x128 scale_a layout
    q = torch.empty(16, 256, dtype=torch.uint8)
    mult = torch.tensor(0.3, dtype=torch.float32)
    quantize_blocks_triton(x, q, s, mult=mult)
    _, scale64 = encode64(torch.cat([x, x.new_zeros(8, 256)]), 1, 128, mult=float(mult))
    assert torch.equal(s.to(F64), scale64)


def test_e4m3_rounding_grid_exhaustive():
    """Every value with up to 7 significant bits over e4m3's range (ties included) rounds as the
    float64 grid does, in torch and in the interpreted kernel (a 448 in each block keeps e = 0)."""
    mant = torch.arange(64, 128, dtype=F64) / 64  # 1 + j/64
    v = torch.cat([mant * 2.0**p for p in range(-13, 9)] + [torch.arange(0, 8) * 2.0**-9])
    v = v[v <= 448.0]
    v = torch.cat([v, -v])
    pad = (-v.numel()) % 127
    row = torch.cat([v, v.new_zeros(pad)]).reshape(-1, 127)
    x = torch.cat([torch.full((row.shape[0], 1), 448.0, dtype=F64), row], 1).float()
    codes64, _ = encode64(x, 1, 128)
    _, want = e4m3_round64(x.to(F64))
    assert torch.equal(codes64, want)
    q_t, s_t = rule.quantize_blocks_torch(x)
    assert bool((s_t == 1).all()) and torch.equal(q_t.to(torch.int64), want)
    q = torch.empty(x.shape, dtype=torch.uint8)
    quantize_blocks_triton(x, q, torch.empty(x.shape[0], 1))
    assert torch.equal(q.to(torch.int64), want)


def test_block_exponent_edges():
    k = torch.arange(-130, 128, dtype=F64)
    edges = torch.cat([448.0 * 2.0**k, 1.75 * 2.0**k])
    a = torch.cat([edges, torch.nextafter(edges.float(), torch.tensor(0.0)).to(F64),
                   torch.nextafter(edges.float(), torch.tensor(1e39)).to(F64),
                   torch.tensor([0.0, 2.0**-149, 2.0**-126, 3.4e38, float("inf")])])  # fmt: skip
    a = a[torch.isfinite(a.float()) | torch.isinf(a)].float()
    want = block_exponent64(a.to(F64))
    got = rule.block_exponent(a).to(torch.int64)
    assert torch.equal(got, want)
    ok = (a > 0) & (want > -126) & (want < 120)  # unclamped: the defining inequality
    e = want[ok].to(F64)
    assert bool((a[ok].to(F64) <= 448 * 2.0**e).all())
    assert bool((a[ok].to(F64) > 448 * 2.0 ** (e - 1)).all())


def products(fmt: str) -> torch.Tensor:
    """Every non-zero unit value magnitude one FP4 weight element can have (per block scale)."""
    mags = e2m1_from_bits(torch.arange(1, 8))
    if fmt == "nvfp4":
        return (mags[:, None] * e4m3_from_bits(torch.arange(1, 127))[None, :]).flatten()
    return mags  # times 2^s: scale-free, the block exponent shifts it


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reencode_error_bound_exhaustive(fmt):
    """Over every (e2m1, block scale) product w and every block maximum A >= w (the block
    exponent e runs from e(w) to e(w) + 40; beyond, w rounds to 0 as at +40): the error of
    e4m3(w * 2^-e) * 2^e is at most |w| / 21 (NVFP4; 0 for MXFP4) where w * 2^-e >= 2^-6 (e4m3
    normal), and at most 2^-10 * 2^e always. 1/21 is attained (3 x 1.75 = 5.25 -> 5). The
    "2^-4 relative" of the issue holds in the normal range only: below it, weights flush to 0."""
    w = products(fmt)
    e0 = block_exponent64(w)
    worst_rel, worst_abs, flushed = 0.0, 0.0, False
    for t in range(41):
        e = (e0 + t).to(F64)
        scaled = w * torch.pow(2.0, -e)
        r, _ = e4m3_round64(scaled)
        err = (r - scaled).abs()  # in units of 2^e
        normal = scaled >= 2.0**-6
        rel = err[normal] / scaled[normal]
        worst_rel = max(worst_rel, float(rel.max()) if rel.numel() else 0.0)
        if bool((~normal).any()):
            worst_abs = max(worst_abs, float(err[~normal].max()))
        flushed |= bool(((r == 0) & (scaled > 0)).any())
        # the library's torch rounding agrees on these values
        codes = rule.e4m3_codes(scaled.float()).to(torch.int64)
        assert torch.equal(e4m3_from_bits(codes), r)
    if fmt == "nvfp4":
        assert worst_rel == pytest.approx(1 / 21, abs=0) and worst_rel <= rule.NVFP4_REL_BOUND
        assert worst_rel < 2.0**-4
    else:
        assert worst_rel == 0.0
    assert worst_abs == 2.0**-10 and flushed  # attained: 2^-10 ties to 0


def test_mxfp4_exact_range():
    """MXFP4 re-encodes exactly whenever the scaled element is at least 2^-8."""
    w = products("mxfp4")
    e0 = block_exponent64(w)
    for t in range(41):
        scaled = w * torch.pow(2.0, -(e0 + t).to(F64))
        r, _ = e4m3_round64(scaled)
        keep = scaled >= 2.0**-8
        assert torch.equal(r[keep], scaled[keep])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_error_bound_exhaustive(dtype):
    """Every finite 16-bit value x and every block maximum >= |x|: |q - x| <= |x| / 17 where the
    scaled value is an e4m3 normal (attained by 1.0001b, which bf16 and fp16 hold), else at most
    2^-10 * 2^e."""
    bits = torch.arange(0, 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype).to(F64)
    x = x[torch.isfinite(x) & (x > 0)]
    e0 = block_exponent64(x)
    worst = 0.0
    for t in range(0, 30, 3):
        scaled = x * torch.pow(2.0, -(e0 + t).to(F64))
        r, _ = e4m3_round64(scaled)
        err = (r - scaled).abs()
        normal = scaled >= 2.0**-6
        if bool(normal.any()):
            worst = max(worst, float((err[normal] / scaled[normal]).max()))
        assert bool((err[~normal] <= 2.0**-10).all())
    assert worst == pytest.approx(1 / 17, abs=0)


def test_kernel_outputs_meet_weight_bound():
    """On a weight with the widest NVFP4 scales, every re-encoded weight is within its bound."""
    packed, scale, gs = fp4_weight(128, 256, "nvfp4", seed=3)
    u = unit_values64(packed, scale, "nvfp4")
    q = torch.empty(128, 256, dtype=torch.uint8)
    s = torch.empty(1, 2)
    reencode_fp4_triton(packed, scale, gs, q, s, scale_format="e4m3", block_rows=128,
                        block_cols=128)  # fmt: skip
    got = decode64(q, s, 128, 128)
    w = u * float(gs)
    bound = torch.maximum(w.abs() / 21, 2.0**-10 * s.to(F64).repeat_interleave(128, 1))
    assert bool(((got - w).abs() <= bound * (1 + 2.0**-20)).all())


def test_errors():
    with pytest.raises(InputError, match="blocks are 1 or 128 rows"):
        rule.quantize_blocks_torch(torch.zeros(4, 256), block_rows=64)
    with pytest.raises(InputError, match="multiple of 128"):
        rule.quantize_blocks_torch(torch.zeros(4, 200))
    with pytest.raises(InputError, match="2-D floating-point"):
        rule.quantize_blocks_torch(torch.zeros(4, 256, dtype=torch.int32))
    with pytest.raises(InputError, match="'e4m3' \\(NVFP4\\) or 'e8m0'"):
        rule.fp4_unit_values(torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 8), "fp8")
    bad = torch.full((2, 4), 127 + 101, dtype=torch.uint8)
    with pytest.raises(WeightFormatError, match="2\\^101"):
        rule.check_mx_exponents(bad, "test")
    rule.check_mx_exponents(torch.full((2, 4), 127 - 100, dtype=torch.uint8), "test")
    assert E4M3_VALUES[-1] == 448.0

"""quantdispatch.formats against float64 math written here, independently of the module.

The references below decode E2M1 and E4M3 from their sign/exponent/mantissa bit fields and
round by brute force over every representable value; nothing is taken from the module under
test except the thing being tested. Data is random and never all-zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from quantdispatch.errors import (
    ConfigurationError,
    InputError,
    QuantDispatchError,
    WeightFormatError,
)
from quantdispatch.formats import (
    FORMATS,
    Fp8Weight,
    Mxfp4Weight,
    Nvfp4Weight,
    decode_e2m1,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_values,
    encode_e2m1,
    fake_quantize_nvfp4_activations,
    get_format,
    global_scale_from_compressed_tensors,
    global_scale_to_compressed_tensors,
    merge_nvfp4_shards,
    pack_e2m1,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_e2m1,
)

F64 = torch.float64

# ----------------------------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------------------------


def _e2m1_from_bits(code: int) -> float:
    """E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = (code >> 3) & 1
    exp = (code >> 1) & 0b11
    man = code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1.0 + man / 2.0)
    return -mag if sign else mag


def _e4m3_from_bits(byte: int) -> float:
    """E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN, no inf."""
    sign = byte >> 7
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    mag = (man / 8.0) * 2.0**-6 if exp == 0 else (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return -mag if sign else mag


E2M1_REF = torch.tensor([_e2m1_from_bits(c) for c in range(16)], dtype=F64)
E4M3_REF = torch.tensor([_e4m3_from_bits(b) for b in range(256)], dtype=F64)
E4M3_POS = E4M3_REF[:127]  # bytes 0x00..0x7E: every finite value >= 0, increasing
E2M1_POS = E2M1_REF[:8]


def ref_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Byte b holds element 2j in b % 16 and element 2j+1 in b // 16."""
    p = packed.to(torch.int64)
    out = torch.empty(*p.shape[:-1], p.shape[-1] * 2, dtype=torch.int64)
    out[..., 0::2] = p % 16
    out[..., 1::2] = p // 16
    return out


def e4m3_value(t: torch.Tensor) -> torch.Tensor:
    """float64 values of a float8_e4m3fn tensor, decoded from its bytes."""
    return E4M3_REF[t.view(torch.uint8).to(torch.int64)]


def ref_round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round x >= 0 (float64, <= 448) to the nearest e4m3 value; ties to the even byte."""
    d = (x.unsqueeze(-1) - E4M3_POS).abs()
    best = d.min(dim=-1, keepdim=True).values
    is_best = d == best
    idx = torch.arange(127)
    even_best = is_best & (idx % 2 == 0)
    pick = torch.where(even_best.any(-1, keepdim=True), even_best, is_best)
    return E4M3_POS[pick.to(torch.int64).argmax(dim=-1)]


def e2m1_nearest_dist(x: torch.Tensor) -> torch.Tensor:
    """Distance from x (float64) to the nearest E2M1 value (saturation included)."""
    grid = torch.cat([E2M1_POS, -E2M1_POS])
    return (x.unsqueeze(-1) - grid).abs().min(dim=-1).values


def e4m3_nearest_dist(x: torch.Tensor) -> torch.Tensor:
    grid = torch.cat([E4M3_POS, -E4M3_POS])
    return (x.unsqueeze(-1) - grid).abs().min(dim=-1).values


def f32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 to float32 (what an fp32 operation on exact inputs produces)."""
    return x.to(torch.float32).to(F64)


def rand_weight(n: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random weight with block magnitudes spread over ~3 decades, no zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=F64)
    row_mag = 10.0 ** (torch.rand(n, 1, generator=g, dtype=F64) * 3 - 2)
    w = w * row_mag * 0.05
    w = torch.where(w == 0, torch.full_like(w, 1e-3), w)
    return w.to(dtype)


# ----------------------------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------------------------


def test_e2m1_table_matches_bit_formula() -> None:
    table = e2m1_values(F64)
    assert torch.equal(table, E2M1_REF)
    assert torch.signbit(table[8]) and table[8] == 0  # code 8 is -0.0
    assert table.abs().max() == 6.0


def test_decode_every_byte_matches_bit_formula() -> None:
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    got = decode_e2m1(packed, F64)
    assert torch.equal(got, E2M1_REF[ref_unpack(packed)])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(decode_e2m1(packed, dtype).to(F64), got)


def test_nibble_order_hand_written_bytes() -> None:
    # codes 1, 2, 3, 4 are 0.5, 1.0, 1.5, 2.0: element 0 in the LOW nibble of byte 0.
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x43]]
    assert unpack_e2m1(torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)).tolist() == [[1, 2, 8, 15]]
    vals = decode_e2m1(torch.tensor([[0x21, 0xF8]], dtype=torch.uint8))
    assert vals.tolist() == [[0.5, 1.0, -0.0, -6.0]]
    assert torch.signbit(vals[0, 2])


def test_pack_unpack_round_trip() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(ref_unpack(packed), codes.to(torch.int64))
    everything = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_e2m1(unpack_e2m1(everything)), everything)


def test_encode_exact_grid_values_round_trip() -> None:
    codes = encode_e2m1(E2M1_REF.clone())
    assert torch.equal(codes, torch.tensor([*range(8), 0, *range(9, 16)], dtype=torch.uint8))


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        # every tie goes to the even code (ModelOpt's executed rule and compressed-tensors')
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        # saturation
        (6.0, 6.0),
        (6.5, 6.0),
        (1e30, 6.0),
        (math.inf, 6.0),
    ],
)
def test_encode_ties_and_saturation(x: float, expected: float) -> None:
    for dtype in (torch.float32, F64, torch.bfloat16):
        codes = encode_e2m1(torch.tensor([x, -x], dtype=dtype))
        got = E2M1_REF[codes.to(torch.int64)].tolist()
        assert got == [expected, -expected], (x, dtype, got)


def test_encode_just_off_ties() -> None:
    for tie in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        x = torch.tensor([tie], dtype=torch.float32)
        above = torch.nextafter(x, torch.tensor([10.0]))
        below = torch.nextafter(x, torch.tensor([-10.0]))
        lo = E2M1_POS[tie > E2M1_POS].max()
        hi = E2M1_POS[tie < E2M1_POS].min()
        assert E2M1_REF[encode_e2m1(above).long()].item() == hi
        assert E2M1_REF[encode_e2m1(below).long()].item() == lo


def test_encode_random_is_nearest_and_signs() -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.rand(4096, generator=g, dtype=F64) * 16 - 8).to(torch.float32)
    codes = encode_e2m1(x)
    got = E2M1_REF[codes.to(torch.int64)]
    xd = x.to(F64)
    assert torch.equal((got - xd).abs(), e2m1_nearest_dist(xd))
    # sign bit follows x < 0, also when the value rounds to zero (-0.0, code 8)
    assert torch.equal(codes >= 8, x < 0)
    assert encode_e2m1(torch.tensor([-0.1, -0.0, 0.0])).tolist() == [8, 0, 0]


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


def nvfp4_ref_dequant(w: Nvfp4Weight) -> torch.Tensor:
    """float64, exact: e2m1 * e4m3 * fp32 needs 2 + 4 + 24 < 53 significant bits."""
    vals = E2M1_REF[ref_unpack(w.packed)]
    bs = e4m3_value(w.block_scale).repeat_interleave(16, dim=1)
    return vals * bs * w.global_scale.to(F64)


@pytest.mark.parametrize(("n", "k", "dtype"), [(48, 96, torch.float32), (40, 160, torch.bfloat16)])
def test_quantize_nvfp4_matches_modelopt_rule(n: int, k: int, dtype: torch.dtype) -> None:
    w = rand_weight(n, k, seed=n + k, dtype=dtype)
    q = quantize_nvfp4(w)
    assert (
        q.shape == (n, k) and q.packed.shape == (n, k // 2) and q.block_scale.shape == (n, k // 16)
    )
    wd = w.to(F64)

    # global scale: amax / (6 * 448) rounded once to float32
    gs = f32(wd.abs().max() / 2688.0)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.ndim == 0
    assert q.global_scale.item() == gs.item()

    # block scales: fp32 (block_amax / fl32(6 * gs)), clamped to [2^-9, 448], RNE to e4m3
    block_amax = wd.reshape(n, k // 16, 16).abs().amax(-1)
    v = f32(block_amax / f32(6.0 * gs))
    want_bs = ref_round_e4m3(v.clamp(2.0**-9, 448.0))
    assert torch.equal(e4m3_value(q.block_scale), want_bs)
    assert (want_bs == 448.0).any()  # the block holding amax lands on the max scale

    # codes: each element is a nearest E2M1 value of W / (block_scale * global_scale)
    step = (want_bs * gs).repeat_interleave(16, dim=1)
    x = wd / step
    got = E2M1_REF[ref_unpack(q.packed)]
    err = (got - x).abs()
    assert (err <= e2m1_nearest_dist(x) + 1e-6).all()

    # dequant: float64 exact, float32 the correctly rounded value
    ref = nvfp4_ref_dequant(q)
    assert torch.equal(dequantize_nvfp4(q, dtype=F64), ref)
    assert torch.equal(dequantize_nvfp4(q), ref.to(torch.float32))
    assert torch.equal(dequantize_nvfp4(q, dtype=torch.bfloat16), ref.to(torch.bfloat16))

    # documented bound: |W - dequant| <= block_scale * global_scale, element-wise
    assert ((ref - wd).abs() <= step * (1 + 1e-6)).all()
    rel = (ref - wd).norm() / wd.norm()
    assert 0 < rel < 0.15


def test_nvfp4_subnormal_and_max_block_scales_are_exact() -> None:
    n, k = 8, 64
    g = torch.Generator().manual_seed(3)
    # bytes: 2^-9, 2^-8, 3*2^-9, 2^-7, 7*2^-9, 2^-6 (min normal), 0.5, 448
    choices = torch.tensor([0x01, 0x02, 0x03, 0x04, 0x07, 0x08, 0x30, 0x7E], dtype=torch.uint8)
    bs_bytes = choices[torch.randint(0, 8, (n, k // 16), generator=g)]
    bs_bytes[0, :] = choices[:4]
    bs_bytes[1, :] = choices[4:]
    codes = torch.randint(1, 16, (n, k), generator=g).to(torch.uint8)
    codes[codes == 8] = 7  # no zeros, so every block scale is visible in the output
    w = Nvfp4Weight(
        packed=pack_e2m1(codes),
        block_scale=bs_bytes.view(torch.float8_e4m3fn),
        global_scale=torch.tensor(0.75, dtype=torch.float32),
    )
    ref = nvfp4_ref_dequant(w)
    assert ref[0, 0] != 0 and e4m3_value(w.block_scale)[0].tolist() == [
        2.0**-9,
        2.0**-8,
        3 * 2.0**-9,
        2.0**-7,
    ]
    assert torch.equal(dequantize_nvfp4(w, dtype=F64), ref)
    assert torch.equal(dequantize_nvfp4(w), ref.to(torch.float32))
    assert torch.equal(dequantize_nvfp4(w, dtype=torch.bfloat16), ref.to(torch.bfloat16))
    assert torch.equal(dequantize_nvfp4(w, dtype=torch.float16), ref.to(torch.float16))


def test_quantize_nvfp4_produces_subnormal_scales_not_zero() -> None:
    w = rand_weight(4, 64, seed=4)
    w[1] *= 1e-4  # blocks ~1e-4 of the global max: scales in the e4m3 subnormal range
    w[2] *= 1e-7  # below 2^-9 after scaling: clamped, never flushed to zero
    q = quantize_nvfp4(w)
    b = q.block_scale.view(torch.uint8)
    assert ((b[1] >> 3) == 0).any() and (b[1] != 0).all()  # subnormal exponent field
    assert (b[2] == 0x01).all()  # clamped at 2^-9
    d = dequantize_nvfp4(q)
    assert (d[1] != 0).any()
    wd = w.to(F64)
    step = (e4m3_value(q.block_scale) * q.global_scale.to(F64)).repeat_interleave(16, dim=1)
    assert ((d.to(F64) - wd).abs() <= step * (1 + 1e-6)).all()


def test_quantize_nvfp4_given_global_scale_and_input_scale() -> None:
    w = rand_weight(16, 32, seed=5)
    gs = torch.tensor(1.0 / 2048, dtype=torch.float32)
    q = quantize_nvfp4(w, global_scale=gs, with_input_scale=0.125)
    assert q.global_scale.item() == 1.0 / 2048
    assert q.input_scale is not None and q.input_scale.item() == 0.125
    assert set(q.tensors()) == {"packed", "block_scale", "global_scale", "input_scale"}
    assert q.nbytes() == 16 * 16 + 16 * 2 + 4 + 4
    assert torch.equal(dequantize_nvfp4(q, dtype=F64), nvfp4_ref_dequant(q))


def test_quantize_nvfp4_all_zero_weight() -> None:
    q = quantize_nvfp4(torch.zeros(4, 32))
    assert q.global_scale.item() == 1.0
    assert (q.packed == 0).all()
    assert torch.isfinite(e4m3_value(q.block_scale)).all()
    out = dequantize_nvfp4(q)
    assert (out == 0).all()


@pytest.mark.parametrize(
    "rows", [slice(0, 7), slice(7, 20), slice(20, 37), slice(3, 30, 4), slice(35, None)]
)
def test_rows_chunks_equal_full_dequant(rows: slice) -> None:
    n, k = 37, 128
    w = rand_weight(n, k, seed=6)
    for quantize, dequantize in (
        (quantize_nvfp4, dequantize_nvfp4),
        (quantize_mxfp4, dequantize_mxfp4),
        (lambda x: quantize_fp8(x, kind="tensor"), dequantize_fp8),
        (lambda x: quantize_fp8(x, kind="channel"), dequantize_fp8),
        (lambda x: quantize_fp8(x, kind="block", block_size=(8, 48)), dequantize_fp8),
    ):
        q = quantize(w)
        full = dequantize(q)
        assert torch.equal(dequantize(q, rows=rows), full[rows])
    chunks = [dequantize_nvfp4(quantize_nvfp4(w), rows=slice(i, i + 10)) for i in range(0, n, 10)]
    assert torch.equal(torch.cat(chunks), dequantize_nvfp4(quantize_nvfp4(w)))


def test_fake_quantize_nvfp4_activations_reference() -> None:
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 3, 48, generator=g, dtype=F64) * 3).to(torch.float32)
    x[0, 0, :16] *= 1e-6  # a block whose scale rounds to 0 (the native rule has no clamp)
    x[0, 1, :16] *= 3e-5  # a block with a subnormal scale
    s = torch.tensor(x.abs().max().item() / 2688.0, dtype=torch.float32)
    out = fake_quantize_nvfp4_activations(x, s)
    assert out.dtype == x.dtype and out.shape == x.shape

    # Native rule (vLLM scaled_fp4_quant): scale = fl32(S * fl32(amax * fl32(1/6))), S = 1/s,
    # rounded to e4m3 without a lower clamp; the zero-scale block comes back as zeros.
    sd = s.to(F64)
    blocks = x.to(F64).unflatten(-1, (3, 16))
    v = f32(f32(1.0 / sd) * f32(blocks.abs().amax(-1) * f32(torch.tensor(1.0 / 6.0, dtype=F64))))
    bs = ref_round_e4m3(v.clamp(max=448.0))
    assert bs[0, 0, 0] == 0 and 0 < bs[0, 1, 0] < 2.0**-6
    assert not out[0, 0, :16].any()
    bs = torch.where(bs == 0, torch.ones_like(bs), bs)  # keep the checks below finite
    step = (bs * sd).unsqueeze(-1)
    xs = blocks / step
    # out = fl32(q * step): recover the E2M1 value q, then check it is a nearest one of x/step
    ratio = out.to(F64).unflatten(-1, (3, 16)) / step
    grid = torch.cat([E2M1_POS, -E2M1_POS])
    q = grid[(ratio.unsqueeze(-1) - grid).abs().argmin(-1)]
    assert ((ratio - q).abs() <= 2.0**-22 * q.abs()).all()
    assert ((q - xs).abs() <= e2m1_nearest_dist(xs) + 1e-6).all()
    assert torch.equal(out, f32(q * step).flatten(-2).to(torch.float32))

    xb = x.to(torch.bfloat16)
    outb = fake_quantize_nvfp4_activations(xb, s)
    assert outb.dtype == torch.bfloat16
    assert torch.equal(outb, fake_quantize_nvfp4_activations(xb.float(), s).to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# Fused-shard merge
# ----------------------------------------------------------------------------------------------


def _uniform_weight(n: int, k: int, amax: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(n, k, generator=g, dtype=F64) * 2 - 1) * amax
    w[:, 0] = amax  # every block row starts with the max: block scales stay in [~1, 448]
    return w.to(torch.float32)


def test_merge_power_of_two_ratios_is_exact() -> None:
    base = torch.tensor(1.3 * 2.0**-7, dtype=torch.float32)
    gss = [base, base / 4, base * 2]  # ratios to the max: 1/2, 1/8, 1
    shards = [
        quantize_nvfp4(_uniform_weight(16 * (i + 1), 64, 2000 * g.item(), seed=i), global_scale=g)
        for i, g in enumerate(gss)
    ]
    for s in shards:  # precondition: every rescaled block scale is an exact e4m3 value
        r = s.global_scale.to(F64) / (base.to(F64) * 2)
        v = e4m3_value(s.block_scale) * r
        assert torch.isin(v, E4M3_POS).all()
    merged = merge_nvfp4_shards(shards)
    assert merged.global_scale.item() == (base * 2).item()
    assert torch.equal(merged.packed, torch.cat([s.packed for s in shards]))
    want = torch.cat([dequantize_nvfp4(s, dtype=F64) for s in shards])
    assert torch.equal(dequantize_nvfp4(merged, dtype=F64), want)
    assert merged.input_scale is None


def test_merge_other_ratios_within_documented_bound() -> None:
    gss = [torch.tensor(v, dtype=torch.float32) for v in (3.1e-4, 1.7e-4, 2.3e-4)]
    shards = [
        quantize_nvfp4(
            rand_weight(24, 80, seed=10 + i) * (2000 * g.item()), global_scale=g, with_input_scale=s
        )
        for i, (g, s) in enumerate(zip(gss, (0.5, 0.75, 0.25), strict=True))
    ]
    merged = merge_nvfp4_shards(shards)
    common = max(g.item() for g in gss)
    assert merged.global_scale.item() == common
    assert merged.input_scale is not None and merged.input_scale.item() == 0.75
    assert torch.equal(merged.packed, torch.cat([s.packed for s in shards]))

    # per block: |v' - v| <= max(2^-4 v, 2^-9), with v the exact rescaled scale
    v = torch.cat([e4m3_value(s.block_scale) * (s.global_scale.to(F64) / common) for s in shards])
    v_new = e4m3_value(merged.block_scale)
    bound = torch.maximum(v * 2.0**-4, torch.full_like(v, 2.0**-9))
    assert ((v_new - v).abs() <= bound * (1 + 1e-12)).all()
    normal = v >= 2.0**-6
    assert normal.any() and ((v_new - v).abs()[normal] <= v[normal] * 2.0**-4 * (1 + 1e-12)).all()
    assert ((v_new - v).abs() > 0).any()  # the bound is exercised, not vacuous

    # element-wise: |merged - original| <= 6 * bound * common
    orig = torch.cat([dequantize_nvfp4(s, dtype=F64) for s in shards])
    got = dequantize_nvfp4(merged, dtype=F64)
    elem_bound = (6 * bound * common).repeat_interleave(16, dim=1)
    assert ((got - orig).abs() <= elem_bound * (1 + 1e-9)).all()


def test_merge_underflowing_block_scale_is_clamped_not_flushed() -> None:
    n, k = 2, 32
    codes = torch.full((n, k), 7, dtype=torch.uint8)  # all +6
    big = Nvfp4Weight(
        packed=pack_e2m1(codes),
        block_scale=torch.full((n, 2), 448.0).to(torch.float8_e4m3fn),
        global_scale=torch.tensor(1.0, dtype=torch.float32),
    )
    tiny_bs = torch.tensor([[2.0**-4, 0.5], [2.0**-4, 1.0]]).to(torch.float8_e4m3fn)
    small = Nvfp4Weight(
        packed=pack_e2m1(codes),
        block_scale=tiny_bs,
        global_scale=torch.tensor(2.0**-8 * 1.5, dtype=torch.float32),
    )
    merged = merge_nvfp4_shards([big, small])
    v = e4m3_value(tiny_bs) * (2.0**-8 * 1.5)
    v_new = e4m3_value(merged.block_scale[2:])
    assert v[0, 0] < 2.0**-9 and v_new[0, 0] == 2.0**-9  # clamped at the smallest subnormal
    assert ((v_new - v).abs() <= torch.maximum(v * 2.0**-4, torch.full_like(v, 2.0**-9))).all()
    assert (dequantize_nvfp4(merged)[2:] > 0).all()


def test_merge_single_shard_and_errors() -> None:
    a = quantize_nvfp4(rand_weight(8, 32, seed=20), with_input_scale=0.5)
    assert merge_nvfp4_shards([a]) is a
    b = quantize_nvfp4(rand_weight(8, 32, seed=21))
    with pytest.raises(WeightFormatError, match="input_scale"):
        merge_nvfp4_shards([a, b])
    c = quantize_nvfp4(rand_weight(8, 64, seed=22))
    with pytest.raises(WeightFormatError, match="K = 64"):
        merge_nvfp4_shards([b, c])
    with pytest.raises(ConfigurationError, match="non-empty"):
        merge_nvfp4_shards([])
    with pytest.raises(ConfigurationError, match=r"shards\[1\]"):
        merge_nvfp4_shards([b, "not a weight"])  # type: ignore[list-item]


# ----------------------------------------------------------------------------------------------
# compressed-tensors reciprocal convention
# ----------------------------------------------------------------------------------------------


def test_compressed_tensors_global_scale_round_trip() -> None:
    g = torch.Generator().manual_seed(30)
    amax = 10.0 ** (torch.rand(200, generator=g, dtype=F64) * 8 - 4)
    for a in amax.tolist():
        gs = torch.tensor(a / 2688.0, dtype=torch.float32)
        ct = global_scale_to_compressed_tensors(gs)
        assert ct.shape == (1,) and ct.dtype == torch.float32
        assert ct.item() == (torch.tensor(1.0) / gs).item()  # the IEEE float32 division 1/x
        assert abs(ct.item() - 2688.0 / a) <= 2688.0 / a * 2.0**-22
        back = global_scale_from_compressed_tensors(ct)
        assert back.shape == () and back.dtype == torch.float32
        assert abs(back.item() - gs.item()) <= gs.item() * 2.0**-23  # within 1 ulp
    # a checkpoint's [1]-shaped reciprocal, e.g. 6*448/amax with amax = 3.5
    ct = torch.tensor([2688.0 / 3.5], dtype=torch.float32)
    assert global_scale_from_compressed_tensors(ct).item() == pytest.approx(3.5 / 2688, rel=1e-7)
    assert global_scale_to_compressed_tensors(0.25).tolist() == [4.0]


# ----------------------------------------------------------------------------------------------
# MXFP4
# ----------------------------------------------------------------------------------------------


def test_quantize_mxfp4_ocp_rule() -> None:
    n, k = 40, 128
    w = rand_weight(n, k, seed=40)
    q = quantize_mxfp4(w)
    assert q.packed.shape == (n, k // 2) and q.block_scale.shape == (n, k // 32)
    assert q.block_scale.dtype == torch.uint8
    wd = w.to(F64)
    block_amax = wd.reshape(n, k // 32, 32).abs().amax(-1)
    want_bits = torch.tensor(
        [[math.frexp(a)[1] - 1 - 2 + 127 for a in row] for row in block_amax.tolist()],
        dtype=torch.int64,
    )
    assert torch.equal(q.block_scale.to(torch.int64), want_bits)
    scale = (2.0 ** (want_bits - 127).to(F64)).repeat_interleave(32, dim=1)
    x = wd / scale
    got = E2M1_REF[ref_unpack(q.packed)]
    assert torch.equal((got - x).abs(), e2m1_nearest_dist(x))
    ref = got * scale
    assert torch.equal(dequantize_mxfp4(q, dtype=F64), ref)
    assert torch.equal(dequantize_mxfp4(q), ref.to(torch.float32))
    assert torch.equal(dequantize_mxfp4(q, dtype=torch.bfloat16), ref.to(torch.bfloat16))
    # documented bound: <= 2^e below 6 * 2^e, < 2 * 2^e in the saturated band (6, 8) * 2^e
    err = (ref - wd).abs()
    assert (err <= torch.where(x.abs() <= 6, scale, 2 * scale)).all()


def test_mxfp4_extreme_exponents_and_e8m0_dtype() -> None:
    codes = torch.tensor([[1, 2, 7, 15] * 8], dtype=torch.uint8)  # 0.5, 1, 6, -6
    for byte in (0, 1, 127, 200, 254):
        w = Mxfp4Weight(
            packed=pack_e2m1(codes), block_scale=torch.tensor([[byte]], dtype=torch.uint8)
        )
        ref = E2M1_REF[codes.to(torch.int64)] * 2.0 ** (byte - 127)
        assert torch.equal(dequantize_mxfp4(w, dtype=F64), ref)
        if byte <= 200:
            assert torch.equal(dequantize_mxfp4(w), ref.to(torch.float32))
    e8 = torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = Mxfp4Weight(packed=pack_e2m1(codes), block_scale=e8)
    assert w.block_scale.dtype == torch.uint8 and w.block_scale.item() == 127
    assert w.nbytes() == 16 + 1


# ----------------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------------


def _fp8_full_scale(w: Fp8Weight) -> torch.Tensor:
    n, k = w.shape
    s = w.scale.to(F64)
    if w.scale_kind == "tensor":
        return s.expand(n, k)
    if w.scale_kind == "channel":
        return s.unsqueeze(1).expand(n, k)
    bn, bk = w.block_size  # type: ignore[misc]
    out = torch.empty(n, k, dtype=F64)
    for i in range(n):
        for j in range(0, k, bk):
            out[i, j : j + bk] = s[i // bn, j // bk]
    return out


@pytest.mark.parametrize(
    ("kind", "block"), [("tensor", None), ("channel", None), ("block", (32, 48))]
)
def test_quantize_fp8(kind: str, block: tuple[int, int] | None) -> None:
    n, k = 70, 100  # partial edge blocks in both directions
    w = rand_weight(n, k, seed=50)
    q = quantize_fp8(w, kind=kind, block_size=block or (128, 128))  # type: ignore[arg-type]
    assert q.scale_kind == kind and q.block_size == block
    wd = w.to(F64)
    # scale = amax / 448 per group, rounded once to float32
    if kind == "tensor":
        want = f32(wd.abs().max() / 448)
    elif kind == "channel":
        want = f32(wd.abs().amax(1) / 448)
    else:
        bn, bk = block  # type: ignore[misc]
        want = torch.tensor(
            [
                [wd[i : i + bn, j : j + bk].abs().max().item() for j in range(0, k, bk)]
                for i in range(0, n, bn)
            ],
            dtype=F64,
        )
        want = f32(want / 448)
    assert torch.equal(q.scale.to(F64), want)
    full = _fp8_full_scale(q)
    x = wd / full
    got = e4m3_value(q.weight)
    assert ((got - x).abs() <= e4m3_nearest_dist(x) + 1e-9 * x.abs()).all()
    ref = got * full
    assert torch.equal(dequantize_fp8(q, dtype=F64), ref)
    assert torch.equal(dequantize_fp8(q), ref.to(torch.float32))
    # documented bound: half an e4m3 step
    err = (ref - wd).abs()
    assert (err <= torch.maximum(wd.abs() * 2.0**-4, full * 2.0**-10) * (1 + 1e-9)).all()


def test_fp8_scale_layouts_are_normalised() -> None:
    w8 = torch.randn(6, 16).to(torch.float8_e4m3fn)
    per_channel_col = Fp8Weight(weight=w8, scale=torch.rand(6, 1) + 0.1)
    assert per_channel_col.scale.shape == (6,) and per_channel_col.scale_kind == "channel"
    per_tensor_1 = Fp8Weight(weight=w8, scale=torch.tensor([0.5]))
    assert per_tensor_1.scale.shape == () and per_tensor_1.scale_kind == "tensor"
    blk = Fp8Weight(weight=w8, scale=torch.rand(2, 1) + 0.1, block_size=[4, 16])  # type: ignore[arg-type]
    assert blk.block_size == (4, 16) and blk.scale_kind == "block"
    assert set(blk.tensors()) == {"weight", "scale"}


def test_meta_tensors_construct_without_reading_values() -> None:
    """Shape-only (meta) weights validate shapes/dtypes but skip value checks."""
    w = rand_weight(32, 64, seed=70)
    for q in (
        quantize_nvfp4(w, with_input_scale=0.5),
        quantize_mxfp4(w),
        quantize_fp8(w, kind="block", block_size=(16, 32)),
    ):
        m = q.to("meta")
        assert m.shape == q.shape and m.nbytes() == q.nbytes()
        assert all(t.device.type == "meta" for t in m.tensors().values())
    with pytest.raises(WeightFormatError, match="2 groups"):
        Mxfp4Weight(
            packed=torch.empty(4, 16, dtype=torch.uint8, device="meta"),
            block_scale=torch.empty(4, 2, dtype=torch.uint8, device="meta"),
        )


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


def test_registry() -> None:
    assert set(FORMATS) == {"nvfp4", "mxfp4", "fp8"}
    assert get_format("NVFP4") is FORMATS["nvfp4"] and get_format(" Fp8 ") is FORMATS["fp8"]
    assert FORMATS["nvfp4"].default_scheme == "weight_act"
    assert FORMATS["mxfp4"].default_scheme == "weight_only"
    assert FORMATS["fp8"].default_scheme == "weight_act"
    w = rand_weight(256, 512, seed=60)
    for name, q, per_param_overhead in (
        ("nvfp4", quantize_nvfp4(w), 4),
        ("mxfp4", quantize_mxfp4(w), 0),
        ("fp8", quantize_fp8(w, kind="tensor"), 4),
    ):
        spec = get_format(name)
        assert isinstance(q, spec.weight_type)
        assert (q.nbytes() - per_param_overhead) / w.numel() == spec.bits_per_weight
        assert torch.equal(spec.dequantize(q), spec.dequantize(q, dtype=torch.float32))
    assert FORMATS["nvfp4"].bits_per_weight == 0.5625
    assert FORMATS["mxfp4"].bits_per_weight == 0.53125
    with pytest.raises(ConfigurationError, match="fp8, mxfp4, nvfp4"):
        get_format("int4")


# ----------------------------------------------------------------------------------------------
# Validation errors: the right class, and a message naming the field / value
# ----------------------------------------------------------------------------------------------

_P = pack_e2m1(torch.ones(4, 32, dtype=torch.uint8))  # [4, 16] bytes: N = 4, K = 32
_BS = torch.ones(4, 2).to(torch.float8_e4m3fn)
_GS = torch.tensor(0.5)


def _bs_with_byte(byte: int) -> torch.Tensor:
    b = torch.full((4, 2), 0x38, dtype=torch.uint8)  # 1.0
    b[2, 1] = byte
    return b.view(torch.float8_e4m3fn)


def _nv(**kw: object) -> Nvfp4Weight:
    args: dict[str, object] = {"packed": _P, "block_scale": _BS, "global_scale": _GS}
    args.update(kw)
    return Nvfp4Weight(**args)  # type: ignore[arg-type]


def _mx(**kw: object) -> Mxfp4Weight:
    args: dict[str, object] = {
        "packed": _P,
        "block_scale": torch.full((4, 1), 127, dtype=torch.uint8),
    }
    args.update(kw)
    return Mxfp4Weight(**args)  # type: ignore[arg-type]


_W8 = torch.ones(4, 32).to(torch.float8_e4m3fn)


def _fp8(**kw: object) -> Fp8Weight:
    args: dict[str, object] = {"weight": _W8, "scale": torch.tensor(0.5)}
    args.update(kw)
    return Fp8Weight(**args)  # type: ignore[arg-type]


BAD_CASES = [
    # Nvfp4Weight
    pytest.param(
        lambda: _nv(packed=_P.view(torch.int8)), WeightFormatError, "packed", id="nv packed int8"
    ),
    pytest.param(lambda: _nv(packed=_P.flatten()), WeightFormatError, "packed", id="nv packed 1-D"),
    pytest.param(
        lambda: _nv(packed=_P[:, :4], block_scale=_BS[:, :1]),
        WeightFormatError,
        "K = 8",
        id="nv K not /16",
    ),
    pytest.param(
        lambda: _nv(block_scale=_BS.float()), WeightFormatError, "block_scale", id="nv bs float32"
    ),
    pytest.param(lambda: _nv(block_scale=_BS[:3]), WeightFormatError, "3 rows", id="nv bs rows"),
    pytest.param(
        lambda: _nv(block_scale=_BS[:, :1]), WeightFormatError, "1 groups", id="nv bs groups"
    ),
    pytest.param(
        lambda: _nv(block_scale=_bs_with_byte(0x7F)), WeightFormatError, "NaN", id="nv bs NaN"
    ),
    pytest.param(
        lambda: _nv(block_scale=_bs_with_byte(0xFF)), WeightFormatError, "NaN", id="nv bs -NaN"
    ),
    pytest.param(
        lambda: _nv(block_scale=_bs_with_byte(0xB8)),
        WeightFormatError,
        "negative",
        id="nv bs negative",
    ),
    pytest.param(
        lambda: _nv(block_scale=_BS.to("meta")),
        WeightFormatError,
        "block_scale is on meta",
        id="nv bs device",
    ),
    pytest.param(
        lambda: _nv(global_scale=torch.tensor(math.nan)),
        WeightFormatError,
        "global_scale is nan",
        id="nv gs NaN",
    ),
    pytest.param(
        lambda: _nv(global_scale=torch.tensor(math.inf)),
        WeightFormatError,
        "global_scale is inf",
        id="nv gs inf",
    ),
    pytest.param(
        lambda: _nv(global_scale=torch.tensor(0.0)),
        WeightFormatError,
        "global_scale is 0.0",
        id="nv gs zero",
    ),
    pytest.param(
        lambda: _nv(global_scale=torch.tensor(-1.0)),
        WeightFormatError,
        "global_scale is -1.0",
        id="nv gs negative",
    ),
    pytest.param(
        lambda: _nv(global_scale=torch.tensor(0.5, dtype=F64)),
        WeightFormatError,
        "global_scale has dtype",
        id="nv gs float64",
    ),
    pytest.param(
        lambda: _nv(global_scale=torch.ones(2)),
        WeightFormatError,
        "global_scale has shape",
        id="nv gs shape",
    ),
    pytest.param(
        lambda: _nv(global_scale=0.5),
        WeightFormatError,
        "global_scale is a float",
        id="nv gs float",
    ),
    pytest.param(
        lambda: _nv(global_scale=_GS.to("meta")),
        WeightFormatError,
        "global_scale is on meta",
        id="nv gs device",
    ),
    pytest.param(
        lambda: _nv(input_scale=torch.tensor(math.nan)),
        WeightFormatError,
        "input_scale is nan",
        id="nv is NaN",
    ),
    # Mxfp4Weight
    pytest.param(
        lambda: _mx(block_scale=torch.full((4, 1), 255, dtype=torch.uint8)),
        WeightFormatError,
        "255",
        id="mx e8m0 255",
    ),
    pytest.param(
        lambda: _mx(packed=_P[:, :8]), WeightFormatError, "multiple of 32", id="mx K not /32"
    ),
    pytest.param(
        lambda: _mx(block_scale=torch.ones(4, 1)),
        WeightFormatError,
        "Mxfp4Weight.block_scale",
        id="mx bs float",
    ),
    pytest.param(
        lambda: _mx(block_scale=torch.ones(5, 1, dtype=torch.uint8)),
        WeightFormatError,
        "5 rows",
        id="mx bs rows",
    ),
    pytest.param(
        lambda: _mx(block_scale=torch.ones(4, 2, dtype=torch.uint8)),
        WeightFormatError,
        "2 groups",
        id="mx bs groups",
    ),
    # Fp8Weight
    pytest.param(
        lambda: _fp8(weight=torch.ones(4, 32, dtype=torch.float16)),
        WeightFormatError,
        "Fp8Weight.weight",
        id="fp8 weight fp16",
    ),
    pytest.param(
        lambda: _fp8(weight=torch.full((4, 32), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)),
        WeightFormatError,
        "NaN",
        id="fp8 weight NaN",
    ),
    pytest.param(
        lambda: _fp8(scale=torch.tensor(0.5, dtype=F64)),
        WeightFormatError,
        "Fp8Weight.scale",
        id="fp8 scale f64",
    ),
    pytest.param(
        lambda: _fp8(scale=torch.ones(3)), WeightFormatError, "shape (3,)", id="fp8 scale shape"
    ),
    pytest.param(
        lambda: _fp8(scale=torch.ones(2, 2)), WeightFormatError, "block_size", id="fp8 2-D no block"
    ),
    pytest.param(
        lambda: _fp8(scale=torch.ones(2, 2), block_size=(2, 32)),
        WeightFormatError,
        "needs (2, 1)",
        id="fp8 block shape",
    ),
    pytest.param(
        lambda: _fp8(scale=torch.ones(2, 2), block_size=(0, 16)),
        WeightFormatError,
        "block_size",
        id="fp8 bad block",
    ),
    pytest.param(
        lambda: _fp8(scale=torch.full((4,), math.inf)),
        WeightFormatError,
        "NaN/inf",
        id="fp8 scale inf",
    ),
    pytest.param(
        lambda: _fp8(scale=torch.full((4,), -1.0)),
        WeightFormatError,
        "negative",
        id="fp8 scale neg",
    ),
    pytest.param(
        lambda: _fp8(scale=torch.tensor(0.0)), WeightFormatError, "0.0", id="fp8 scale zero"
    ),
    pytest.param(
        lambda: _fp8(input_scale=torch.tensor(math.nan)),
        WeightFormatError,
        "input_scale is nan",
        id="fp8 input NaN",
    ),
    # functions
    pytest.param(
        lambda: pack_e2m1(torch.ones(2, 3, dtype=torch.uint8)),
        WeightFormatError,
        "odd",
        id="pack odd K",
    ),
    pytest.param(
        lambda: pack_e2m1(torch.full((2, 2), 16, dtype=torch.uint8)),
        WeightFormatError,
        "16",
        id="pack code 16",
    ),
    pytest.param(
        lambda: pack_e2m1(torch.ones(2, 2, dtype=torch.int64)),
        WeightFormatError,
        "codes has dtype",
        id="pack int64",
    ),
    pytest.param(
        lambda: encode_e2m1(torch.tensor([1.0, math.nan])),
        WeightFormatError,
        "NaN",
        id="encode NaN",
    ),
    pytest.param(
        lambda: encode_e2m1(torch.ones(2, dtype=torch.int32)),
        WeightFormatError,
        "int32",
        id="encode int",
    ),
    pytest.param(
        lambda: quantize_nvfp4(torch.randn(4, 24)), WeightFormatError, "pad K", id="q nvfp4 K=24"
    ),
    pytest.param(
        lambda: quantize_nvfp4(torch.full((4, 16), math.nan)),
        WeightFormatError,
        "NaN",
        id="q nvfp4 NaN",
    ),
    pytest.param(
        lambda: quantize_nvfp4(torch.randn(2, 4, 16)), WeightFormatError, "2-D", id="q nvfp4 3-D"
    ),
    pytest.param(
        lambda: quantize_nvfp4(torch.randn(4, 16), global_scale=-1.0),
        WeightFormatError,
        "global_scale is -1.0",
        id="q nvfp4 gs<0",
    ),
    pytest.param(
        lambda: quantize_mxfp4(torch.randn(4, 48)),
        WeightFormatError,
        "multiple of the group size 32",
        id="q mxfp4 K=48",
    ),
    pytest.param(
        lambda: quantize_fp8(torch.randn(4, 16), kind="row"),
        ConfigurationError,
        "kind='row'",
        id="q fp8 kind",
    ),
    pytest.param(
        lambda: quantize_fp8(torch.randn(4, 16), kind="block", block_size=(0, 1)),
        ConfigurationError,
        "block_size",
        id="q fp8 block",
    ),
    pytest.param(
        lambda: dequantize_nvfp4(_nv(), rows=[0, 1]), ConfigurationError, "rows", id="deq rows list"
    ),
    pytest.param(
        lambda: dequantize_fp8(_fp8(), rows=slice(None, None, -1)),
        ConfigurationError,
        "step",
        id="deq rows step",
    ),
    pytest.param(
        lambda: dequantize_mxfp4(_mx(), dtype=torch.int8),
        ConfigurationError,
        "dtype",
        id="deq dtype",
    ),
    pytest.param(
        lambda: dequantize_nvfp4(_mx()), ConfigurationError, "Mxfp4Weight", id="deq wrong type"
    ),
    pytest.param(
        lambda: fake_quantize_nvfp4_activations(torch.randn(2, 24), _GS),
        InputError,
        "K = 24",
        id="fakeq K=24",
    ),
    pytest.param(
        lambda: fake_quantize_nvfp4_activations(torch.full((2, 16), math.nan), _GS),
        InputError,
        "NaN",
        id="fakeq NaN",
    ),
    pytest.param(
        lambda: fake_quantize_nvfp4_activations(torch.randn(2, 16), 0.0),
        WeightFormatError,
        "input_scale is 0.0",
        id="fakeq scale 0",
    ),
    pytest.param(
        lambda: global_scale_from_compressed_tensors(torch.tensor([0.0])),
        WeightFormatError,
        "weight_global_scale is 0.0",
        id="ct zero",
    ),
    pytest.param(
        lambda: global_scale_from_compressed_tensors(torch.tensor([math.nan])),
        WeightFormatError,
        "weight_global_scale is nan",
        id="ct NaN",
    ),
    pytest.param(
        lambda: global_scale_from_compressed_tensors(torch.ones(2)),
        WeightFormatError,
        "shape (2,)",
        id="ct shape",
    ),
    pytest.param(
        lambda: global_scale_from_compressed_tensors(torch.tensor([1e-45])),
        WeightFormatError,
        "reciprocal",
        id="ct overflow",
    ),
    pytest.param(
        lambda: global_scale_to_compressed_tensors(math.inf),
        WeightFormatError,
        "global_scale is inf",
        id="to ct inf",
    ),
]


@pytest.mark.parametrize(("build", "exc", "fragment"), BAD_CASES)
def test_validation_errors(
    build: Callable[[], object], exc: type[Exception], fragment: str
) -> None:
    with pytest.raises(exc) as info:
        build()
    assert isinstance(info.value, QuantDispatchError)
    msg = str(info.value)
    assert fragment in msg, msg
    assert msg.count(". ") >= 2, f"message lacks what/rule/fix: {msg}"

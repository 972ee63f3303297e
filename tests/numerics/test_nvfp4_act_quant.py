"""NVFP4 activation quantization (plain torch) against the float64 rule in nvfp4_act_ref.py:
bit-equal codes and block scales for ties at every e2m1 midpoint, e4m3 ties, subnormal and
zero block scales, all-zero blocks, the largest values and saturation, both checkpoint
conventions, fp16 / bf16 / fp32, and shapes that are not multiples of 128 or 64. Also the
swizzled scale layout (round trip and an independent index formula) and the error messages."""

from __future__ import annotations

import math

import pytest
import torch
from nvfp4_act_ref import (
    E2M1_VALUES,
    ref_encode_scale,
    ref_quantize,
    ref_swizzle_offset,
    ref_unpack,
)

from quantdispatch.errors import ConfigurationError, InputError
from quantdispatch.formats.nvfp4_act import (
    activation_scale,
    dequantize_nvfp4_activations,
    gemm_alpha,
    quantize_nvfp4_activations,
    swizzle_block_scales,
    swizzled_scale_shape,
    unswizzle_block_scales,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rand_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Magnitudes over ~6 decades (block scales from subnormal to saturated), signs mixed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 2.0)
    if k > 16:
        x[0, 16:32] = 0.0  # an all-zero block
    if m > 1:
        x[1, :16] *= 1e-4  # a subnormal or zero block scale
    return x.to(dtype)


def check_bits(x: torch.Tensor, q, s_enc: float) -> tuple[torch.Tensor, torch.Tensor]:
    codes, sf_code, _ = ref_quantize(x, s_enc)
    m, k = x.shape
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (m, k // 2)
    assert torch.equal(ref_unpack(q.packed), codes)
    bs = unswizzle_block_scales(q.block_scale, m, k // 16) if q.swizzled else q.block_scale
    assert bs.dtype == torch.float8_e4m3fn and bs.shape == (m, k // 16)
    assert torch.equal(bs.view(torch.uint8).to(torch.int64), sf_code)
    return codes, sf_code


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), [(1, 16), (7, 48), (33, 80), (130, 208)])
@pytest.mark.parametrize("convention", ["modelopt", "compressed-tensors"])
def test_random_activations_bit_equal(dtype, m, k, convention):
    x = rand_x(m, k, dtype, seed=m * k)
    amax = float(x.float().abs().max())
    if convention == "modelopt":
        kw = {"input_scale": torch.tensor(amax / 2688.0 / 8.0)}  # calibrated 8x low: saturation
        s_enc = ref_encode_scale(input_scale=float(kw["input_scale"]))
    else:
        kw = {"input_global_scale": torch.tensor([2688.0 / amax])}
        s_enc = ref_encode_scale(input_global_scale=float(kw["input_global_scale"]))
    q = quantize_nvfp4_activations(x, **kw)
    assert float(q.scale.encode) == s_enc
    codes, sf_code = check_bits(x, q, s_enc)
    if k > 16:
        assert int(sf_code[0, 1]) == 0 and not codes[0, 16:32].any()  # all-zero block
    if convention == "modelopt" and m * k > 16:
        assert bool((sf_code == 126).any()) and bool(((codes & 7) == 7).any())  # saturated
    qs = quantize_nvfp4_activations(x, swizzle=True, **kw)
    assert qs.swizzled and torch.equal(qs.packed, q.packed)
    check_bits(x, qs, s_enc)


def test_ties_at_every_e2m1_midpoint_and_signed_zero():
    # S = 1 and block amax 6: sf = fl32(6 * fl32(1/6)) = 1, sf8 = 1, os = 1, so y = x exactly.
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5]
    row += [-5.0, -0.0]
    x = torch.tensor([row, [-v for v in row]], dtype=torch.bfloat16)
    q = quantize_nvfp4_activations(x, input_global_scale=1.0)
    codes, sf_code = check_bits(x, q, 1.0)
    assert sf_code.tolist() == [[56], [56]]  # e4m3 1.0 = 0b0_0111_000
    mags = E2M1_VALUES[codes[0, :8] & 7].tolist()
    assert mags == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # ties to the even code
    assert codes[0, 15] == 8 and codes[1, 15] == 0  # -0.0 keeps its sign bit, +0.0 does not
    # the same midpoints at another power-of-two scale (os = 2**-5 exactly)
    q2 = quantize_nvfp4_activations(x.float() * 32, input_global_scale=1.0)
    assert torch.equal(q2.packed, q.packed)


@pytest.mark.parametrize("sf", [1.0625, 1.1875, 2.5 * 2.0**-9, 1.5 * 2.0**-9, 2.0**-10])
def test_ties_of_the_block_scale(sf):
    """Block scales exactly between two e4m3 values (normal and subnormal) round to even."""
    x = torch.zeros(1, 16, dtype=torch.float32)
    x[0, 0] = sf * 6.0
    x[0, 1:] = torch.linspace(-sf * 5.9, sf * 5.9, 15)
    s_enc = 1.0
    _, _, sf8 = ref_quantize(x, s_enc)
    expected = {1.0625: 1.0, 1.1875: 1.25, 2.5 * 2.0**-9: 2.0**-8, 1.5 * 2.0**-9: 2.0**-8}
    assert float(sf8[0, 0]) == expected.get(sf, 0.0)
    q = quantize_nvfp4_activations(x, input_global_scale=s_enc)
    check_bits(x, q, s_enc)


def test_largest_values():
    """amax at 6 * 448 * input_scale: block scale exactly 448, codes +-6; beyond: saturation."""
    s = 0.01
    x = torch.full((2, 32), 0.5, dtype=torch.float32)
    x[0, 3] = 6 * 448 * s
    x[0, 20] = -6 * 448 * s
    x[1, :16] = 1e6  # far above the calibrated range
    x[1, 16:] = -torch.finfo(torch.float32).max / 4
    q = quantize_nvfp4_activations(x, input_scale=s)
    codes, sf_code = check_bits(x, q, ref_encode_scale(input_scale=s))
    assert sf_code.tolist() == [[126, 126], [126, 126]]
    assert codes[0, 3] == 7 and codes[0, 20] == 15
    assert bool((codes[1, :16] == 7).all()) and bool((codes[1, 16:] == 15).all())


def test_dequantize_and_alpha():
    x = rand_x(5, 64, torch.bfloat16, seed=3)
    q = quantize_nvfp4_activations(x, input_scale=0.002)
    un = dequantize_nvfp4_activations(q, scaled=False, dtype=torch.float64)
    codes, _, sf8 = ref_quantize(x, ref_encode_scale(input_scale=0.002))
    vals = torch.where(codes >= 8, -1.0, 1.0).double() * E2M1_VALUES[codes & 7]
    assert torch.equal(un, (vals.reshape(5, 4, 16) * sf8.unsqueeze(-1)).reshape(5, 64))
    scaled = dequantize_nvfp4_activations(q)
    assert torch.equal(scaled, (un.float() * torch.tensor(0.002)))
    alpha = gemm_alpha(q.scale.decode, torch.tensor(0.03))
    assert alpha.dtype == torch.float32 and float(alpha) == float(
        torch.tensor(0.002) * torch.tensor(0.03)
    )
    # compressed-tensors: decode = fl32(1 / input_global_scale)
    sc = activation_scale(input_global_scale=torch.tensor([500.0]))
    assert float(sc.encode) == 500.0 and float(sc.decode) == float(1 / torch.tensor(500.0))


@pytest.mark.parametrize(("rows", "groups"), [(1, 1), (5, 3), (128, 4), (130, 9), (300, 13)])
def test_swizzle_layout(rows, groups):
    g = torch.Generator().manual_seed(rows + groups)
    s = torch.randint(1, 127, (rows, groups), generator=g, dtype=torch.uint8)
    flat = swizzle_block_scales(s.view(torch.float8_e4m3fn))
    rp, gp = swizzled_scale_shape(rows, groups)
    assert rp == -(-rows // 128) * 128 and gp == -(-groups // 4) * 4
    assert flat.shape == (rp * gp,) and flat.is_contiguous() and flat.dtype == torch.float8_e4m3fn
    bits = flat.view(torch.uint8)
    expected = torch.zeros(rp * gp, dtype=torch.uint8)
    for r in range(rows):
        for c in range(groups):
            expected[ref_swizzle_offset(r, c, groups)] = s[r, c]
    assert torch.equal(bits, expected)  # placement and zero padding
    assert torch.equal(unswizzle_block_scales(flat, rows, groups).view(torch.uint8), s)
    assert torch.equal(swizzle_block_scales(s), bits)  # uint8 in, uint8 out


def _x():
    return torch.randn(4, 32, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: quantize_nvfp4_activations(torch.full((2, 16), math.nan), input_scale=1.0),
         InputError, "NaN/inf"),
        (lambda: quantize_nvfp4_activations(torch.full((2, 16), -math.inf), input_scale=1.0),
         InputError, "first -inf at"),
        (lambda: quantize_nvfp4_activations(_x(), input_scale=0.0), ConfigurationError,
         "input_scale is 0.0"),
        (lambda: quantize_nvfp4_activations(_x(), input_scale=-2.0), ConfigurationError,
         "input_scale is -2.0"),
        (lambda: quantize_nvfp4_activations(_x(), input_global_scale=torch.tensor(math.nan)),
         ConfigurationError, "input_global_scale is nan"),
        (lambda: quantize_nvfp4_activations(_x(), input_scale=1e-38), ConfigurationError,
         r"encode scale S"),
        (lambda: quantize_nvfp4_activations(_x()), ConfigurationError, "neither"),
        (lambda: quantize_nvfp4_activations(_x(), input_scale=1.0, input_global_scale=1.0),
         ConfigurationError, "both"),
        (lambda: quantize_nvfp4_activations(_x(), input_scale=torch.ones(2)), ConfigurationError,
         "shape"),
        (lambda: quantize_nvfp4_activations(_x().double(), input_scale=1.0), InputError,
         "dtype torch.float64"),
        (lambda: quantize_nvfp4_activations(_x().to(torch.int8), input_scale=1.0), InputError,
         "dtype torch.int8"),
        (lambda: quantize_nvfp4_activations(torch.randn(2, 24), input_scale=1.0), InputError,
         "K = 24"),
        (lambda: quantize_nvfp4_activations(torch.randn(2, 3, 16), input_scale=1.0), InputError,
         "2-D"),
        (lambda: unswizzle_block_scales(torch.zeros(10, dtype=torch.uint8), 5, 3),
         ConfigurationError, "512"),
        (lambda: swizzle_block_scales(torch.zeros(4, 4)), ConfigurationError, "one-byte"),
    ],
)  # fmt: skip
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_check_finite_off_skips_the_scan():
    x = _x()
    x[0, 0] = math.inf
    q = quantize_nvfp4_activations(x, input_scale=0.01, check_finite=False)
    assert q.packed.shape == (4, 16)  # no error, no sync; the codes are meaningless

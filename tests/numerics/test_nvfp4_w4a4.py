"""W4A4 NVFP4 on the CPU: the Triton activation quantizer (interpreter) bit-equal with the torch
one, the reference backend's W4A4 emulation against float64, and the contract of the
``torch._scaled_mm`` wrapper, with ``torch._scaled_mm`` replaced by a float64 emulation that
checks every operand it receives (dtypes, strides, scale layout by an independent index
formula) and computes the product."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest
import torch
from nvfp4_act_ref import ref_encode_scale, ref_swizzle_offset, ref_unpack, ref_w4a4
from ref64 import e2m1_from_bits, e4m3_from_bits, random_codes, random_e4m3_scales, rel_err

from quantdispatch.errors import InputError, WeightFormatError
from quantdispatch.formats import Nvfp4Weight
from quantdispatch.formats.nvfp4_act import activation_scale, quantize_nvfp4_activations_raw
from quantdispatch.kernels.native import scaled_mm_fp4 as smm

F64 = torch.float64


def special_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random magnitudes over ~6 decades plus a zero block, a tiny block, e2m1 midpoints and
    values far above the calibrated range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 2.0)
    x[0, :16] = 0.0
    x[1, :16] *= 1e-4
    x[2, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)
    x[2, 8:16] *= -1
    x[3, 16:32] = 3e4
    return x.to(dtype)


def same_bits(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("swizzle", [False, True])
def test_triton_quantizer_bit_equal_with_torch(dtype, swizzle):
    pytest.importorskip("triton")
    from quantdispatch.kernels.native.nvfp4_quant import quantize_nvfp4_activations_triton
    x = special_x(37, 80, dtype, seed=5)
    s = activation_scale(input_scale=torch.tensor(1.0 / 2688.0)).encode  # amax 1 calibrated
    ref = quantize_nvfp4_activations_raw(x, s, swizzle=swizzle)
    got = quantize_nvfp4_activations_triton(x, s, swizzle=swizzle)
    assert same_bits(ref, got)
    if swizzle:  # the padding of the swizzled buffer is zero
        n_pad = got[1].numel() - 37 * 5
        assert int((got[1].view(torch.uint8) == 0).sum()) >= n_pad


def test_triton_quantizer_masks_and_strides():
    """Small program tiles (both grid dimensions masked) and a row stride wider than K."""
    pytest.importorskip("triton")
    from quantdispatch.kernels.native.nvfp4_quant import quantize_nvfp4_activations_triton
    wide = special_x(9, 96, torch.bfloat16, seed=9)
    x = wide[:, :48]
    assert x.stride(0) == 96
    s = activation_scale(input_global_scale=torch.tensor([700.0])).encode
    for swizzle in (False, True):
        ref = quantize_nvfp4_activations_raw(x, s, swizzle=swizzle)
        got = quantize_nvfp4_activations_triton(x, s, swizzle=swizzle, blocks=(4, 2))
        assert same_bits(ref, got)
    empty = quantize_nvfp4_activations_triton(x[:0], s, swizzle=True)
    assert empty[0].shape == (0, 24) and empty[1].numel() == 0
    with pytest.raises(InputError, match="K = 24"):
        quantize_nvfp4_activations_triton(torch.randn(2, 24), s)


def _weight(n, k, seed, gs=0.0173, input_scale=0.004):
    g = torch.Generator().manual_seed(seed)
    return Nvfp4Weight(
        packed=random_codes(n, k, g),
        block_scale=random_e4m3_scales((n, k // 16), g),
        global_scale=torch.tensor(gs, dtype=torch.float32),
        input_scale=torch.tensor(input_scale, dtype=torch.float32),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_w4a4_emulation_matches_float64(dtype):
    from quantdispatch.api import load_settings
    from quantdispatch.layers import QuantLinear

    n, k = 48, 96
    w = _weight(n, k, seed=11)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    layer = QuantLinear(
        w,
        bias=bias,
        act_dtype=dtype,
        device="cpu",
        emulate_activations=True,
        settings=load_settings({}, backend={"nvfp4": "reference"}),
    )
    x = special_x(7, k, dtype, seed=3) * 0.01
    out = layer(x)
    s = float(w.input_scale)
    ref = ref_w4a4(
        x, ref_encode_scale(input_scale=s), s, ref_unpack(w.packed), w.block_scale, 0.0173, bias
    )
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    err = (out.to(F64) - ref).abs()
    assert bool((err <= half_ulp * ref.abs() + 1e-5 * ref.abs().max()).all())
    wo = QuantLinear(w, bias=bias, act_dtype=dtype, device="cpu")(x)  # weight-only differs
    assert rel_err(wo, ref) > 1e-2


def _gather_scales(flat: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    bits = flat.view(torch.uint8)
    idx = torch.tensor(
        [[ref_swizzle_offset(r, c, groups) for c in range(groups)] for r in range(rows)]
    )
    return e4m3_from_bits(bits[idx])


class FakeScaledMM:
    """Stands in for ``torch._scaled_mm``: checks the NVFP4 operand contract, returns float64
    maths rounded to the requested fp32."""

    def __init__(self):
        self.calls = 0

    def __call__(self, mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None,
                 out_dtype=None, use_fast_accum=False):  # fmt: skip
        self.calls += 1
        fp4 = torch.float4_e2m1fn_x2
        assert mat_a.dtype == fp4 and mat_b.dtype == fp4
        m, kh = mat_a.shape
        assert mat_b.shape[0] == kh
        n = mat_b.shape[1]
        assert mat_a.stride() == (kh, 1), "mat_a must be row-major [M, K/2]"
        assert mat_b.stride() == (1, kh), "mat_b must be column-major [K/2, N]"
        k = 2 * kh
        assert k % 32 == 0 and n % 16 == 0
        for sc, rows in ((scale_a, m), (scale_b, n)):
            assert sc.dtype == torch.float8_e4m3fn and sc.is_contiguous()
            assert sc.numel() == (-(-rows // 128) * 128) * (-(-(k // 16) // 4) * 4)
        assert bias is None and scale_result is None and not use_fast_accum
        assert out_dtype == torch.float32
        a = e2m1_from_bits(ref_unpack(mat_a.view(torch.uint8))).reshape(m, k // 16, 16)
        a = (a * _gather_scales(scale_a, m, k // 16).unsqueeze(-1)).reshape(m, k)
        b = e2m1_from_bits(ref_unpack(mat_b.t().view(torch.uint8))).reshape(n, k // 16, 16)
        b = (b * _gather_scales(scale_b, n, k // 16).unsqueeze(-1)).reshape(n, k)
        return (a @ b.T).to(torch.float32)


@pytest.mark.parametrize(
    ("quantizer", "convention", "m"),
    [("torch", "modelopt", 5), ("torch", "compressed-tensors", 130), ("triton", "modelopt", 4)],
)
def test_scaled_mm_wrapper_contract(monkeypatch, quantizer, convention, m):
    if quantizer == "triton":
        pytest.importorskip("triton")
    n, k = 144, 96
    w = _weight(n, k, seed=m, gs=0.021)
    if convention == "modelopt":
        kw, a_mult = {"input_scale": torch.tensor(0.003)}, float(torch.tensor(0.003))
        s_enc = ref_encode_scale(input_scale=0.003)
    else:
        g = torch.tensor([400.0])
        kw, a_mult, s_enc = {"input_global_scale": g}, float(1 / g), 400.0
    prepared = smm.prepare_nvfp4_scaled_mm(w.packed, w.block_scale, w.global_scale, **kw)
    fake = FakeScaledMM()
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    x = special_x(m, k, torch.bfloat16, seed=m + 1) * 0.05
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = smm.nvfp4_scaled_mm_linear(
        x, prepared, bias=bias, out_dtype=torch.float32, quantizer=quantizer
    )
    assert fake.calls == 1 and out.shape == (m, n) and out.dtype == torch.float32
    ref = ref_w4a4(x, s_enc, a_mult, ref_unpack(w.packed), w.block_scale, 0.021, bias)
    tol = 2.0**-21 * ref.abs() + 2.0**-22 * ref.abs().max()
    assert bool(((out.to(F64) - ref).abs() <= tol).all())
    out_bf16 = smm.nvfp4_scaled_mm_linear(x, prepared, bias=bias, quantizer=quantizer)
    assert out_bf16.dtype == torch.bfloat16 and torch.equal(out_bf16, out.to(torch.bfloat16))


def test_scaled_mm_wrapper_checks(monkeypatch):
    w = _weight(48, 96, seed=1)
    prepared = smm.prepare_nvfp4_scaled_mm(
        w.packed, w.block_scale, w.global_scale, input_scale=w.input_scale
    )
    monkeypatch.setattr(torch, "_scaled_mm", FakeScaledMM())
    with pytest.raises(InputError, match="K=64"):
        smm.nvfp4_scaled_mm_linear(torch.randn(2, 64, dtype=torch.bfloat16), prepared)
    with pytest.raises(InputError, match="bfloat16/float16"):
        smm.nvfp4_scaled_mm_linear(torch.randn(2, 96), prepared)
    with pytest.raises(InputError, match="bias must be"):
        smm.nvfp4_scaled_mm_linear(
            torch.randn(2, 96, dtype=torch.bfloat16), prepared, bias=torch.zeros(3)
        )
    with pytest.raises(InputError, match="quantizer"):
        smm.nvfp4_scaled_mm_linear(
            torch.randn(2, 96, dtype=torch.bfloat16), prepared, quantizer="cuda"
        )
    empty = smm.nvfp4_scaled_mm_linear(torch.empty(0, 96, dtype=torch.float16), prepared)
    assert empty.shape == (0, 48)
    w_odd = _weight(40, 96, seed=2)
    with pytest.raises(WeightFormatError, match="N=40"):
        smm.prepare_nvfp4_scaled_mm(w_odd.packed, w_odd.block_scale, w_odd.global_scale,
                                    input_scale=0.01)  # fmt: skip
    w_k = _weight(48, 48, seed=3)
    with pytest.raises(WeightFormatError, match="K=48"):
        smm.prepare_nvfp4_scaled_mm(w_k.packed, w_k.block_scale, w_k.global_scale,
                                    input_scale=0.01)  # fmt: skip


def test_fp4_scaled_mm_facts_and_reasons():
    f = smm.FP4_SCALED_MM
    assert f.min_torch == (2, 8) and f.min_cuda == (12, 8)
    assert (10, 0) in f.capabilities and (12, 0) in f.capabilities_unverified
    ok = {"torch_version": "2.9.1+cu128", "cuda_version": "12.8", "capability": (10, 0)}
    assert smm.fp4_scaled_mm_reasons(**ok, n=4096, k=4096) == []
    assert smm.fp4_scaled_mm_reasons(**{**ok, "capability": (12, 0)}) == []
    assert "2.7.1" in smm.fp4_scaled_mm_reasons(**{**ok, "torch_version": "2.7.1"})[0]
    assert "12.6" in smm.fp4_scaled_mm_reasons(**{**ok, "cuda_version": "12.6"})[0]
    assert "SM 9.0" in smm.fp4_scaled_mm_reasons(**{**ok, "capability": (9, 0)})[0]
    assert "K=48" in smm.fp4_scaled_mm_reasons(**ok, k=48)[0]
    assert smm.fp4_scaled_mm_reasons(torch_version="2.10.0a0", cuda_version="13.0",
                                     capability=(10, 3)) == []  # fmt: skip

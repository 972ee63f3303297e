"""The FP8 prefill linear on the CPU, ``torch._scaled_mm`` replaced by a float64 emulation that
checks what it is given (e4m3 operands row- / column-major, fp32 scales in the shapes and
strides torch's block-scaled and row-wise recipes accept, M padded for block recipes, bias dtype)
against a float64 computation of the same quantized operands from fp8_prefill_ref.py, and within
the proven componentwise bound of the float64 W4A16 result. Also the resident copy, the other-
layout path (unit rows), slabs, and the error messages."""

from __future__ import annotations

import pytest
import torch
from fp8_prefill_ref import decode64, encode64, fp4_weight, linear_bound64, unit_values64
from ref64 import e4m3_from_bits

from quantdispatch.errors import BackendUnavailableError, InputError, WeightFormatError
from quantdispatch.kernels.mma_layout.layout import repack, repack_mx
from quantdispatch.kernels.native import fp8_prefill as fp8p

F64 = torch.float64
E4M3 = torch.float8_e4m3fn


class ScaledMmEmulator:
    """torch._scaled_mm for one recipe, in float64; records every call."""

    def __init__(self, recipe: str):
        self.recipe = recipe
        self.calls: list[dict] = []

    def __call__(self, a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                 use_fast_accum=False, out=None):  # fmt: skip
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == E4M3 and b.dtype == E4M3 and b.shape[0] == k
        assert a.stride(1) == 1 and b.stride(0) == 1, "row-major x column-major"
        assert scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
        assert out_dtype in (torch.bfloat16, torch.float16, torch.float32)
        if bias is not None:
            assert out_dtype != torch.float32 and bias.dtype == out_dtype and bias.shape == (n,)
        kb = k // 128
        if self.recipe == "rowwise":
            assert scale_a.shape == (m, 1) and scale_a.is_contiguous()
            assert scale_b.shape == (1, n) and scale_b.stride(1) == 1
            sa = scale_a.to(F64).expand(m, k)
            sb = scale_b.to(F64).expand(k, n)
        else:
            assert m % 16 == 0, "block recipes get M padded"
            assert scale_a.shape == (m, kb) and scale_a.stride(0) == 1
            assert kb == 1 or scale_a.stride(1) == m, "1x128 scale_a is outer-dim-major"
            sa = scale_a.to(F64).repeat_interleave(128, 1)
            if self.recipe == "1x128":
                assert scale_b.shape == (kb, n) and scale_b.is_contiguous()
                sb = scale_b.to(F64).repeat_interleave(128, 0)
            else:
                nb = -(-n // 128)
                assert scale_b.shape == (kb, nb) and scale_b.t().is_contiguous()
                sb = scale_b.to(F64).repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :n]
        y = (e4m3_from_bits(a.view(torch.uint8)) * sa) @ (e4m3_from_bits(b.view(torch.uint8)) * sb)
        if bias is not None:
            y = y + bias.to(F64)
        self.calls.append({"m": m, "n": n, "bias": bias is not None, "out": out is not None})
        r = y.to(out_dtype)
        if out is not None:
            assert out.shape == (m, n) and out.dtype == out_dtype
            out.copy_(r)
            return out
        return r


@pytest.fixture
def hopper(monkeypatch):
    """CUDA 12.9+ as far as recipe checks go (this CPU torch has no CUDA)."""
    monkeypatch.setattr(fp8p, "_cuda_version", lambda: (13, 0))


def expected(x, packed, scale, gs, fmt, recipe, bias):
    """float64 y of the same quantized operands, built from the reference rule."""
    k = x.shape[1]
    br, bc = fp8p.weight_blocks(recipe, k)
    wc, ws = encode64(unit_values64(packed, scale, fmt), br, bc, None if gs is None else float(gs))
    abc = k if recipe == "rowwise" else 128
    xc, xs = encode64(x, 1, abc)
    y = decode64(xc, xs, 1, abc) @ decode64(wc, ws, br, bc).T
    w64 = unit_values64(packed, scale, fmt) * (1.0 if gs is None else float(gs))
    full_ws = ws.repeat_interleave(br, 0)[: w64.shape[0]].repeat_interleave(bc, 1)
    full_xs = xs.repeat_interleave(abc, 1)
    ref = x.to(F64) @ w64.T
    if bias is not None:
        y, ref = y + bias.to(F64), ref + bias.to(F64)
    return y, ref, linear_bound64(x.to(F64), w64, full_xs, full_ws, ref)


def activations(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("recipe", ["128x128", "1x128", "rowwise"])
def test_linear_emulated(monkeypatch, hopper, fmt, recipe):
    n, k, m = 272, 512, 37  # a partial 128-row block; M padded to 48 for block recipes
    packed, scale, gs = fp4_weight(n, k, fmt, seed=11)
    x = activations(m, k, torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    emu = ScaledMmEmulator(recipe)
    monkeypatch.setattr(torch, "_scaled_mm", emu)
    kw = dict(fmt=fmt, bias=bias, recipe=recipe, capability=(9, 0), impl="torch")
    y = fp8p.fp8_prefill_linear(x, packed, scale, gs, workspace_bytes=128 * k, **kw)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert len(emu.calls) == 3 and all(c["out"] and c["bias"] for c in emu.calls)  # 3 slabs
    want, ref, bound = expected(x, packed, scale, gs, fmt, recipe, bias)
    assert torch.equal(y, want.to(torch.bfloat16))
    assert bool(((y.to(F64) - ref).abs() <= bound).all())


def test_triton_impl_matches_torch(monkeypatch, hopper):
    pytest.importorskip("triton")
    n, k, m = 128, 512, 20
    packed, scale, gs = fp4_weight(n, k, "nvfp4", seed=5)
    x = activations(m, k, torch.float16, seed=1)
    monkeypatch.setattr(torch, "_scaled_mm", ScaledMmEmulator("128x128"))
    kw = dict(fmt="nvfp4", recipe="128x128", capability=(9, 0))
    y_t = fp8p.fp8_prefill_linear(x, packed, scale, gs, impl="triton", **kw)
    y_p = fp8p.fp8_prefill_linear(x, packed, scale, gs, impl="torch", **kw)
    assert y_t.dtype == torch.float16 and torch.equal(y_t, y_p)
    want, _, _ = expected(x, packed, scale, gs, "nvfp4", "128x128", None)
    assert torch.equal(y_t, want.to(torch.float16))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_resident_and_mma_layout_paths(monkeypatch, hopper, fmt):
    """A resident copy, and the same weight in the mma16x64 layout (per call and resident),
    give the checkpoint path's bits."""
    pytest.importorskip("triton")
    n, k, m = 256, 256, 16
    packed, scale, gs = fp4_weight(n, k, fmt, seed=9)
    if fmt == "nvfp4":
        scale[scale == 0] = 1  # zero blocks: the layout drops -0 codes (tested below)
        words, mma_scales = repack(packed, scale, torch.bfloat16)
        layout_gs = gs
    else:
        scale = torch.randint(118, 136, scale.shape, dtype=torch.uint8)  # the layout's span
        words, mma_scales, layout_gs = repack_mx(packed, scale, torch.bfloat16)
    x = activations(m, k, torch.bfloat16, seed=2)
    monkeypatch.setattr(torch, "_scaled_mm", ScaledMmEmulator("1x128"))
    kw = dict(fmt=fmt, recipe="1x128", capability=(9, 0))
    y = fp8p.fp8_prefill_linear(x, packed, scale, gs, impl="torch", **kw)
    res = fp8p.make_resident(packed, scale, gs, fmt=fmt, recipe="1x128", impl="torch")
    assert res.nbytes() == n * k + n * (k // 128) * 4
    assert res.scale.t().is_contiguous()
    assert torch.equal(y, fp8p.fp8_prefill_linear(x, packed, scale, gs, resident=res, **kw))
    y_mma = fp8p.fp8_prefill_linear_mma(x, words, mma_scales, layout_gs, workspace_bytes=128 * k,
                                        **kw)  # fmt: skip
    assert torch.equal(y_mma, y)
    res_mma = fp8p.make_resident_mma(words, mma_scales, layout_gs, recipe="1x128",
                                     act_dtype=torch.bfloat16)  # fmt: skip
    assert torch.equal(res_mma.q.view(torch.uint8), res.q.view(torch.uint8))
    assert torch.equal(res_mma.scale, res.scale)


def test_fallback_without_fused_bias(monkeypatch, hopper):
    """A build whose fused form fails (bias / out=) gets the fp32-output form and the bias in
    torch, rounded once; the failure is remembered."""
    n, k, m = 128, 512, 16
    packed, scale, gs = fp4_weight(n, k, "nvfp4", seed=4)
    x = activations(m, k, torch.bfloat16, seed=3)
    bias = torch.randn(n).to(torch.bfloat16)
    emu = ScaledMmEmulator("128x128")

    def picky(*a, **kw):
        if kw.get("bias") is not None:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore")
        return emu(*a, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", picky)
    monkeypatch.setattr(fp8p, "_FALLBACKS", {})
    kw = dict(fmt="nvfp4", recipe="128x128", capability=(9, 0), impl="torch", bias=bias)
    y = fp8p.fp8_prefill_linear(x, packed, scale, gs, **kw)
    want, _, _ = expected(x, packed, scale, gs, "nvfp4", "128x128", bias)
    assert torch.equal(y, want.to(torch.bfloat16))
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in next(iter(fp8p.gemm_notes().values()))
    fp8p.fp8_prefill_linear(x, packed, scale, gs, **kw)
    assert all(c["out"] is False for c in emu.calls)


def test_recipes_and_reasons(monkeypatch):
    monkeypatch.setattr(fp8p, "_cuda_version", lambda: (13, 0))
    assert fp8p.default_recipe(4096, (9, 0)) == "128x128"
    assert fp8p.default_recipe(14336, (9, 0)) == "128x128"
    assert fp8p.default_recipe(4224, (9, 0)) == "1x128"
    assert fp8p.default_recipe(4096, (8, 9)) == "rowwise"
    assert fp8p.default_recipe(4096, (10, 0)) == "rowwise"
    assert fp8p.prefill_reasons("nvfp4", 4096, 4096, torch.bfloat16, (9, 0), "128x128") == []
    r = fp8p.prefill_reasons("fp8", 100, 200, torch.float32, (8, 0), "1x128")
    assert len(r) == 5 and "SM 8.9+" in r[1] and "K % 128" in r[2]
    assert "K % 512" in fp8p.prefill_reasons("mxfp4", 16, 384, torch.float16, (9, 0),
                                             "128x128")[0]  # fmt: skip
    monkeypatch.setattr(fp8p, "_cuda_version", lambda: (12, 8))
    assert fp8p.default_recipe(4096, (9, 0)) == "rowwise"
    assert "CUDA 12.9" in fp8p.prefill_reasons("nvfp4", 16, 512, torch.bfloat16, (9, 0),
                                               "1x128")[0]  # fmt: skip


def test_errors(hopper):
    packed, scale, gs = fp4_weight(128, 256, "nvfp4", seed=1)
    x = activations(4, 256, torch.bfloat16)
    kw = dict(fmt="nvfp4", capability=(9, 0), impl="torch")
    with pytest.raises(InputError, match="2-D bfloat16/float16"):
        fp8p.fp8_prefill_linear(x.float(), packed, scale, gs, **kw)
    with pytest.raises(InputError, match="K=128, the weight has K=256"):
        fp8p.fp8_prefill_linear(x[:, :128], packed, scale, gs, **kw)
    with pytest.raises(InputError, match="bias must be"):
        fp8p.fp8_prefill_linear(x, packed, scale, gs, bias=torch.zeros(3), **kw)
    with pytest.raises(InputError, match="CUDA only"):
        fp8p.fp8_prefill_linear(x, packed, scale, gs, fmt="nvfp4")
    with pytest.raises(BackendUnavailableError, match=r"SM 8\.9"):
        fp8p.fp8_prefill_linear(x, packed, scale, gs, fmt="nvfp4", capability=(8, 0))
    with pytest.raises(BackendUnavailableError, match="unknown recipe"):
        fp8p.fp8_prefill_linear(x, packed, scale, gs, recipe="2x2", **kw)
    with pytest.raises(BackendUnavailableError, match="K % 512"):
        fp8p.fp8_prefill_linear(x[:, :128], packed[:, :64], scale[:, :8], gs, recipe="128x128",
                                **{**kw, "capability": (9, 0)})  # fmt: skip
    res = fp8p.make_resident(packed[:64], scale[:64], gs, fmt="nvfp4", recipe="1x128", impl="torch")
    with pytest.raises(InputError, match="resident copy"):
        fp8p.fp8_prefill_linear(x, packed, scale, gs, resident=res, **kw)
    mx_packed = torch.zeros(16, 128, dtype=torch.uint8)
    with pytest.raises(WeightFormatError, match="FP8 prefill re-encodes MXFP4"):
        fp8p.make_resident(mx_packed, torch.full((16, 8), 250, dtype=torch.uint8), None,
                           fmt="mxfp4", recipe="rowwise")  # fmt: skip
    assert fp8p.fp8_prefill_linear(x[:0], packed, scale, gs, **kw).shape == (0, 128)

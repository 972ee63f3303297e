"""The native NVFP4 backends end to end on the CPU through fake providers (fp4_fake.py):
QuantLinear on the torch backend (``torch._scaled_mm`` faked) and on the cutlass backend
(sgl-kernel 0.3.21's module faked, or vLLM 0.33.0's op registered), against the float64 W4A4
contract and the reference backend's W4A4 emulation; provider versions outside a binding are
refused with the version; the self-check catches a provider that misreads alpha or the scales.
The CPU is let through the backends' GPU rule for these tests only."""

from __future__ import annotations

import sys

import pytest
import torch
from fp4_fake import VLLM_CALLS, FakeScaledMM, FakeSglKernel, fake_vllm_gemm
from nvfp4_act_ref import ref_encode_scale, ref_unpack, ref_w4a4
from ref64 import random_codes, random_e4m3_scales, rel_err

from quantdispatch import selfcheck
from quantdispatch.api import load_settings, select
from quantdispatch.backends import fp4_providers, marlin_providers
from quantdispatch.backends.cutlass import CutlassFacts
from quantdispatch.backends.torch_scaled_mm import TorchScaledMMFacts
from quantdispatch.device import preset_profile
from quantdispatch.errors import BackendUnavailableError
from quantdispatch.formats import Nvfp4Weight
from quantdispatch.layers import QuantLinear
from quantdispatch.resolver import _resolve

NO_ENV = load_settings({})
REFERENCE_W4A4 = load_settings({}, backend={"nvfp4": "reference"})
pytestmark = pytest.mark.filterwarnings("ignore::quantdispatch.selfcheck.SelfCheckWarning")


def _w4a4(n, k, seed, gs=0.0173, input_scale=0.004):
    g = torch.Generator().manual_seed(seed)
    return Nvfp4Weight(
        random_codes(n, k, g),
        random_e4m3_scales((n, k // 16), g),
        torch.tensor(gs, dtype=torch.float32),
        input_scale=torch.tensor(input_scale, dtype=torch.float32),
    )


def _x(m, k, dtype, seed):
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 0.3).to(dtype)


def _contract(w, x, bias=None):
    s = ref_encode_scale(input_scale=float(w.input_scale))
    return ref_w4a4(
        x, s, float(w.input_scale), ref_unpack(w.packed), w.block_scale, float(w.global_scale), bias
    )


@pytest.fixture
def clean(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fp4_providers.reset()
    marlin_providers.reset()
    selfcheck.reset()
    _resolve.cache_clear()
    yield
    fp4_providers.reset()
    marlin_providers.reset()
    selfcheck.reset()
    _resolve.cache_clear()


@pytest.fixture
def sgl(monkeypatch, clean):
    """sgl-kernel 0.3.21 'installed' (metadata and module), the CPU let through."""
    fake = FakeSglKernel()
    monkeypatch.setitem(sys.modules, "sgl_kernel", fake)
    versions = {"sgl-kernel": "0.3.21"}
    monkeypatch.setattr(fp4_providers, "_dist_version", versions.get)
    monkeypatch.setattr(marlin_providers, "_dist_version", lambda dist: None)
    monkeypatch.setattr(CutlassFacts, "device_reasons", lambda self, r, p: [])
    return fake


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 128), (5, 64, 256), (130, 160, 96)])
def test_cutlass_on_sgl_kernel_matches_the_w4a4_contract(sgl, act, m, n, k):
    w = _w4a4(n, k, seed=m + n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    layer = QuantLinear(w, bias=bias, act_dtype=act, device="cpu", settings=NO_ENV)
    assert layer.backend == "cutlass", layer.decision.explain()
    b200 = select("nvfp4", device="b200", settings=NO_ENV).reason
    assert "sgl-kernel 0.3.21 sgl_kernel.cutlass_scaled_fp4_mm, activations by its quant" in b200
    x = _x(m, k, act, seed=m)
    out = layer(x)
    assert out.dtype == act and out.shape == (m, n)
    (call,) = sgl.gemm_calls
    alpha = torch.tensor(float(w.input_scale), dtype=torch.float32) * w.global_scale
    assert call == {"m": m, "n": n, "k": k, "alpha": float(alpha), "out": act}
    assert sgl.quant_calls[0]["s"] == ref_encode_scale(input_scale=float(w.input_scale))
    bound = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[act]  # two roundings (GEMM, bias)
    assert rel_err(out, _contract(w, x, bias)) < bound
    ref = QuantLinear(
        w, bias=bias, act_dtype=act, device="cpu", settings=REFERENCE_W4A4, emulate_activations=True
    )
    assert rel_err(out, ref(x).double()) < bound


def test_cutlass_on_vllm_op_matches_the_w4a4_contract(monkeypatch, clean):
    monkeypatch.setattr(fp4_providers, "_dist_version", lambda dist: None)
    monkeypatch.setattr(marlin_providers, "_dist_version", lambda dist: None)
    monkeypatch.setattr(CutlassFacts, "device_reasons", lambda self, r, p: [])
    marlin_providers.register("vllm", "0.33.0")
    w = _w4a4(64, 128, seed=1)
    x = _x(7, 128, torch.bfloat16, seed=2)
    with fake_vllm_gemm():
        layer = QuantLinear(w, device="cpu", settings=NO_ENV)
        b200 = select("nvfp4", device="b200", settings=NO_ENV).reason
        assert "vllm 0.33.0 torch.ops._C.cutlass_scaled_fp4_mm" in b200
        assert "quantdispatch's quantizer" in b200
        out = layer(x)
    assert VLLM_CALLS and VLLM_CALLS[0]["m"] == 7 and VLLM_CALLS[0]["out"] == torch.bfloat16
    assert rel_err(out, _contract(w, x)) < 2**-8


def test_vllm_op_with_another_schema_is_refused(monkeypatch, clean):
    monkeypatch.setattr(fp4_providers, "_dist_version", lambda dist: None)
    monkeypatch.setattr(marlin_providers, "_dist_version", lambda dist: None)
    monkeypatch.setattr(CutlassFacts, "device_reasons", lambda self, r, p: [])
    marlin_providers.register("vllm", "0.33.0")
    args = "Tensor a, Tensor b, Tensor a_sf, Tensor b_sf, Tensor alpha"
    other = f"cutlass_scaled_fp4_mm({args}) -> Tensor"
    with fake_vllm_gemm(other), pytest.raises(BackendUnavailableError, match=r"takes \(a, b, a_sf"):
        QuantLinear(_w4a4(64, 128, seed=1), device="cpu", settings=NO_ENV)


@pytest.mark.parametrize(
    ("provider", "version", "expect"),
    [
        ("sgl-kernel", "0.3.16", "sgl-kernel: version 0.3.16 is outside the range the NVFP4 "
         "binding was written for (sgl-kernel >=0.3.21,<0.4.0)"),
        ("vllm", "0.32.0", "vllm: version 0.32.0 is outside the range the NVFP4 binding was "
         "written for (vllm >=0.33.0,<0.34.0)"),
    ],
)  # fmt: skip
def test_provider_outside_its_range_is_refused_with_its_version(
    monkeypatch, clean, provider, version, expect
):
    monkeypatch.setattr(fp4_providers, "_dist_version", {"sgl-kernel": version}.get)
    monkeypatch.setattr(marlin_providers, "_dist_version", lambda dist: None)
    if provider == "vllm":
        monkeypatch.setattr(fp4_providers, "_dist_version", lambda dist: None)
        marlin_providers.register("vllm", version)
    d = select("nvfp4", device="b200", settings=NO_ENV)
    line = next(c for c in d.trace if c.backend == "cutlass")
    assert not line.accepted and expect in line.reason
    assert d.backend == "torch"


def test_self_check_rejects_a_provider_that_ignores_alpha(sgl, monkeypatch):
    monkeypatch.setattr(selfcheck, "ELIGIBLE_DEVICE_TYPES", ("cuda", "cpu"))
    sgl.alpha_ignored = True
    monkeypatch.setattr(TorchScaledMMFacts, "device_reasons", lambda self, r, p: [])
    monkeypatch.setattr(torch, "_scaled_mm", FakeScaledMM())
    layer = QuantLinear(_w4a4(64, 128, seed=3), device="cpu", settings=NO_ENV)
    line = next(c for c in layer.decision.trace if c.backend == "cutlass")
    assert (
        "failed its self-check here" in line.reason
        and "emulated quantized activations" in line.reason
    )
    assert "upgrade / reinstall sgl-kernel (found sgl-kernel 0.3.21)" in line.reason
    assert layer.backend == "torch"  # the next candidate, which passed its own check


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 33, 129])
def test_torch_backend_matches_the_w4a4_contract(monkeypatch, clean, act, m):
    monkeypatch.setattr(TorchScaledMMFacts, "device_reasons", lambda self, r, p: [])
    fake = FakeScaledMM()
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    n, k = 144, 96
    w = _w4a4(n, k, seed=m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m))
    layer = QuantLinear(w, bias=bias, act_dtype=act, device="cpu", settings=NO_ENV)
    assert layer.backend == "torch", layer.decision.explain()
    x = _x(m, k, act, seed=m + 1)
    out = layer(x)
    assert fake.calls == 1 and out.dtype == act
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[act]
    ref = _contract(w, x, bias)
    assert bool(((out.double() - ref).abs() <= half_ulp * ref.abs() + 1e-6).all())
    emulated = QuantLinear(
        w, bias=bias, act_dtype=act, device="cpu", settings=REFERENCE_W4A4, emulate_activations=True
    )
    assert rel_err(out, emulated(x).double()) < 2 * half_ulp


def _unverified_profile():
    return preset_profile("rtx5090").model_copy(update={"simulated": False, "preset": None})


def test_torch_on_an_unverified_sm_runs_only_behind_the_self_check(monkeypatch, clean):
    monkeypatch.setattr(selfcheck, "ELIGIBLE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "_scaled_mm", FakeScaledMM())
    no_triton = load_settings({"QUANTDISPATCH_DISABLE": "triton"})
    profile = _unverified_profile()
    d = select("nvfp4", device=profile, settings=no_triton, check_on="cpu")
    assert d.backend == "torch" and "accepted only behind the first-use self-check" in d.reason
    assert selfcheck.selfcheck_status("torch", profile).startswith("self-check passed on this GPU")
    off = load_settings({"QUANTDISPATCH_DISABLE": "triton", "QUANTDISPATCH_SELF_CHECK": "off"})
    selfcheck.reset()
    d = select("nvfp4", device=profile, settings=off, check_on="cpu")
    line = next(c for c in d.trace if c.backend == "torch")
    assert d.backend == "reference" and "QUANTDISPATCH_SELF_CHECK=off turns off" in line.reason


def test_torch_self_check_catches_misread_weight_scales(monkeypatch, clean):
    monkeypatch.setattr(selfcheck, "ELIGIBLE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "_scaled_mm", FakeScaledMM(scale_b_misread=True))
    no_triton = load_settings({"QUANTDISPATCH_DISABLE": "triton"})
    d = select("nvfp4", device=_unverified_profile(), settings=no_triton, check_on="cpu")
    line = next(c for c in d.trace if c.backend == "torch")
    assert d.backend == "reference"
    assert "failed its self-check here: rel. error M=1:" in line.reason
    assert "upgrade / reinstall torch (found torch" in line.reason


def test_self_check_off_refuses_every_unverified_native_backend_in_turn(sgl, monkeypatch):
    """GB10 (12.1): cutlass and torch are both unverified; with the check off both are refused
    (each with its reason) and the weight-only kernel runs."""
    pytest.importorskip("triton")
    off = load_settings({"QUANTDISPATCH_SELF_CHECK": "off"})
    profile = preset_profile("gb10").model_copy(update={"simulated": False, "preset": None})
    d = select("nvfp4", device=profile, settings=off, check_on="cuda")
    lines = {c.backend: c for c in d.trace}
    assert d.backend == "triton", d.explain()
    for native in ("cutlass", "torch"):
        assert "QUANTDISPATCH_SELF_CHECK=off turns off" in lines[native].reason

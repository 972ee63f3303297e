"""Which GPUs take the native NVFP4 path (W4A4) and why, per preset, with and without a CUTLASS
provider installed (sgl-kernel's metadata faked: decisions read no module)."""

from __future__ import annotations

import pytest

from quantdispatch.api import load_settings, select
from quantdispatch.backends import fp4_providers, marlin_providers
from quantdispatch.capability import (
    CUTLASS_NVFP4,
    CUTLASS_NVFP4_UNVERIFIED,
    FP4_MMA,
    TORCH_NVFP4_MIN_CUDA,
    TORCH_NVFP4_MIN_TORCH,
    TORCH_NVFP4_UNVERIFIED,
    TORCH_NVFP4_VERIFIED,
)
from quantdispatch.kernels.native.scaled_mm_fp4 import FP4_SCALED_MM
from quantdispatch.resolver import _resolve

NO_ENV = load_settings({})
BEHIND = "accepted only behind the first-use self-check"


@pytest.fixture
def providers(monkeypatch):
    """Set which NVFP4 providers are 'installed' (package metadata only)."""

    def install(**versions):
        monkeypatch.setattr(fp4_providers, "_dist_version", versions.get)
        monkeypatch.setattr(marlin_providers, "_dist_version", lambda dist: None)
        fp4_providers.reset()
        marlin_providers.reset()
        _resolve.cache_clear()

    yield install
    fp4_providers.reset()
    marlin_providers.reset()
    _resolve.cache_clear()


def _lines(d):
    return {c.backend: c for c in d.trace}


# preset -> (backend without a provider, with sgl-kernel 0.3.21, behind the self-check: which)
W4A4 = {
    "b200": ("torch", "cutlass", ()),
    "b300": ("torch", "cutlass", ("cutlass",)),
    "gb10": ("torch", "cutlass", ("torch", "cutlass")),
    "rtx5090": ("torch", "cutlass", ("torch",)),
    "h100": ("triton", "triton", ()),
    "a100": ("triton", "triton", ()),
    "l40s": ("triton", "triton", ()),
}


@pytest.mark.parametrize("preset", list(W4A4))
def test_w4a4_linear_takes_the_native_path_on_fp4_gpus(providers, preset):
    pytest.importorskip("triton")
    plain, with_sgl, behind = W4A4[preset]
    providers()
    d = select("nvfp4", device=preset, n=4096, k=4096, settings=NO_ENV)
    lines = _lines(d)
    assert d.backend == plain, d.explain()
    assert lines["triton"].accepted
    if plain == "torch":
        assert lines["triton"].reason.startswith("can run, ranked below torch")
        assert "no usable NVFP4 GEMM provider" in lines["cutlass"].reason
        assert ("torch" in behind) == (BEHIND in d.reason)
    else:
        for native in ("cutlass", "torch"):
            assert "has no FP4 tensor cores" in lines[native].reason
    providers(**{"sgl-kernel": "0.3.21"})
    d = select("nvfp4", device=preset, n=4096, k=4096, settings=NO_ENV)
    assert d.backend == with_sgl, d.explain()
    if with_sgl == "cutlass":
        lines = _lines(d)
        assert "sgl-kernel 0.3.21 sgl_kernel.cutlass_scaled_fp4_mm" in d.reason
        assert lines["torch"].reason.startswith("can run, ranked below cutlass")
        assert lines["triton"].reason.startswith("can run, ranked below cutlass")
        assert ("cutlass" in behind) == (BEHIND in d.reason)


@pytest.mark.parametrize("preset", list(W4A4))
def test_w4a16_keeps_the_weight_only_kernels(providers, preset):
    pytest.importorskip("triton")
    providers(**{"sgl-kernel": "0.3.21"})
    d = select("nvfp4", scheme="weight_only", device=preset, settings=NO_ENV)
    assert d.backend == "triton", d.explain()
    lines = _lines(d)
    for native in ("cutlass", "torch"):
        assert "this checkpoint is weight-only (W4A16)" in lines[native].reason
        if preset in ("b200", "rtx5090"):
            assert "serves W4A4 checkpoints only" in lines[native].reason


@pytest.mark.parametrize("preset", ["b200", "rtx5090", "h100"])
def test_nvfp4_moe_stays_on_triton_and_says_why(providers, preset):
    pytest.importorskip("triton")
    providers(**{"sgl-kernel": "0.3.21"})
    d = select("nvfp4", "moe", device=preset, settings=NO_ENV)
    assert d.backend == "triton"
    reason = _lines(d)["cutlass"].reason
    assert "no fused NVFP4 MoE kernel is bound" in reason and "runs on the triton backend" in reason


def test_thor_and_unbuilt_sms(providers):
    providers(**{"sgl-kernel": "0.3.21"})
    d = select("nvfp4", device="thor", settings=NO_ENV)
    lines = _lines(d)
    assert "carry no NVFP4 GEMM for it" in lines["cutlass"].reason
    assert d.backend == "torch" and BEHIND in d.reason


def test_shapes_off_the_native_rules_fall_back(providers):
    pytest.importorskip("triton")
    providers(**{"sgl-kernel": "0.3.21"})
    d = select("nvfp4", device="b200", n=4096, k=4112, settings=NO_ENV)  # K % 32 = 16
    lines = _lines(d)
    assert "K=4112 is not a multiple of 32" in lines["cutlass"].reason
    assert "K=4112 is not a multiple of 32" in lines["torch"].reason
    assert d.backend == "triton"
    d = select("nvfp4", device="b200", n=4112, k=4096, settings=NO_ENV)  # N % 32 = 16
    assert d.backend == "torch"  # torch needs N % 16 only


def test_capability_facts_agree_with_the_torch_facts_table():
    assert set(FP4_SCALED_MM.capabilities) == set(TORCH_NVFP4_VERIFIED.members)
    assert set(FP4_SCALED_MM.capabilities_unverified) <= set(TORCH_NVFP4_UNVERIFIED.members)
    assert TORCH_NVFP4_VERIFIED.members | TORCH_NVFP4_UNVERIFIED.members == FP4_MMA.members
    assert FP4_SCALED_MM.min_torch == TORCH_NVFP4_MIN_TORCH
    assert FP4_SCALED_MM.min_cuda == TORCH_NVFP4_MIN_CUDA
    assert CUTLASS_NVFP4.members | CUTLASS_NVFP4_UNVERIFIED.members <= FP4_MMA.members

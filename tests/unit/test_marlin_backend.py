"""The Marlin backend's facts: provider detection, the version table, shape padding, the trace.

Providers are faked: package metadata and library files by monkeypatching the two lookups
marlin_providers makes, ops by registering vLLM 0.33.0's schemas (tests/marlin_fake.py).
"""

from __future__ import annotations

import pytest
import torch
from marlin_fake import OLD_GEMM_SCHEMA, fake_ops

from quantdispatch import select
from quantdispatch.api import load_settings
from quantdispatch.backends import marlin_providers as mp
from quantdispatch.backends.marlin_contract import (
    FLOAT4_E2M1F_ID,
    fits_tiles,
    moe_padded_intermediate,
    padded_shape,
    scalar_type_id,
)
from quantdispatch.errors import BackendUnavailableError, ConfigurationError
from quantdispatch.resolver import _resolve

NO_ENV = load_settings({})


@pytest.fixture(autouse=True)
def _clean_providers(monkeypatch):
    """No real provider leaks in, nothing leaks out (detections and decisions are cached)."""
    monkeypatch.setattr(mp, "_dist_version", lambda dist: None)
    mp.reset()
    _resolve.cache_clear()
    yield
    mp.reset()
    _resolve.cache_clear()


def _installed(monkeypatch, tmp_path, versions, files=("_C_stable_libtorch.abi3.so",)):
    """Fake package metadata (dist -> version) and a package dir holding ``files``."""
    for f in files:
        (tmp_path / f).write_bytes(b"not a library")
    monkeypatch.setattr(mp, "_dist_version", lambda dist: versions.get(dist))
    monkeypatch.setattr(mp, "_package_dir", lambda module: tmp_path)
    mp.reset()


def _status(name):
    return next(s for s in mp.statuses() if s.name == name)


# -- the version table ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "key"),
    [
        ("0.33.0", "vllm-0.30"),
        ("0.30.0", "vllm-0.30"),
        ("0.33.1+cu130", "vllm-0.30"),
        ("0.29.0", "vllm-0.22"),
        ("0.22.0", "vllm-0.22"),
        ("0.25.1", "vllm-0.22"),
    ],
)
def test_supported_vllm_versions_map_to_their_contract(monkeypatch, tmp_path, version, key):
    _installed(monkeypatch, tmp_path, {"vllm": version})
    s = _status("vllm")
    assert s.usable and s.contract.key == key and s.version == version
    assert s.pending == (str(tmp_path / "_C_stable_libtorch.abi3.so"),)
    assert mp.active() is s


@pytest.mark.parametrize(
    ("version", "words"),
    [
        ("0.34.0", "outside the contract table"),
        ("1.0.0", "outside the contract table"),
        ("0.21.0", "older than the table"),
        ("0.9.2", "gptq_marlin_gemm"),
        ("nightly", "cannot be read"),
    ],
)
def test_unsupported_vllm_versions_are_rejected_with_their_version(
    monkeypatch, tmp_path, version, words
):
    _installed(monkeypatch, tmp_path, {"vllm": version})
    s = _status("vllm")
    assert not s.usable and words in s.reason and version in s.reason
    d = select("nvfp4", device="h100", settings=NO_ENV)
    marlin = next(c for c in d.trace if c.backend == "marlin")
    assert not marlin.accepted and version in marlin.reason


def test_sgl_kernel_is_detected_but_refused_with_the_reason(monkeypatch, tmp_path):
    _installed(monkeypatch, tmp_path, {"sgl-kernel": "0.3.21"})
    s = _status("sgl-kernel")
    assert s.installed and not s.usable
    assert "0.3.21" in s.reason and "sglang #19652" in s.reason
    assert mp.active() is None


def test_missing_provider_says_how_to_get_one():
    s = _status("vllm")
    assert not s.installed and "load_library" in s.reason
    d = select("nvfp4", device="h100", settings=NO_ENV)
    reason = next(c for c in d.trace if c.backend == "marlin").reason
    assert "no usable Marlin provider" in reason and "vllm: not installed" in reason


def test_package_without_its_library_is_not_usable(monkeypatch, tmp_path):
    _installed(monkeypatch, tmp_path, {"vllm": "0.33.0"}, files=())
    s = _status("vllm")
    assert not s.usable and "_C_stable_libtorch.abi3.so" in s.reason


def test_library_that_fails_to_load_says_why(monkeypatch, tmp_path):
    _installed(monkeypatch, tmp_path, {"vllm": "0.33.0"})
    s = _status("vllm")
    assert s.usable  # detection never loads anything
    with pytest.raises(
        BackendUnavailableError, match=r"loading .*_C_stable_libtorch\.abi3\.so failed"
    ):
        mp.ensure_loaded(s)


def test_load_library_registers_version_and_ops(monkeypatch, tmp_path):
    lib = tmp_path / "_C_stable_libtorch.abi3.so"
    lib.write_bytes(b"fake")
    with fake_ops() as _:
        loaded = []
        monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(path))
        s = mp.load_library(lib, provider="vllm", version="0.33.0")
        assert loaded == [str(lib)]
        assert s.usable and s.source == "load_library" and s.contract.key == "vllm-0.30"
        assert s.offers("gemm") and s.offers("moe")
        mp.ensure_loaded(s, ("gemm", "repack", "moe"))
        d = select("nvfp4", device="h100", settings=NO_ENV)
        marlin = next(c for c in d.trace if c.backend == "marlin")
        assert marlin.accepted and "vllm 0.33.0 _C::marlin_gemm" in marlin.reason
        assert "GPU-verified with vLLM 0.33.0 on an H200" in marlin.reason


def test_registered_version_with_another_schema_is_rejected():
    with fake_ops(gemm_schema=OLD_GEMM_SCHEMA):
        mp.register("vllm", "0.33.0")
        s = _status("vllm")
        assert not s.usable and "g_idx_or_none" in s.reason


def test_registration_without_ops_is_rejected():
    mp.register("vllm", "0.33.0")
    s = _status("vllm")
    assert not s.usable and "not registered" in s.reason


def test_register_validates_its_arguments():
    with pytest.raises(ConfigurationError, match="unknown Marlin provider 'vlm'"):
        mp.register("vlm", "0.33.0")
    with pytest.raises(ConfigurationError, match="'latest'"):
        mp.register("vllm", "latest")


def test_scalar_type_ids_match_the_ids_in_vllm_0_33_kernel_names():
    # Template arguments of the Marlin kernels in vLLM 0.33.0's _C_stable_libtorch.abi3.so.
    assert FLOAT4_E2M1F_ID == 562949953487106
    assert scalar_type_id(5, 10, True, 0, False, 1) == 1125899906910725  # float16
    assert scalar_type_id(8, 7, True, 0, False, 1) == 1125899906909960  # bfloat16
    assert scalar_type_id(4, 3, True, 0, True, 2) == 2814749767172868  # float8_e4m3fn
    assert scalar_type_id(8, 0, False, 0, True, 2) == 2814749767106568  # float8_e8m0fnu


# -- shapes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "k", "group", "padded"),
    [
        (4096, 4096, 16, (4096, 4096)),
        (6144, 4096, 16, (6144, 4096)),
        (4096, 14336, 16, (4096, 14336)),
        (1792, 4096, 16, (1792, 4096)),  # 14336 / 8
        (4096, 1792, 16, (4096, 1792)),
        (720, 2880, 32, (768, 2880)),  # gpt-oss 2880 / 4: N 720 -> 768 (128 x 64 tiles)
        (2880, 720, 32, (2880, 768)),
        (4128, 4128, 16, (4160, 4224)),
        (100, 96, 16, (128, 128)),
    ],
)
def test_padding_reaches_a_tile_family_with_the_least_area(n, k, group, padded):
    got = padded_shape(n, k, group)
    assert got == padded and fits_tiles(*got) and got[1] % group == 0
    assert got[0] >= n and got[1] >= k


def test_moe_intermediate_padding():
    assert moe_padded_intermediate(768, 2048) == 768  # Qwen3-30B-A3B
    assert moe_padded_intermediate(720, 2880) == 768  # gpt-oss TP4: H % 128 != 0 -> I % 128
    assert moe_padded_intermediate(96, 256) == 128
    assert moe_padded_intermediate(64, 2000) is None


def test_trace_reports_padding_and_shape_rules():
    with fake_ops():
        mp.register("vllm", "0.33.0")
        d = select("mxfp4", n=720, k=2880, device="h100", settings=NO_ENV)
        note = next(c for c in d.trace if c.backend == "marlin").reason
        assert "pads N 720->768" in note and "K 2880" not in note
        d = select("nvfp4", n=64, k=40, device="a100", settings=NO_ENV)
        reason = next(c for c in d.trace if c.backend == "marlin").reason
        assert "K=40 is not a multiple of the nvfp4 group size 16" in reason
        forced = load_settings({}, backend={"nvfp4": "marlin"})  # not in the default MoE list
        d = select("nvfp4", "moe", n=720, k=2880, experts=32, device="h100", settings=forced)
        assert "pads I 720->768" in d.reason


# -- device, dtype and op facts ------------------------------------------------------------------


def test_mxfp4_fp16_has_no_marlin_kernel_even_with_a_provider():
    with fake_ops():
        mp.register("vllm", "0.33.0")
        d = select("mxfp4", act_dtype=torch.float16, device="h100", settings=NO_ENV)
        reason = next(c for c in d.trace if c.backend == "marlin").reason
        assert "mxfp4 kernels for fp16" in reason
        ok = select("nvfp4", act_dtype=torch.float16, device="h100", settings=NO_ENV)
        assert next(c for c in ok.trace if c.backend == "marlin").accepted


def test_device_rules_come_before_providers():
    with fake_ops():
        mp.register("vllm", "0.33.0")
        t4 = select("nvfp4", act_dtype=torch.bfloat16, device="t4", settings=NO_ENV)
        assert "no bf16 tensor cores" in next(c for c in t4.trace if c.backend == "marlin").reason
        cpu = select("nvfp4", device="cpu", settings=NO_ENV)
        assert "needs a CUDA GPU" in next(c for c in cpu.trace if c.backend == "marlin").reason


def test_moe_needs_the_moe_library():
    with fake_ops(moe=False):
        mp.register("vllm", "0.33.0")
        forced = load_settings({}, backend={"nvfp4": "marlin"})
        with pytest.raises(BackendUnavailableError, match="_moe_C::moe_wna16_marlin_gemm"):
            select("nvfp4", "moe", n=768, k=2048, experts=128, device="h100", settings=forced)
        assert select("nvfp4", device="h100", settings=forced).backend == "marlin"


def test_forced_marlin_without_provider_raises_with_the_reason():
    forced = load_settings({}, backend={"nvfp4": "marlin"})
    with pytest.raises(BackendUnavailableError, match="no usable Marlin provider"):
        select("nvfp4", device="h100", settings=forced)


def test_forced_marlin_decision_names_provider_and_kernel():
    with fake_ops():
        mp.register("vllm", "0.33.0")
        forced = load_settings({}, backend={"nvfp4": "marlin"})
        d = select("nvfp4", n=4096, k=4096, device="h100", settings=forced)
        assert d.backend == "marlin"
        text = d.explain()
        assert "forced by" in text and "vllm 0.33.0 _C::marlin_gemm" in text

"""Device profiles: presets, probing without NVML / GPU, provider import failures."""

from __future__ import annotations

import importlib
import sys
import types

import pydantic
import pytest

from quantdispatch.device import (
    PRESETS,
    Source,
    device_profile,
    preset_profile,
    probe,
    probe_providers,
)
from quantdispatch.errors import ConfigurationError

# The modules (quantdispatch.device.probe is the function of that name).
probe_mod = importlib.import_module("quantdispatch.device.probe")
host_mod = importlib.import_module("quantdispatch.device.host")


@pytest.fixture(autouse=True)
def _fresh_probe_cache():
    probe.cache_clear()
    probe_providers.cache_clear()
    yield
    probe.cache_clear()
    probe_providers.cache_clear()


def test_required_presets_exist_with_their_capabilities():
    expected = {
        "v100": (7, 0),
        "t4": (7, 5),
        "a100": (8, 0),
        "a10": (8, 6),
        "rtx3090": (8, 6),
        "orin": (8, 7),
        "l40s": (8, 9),
        "rtx4090": (8, 9),
        "h100": (9, 0),
        "h200": (9, 0),
        "b200": (10, 0),
        "b300": (10, 3),
        "thor": (11, 0),
        "rtx5090": (12, 0),
        "gb10": (12, 1),
    }
    for key, cc in expected.items():
        p = preset_profile(key)
        assert p.capability == cc and p.simulated and p.preset == key and p.kind == "cuda"
        assert p.sources.capability is Source.PRESET
    assert preset_profile("cpu").kind == "cpu"
    assert "cpu" in PRESETS


def test_simulated_profile_keeps_real_providers():
    p = preset_profile("h100")
    assert p.providers == probe_providers()


def test_preset_lookup_is_case_insensitive_and_unknown_is_an_error():
    assert preset_profile(" H100 ").preset == "h100"
    with pytest.raises(ConfigurationError, match="valid presets:"):
        preset_profile("h300")


def test_profiles_are_hashable_and_frozen():
    p = preset_profile("a100")
    hash(p)
    with pytest.raises(pydantic.ValidationError):
        p.name = "x"  # type: ignore[misc]


def test_no_nvml_module_gives_a_valid_cpu_profile(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    monkeypatch.setattr(
        probe_mod, "_torch_cuda_info", lambda: (False, 0, [], "no CUDA in this torch")
    )
    (p,) = probe()
    assert p.kind == "cpu" and p.capability is None
    assert any("pynvml" in n for n in p.notes)
    assert any("no GPU found" in n for n in p.notes)
    assert p.sources.capability is Source.UNAVAILABLE


def _fake_nvml(init_error: Exception | None = None, cc=(9, 0)):
    m = types.ModuleType("pynvml")

    def init():
        if init_error:
            raise init_error

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: object()
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetCudaComputeCapability = lambda h: cc
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=150 * 2**30)
    m.nvmlDeviceGetUUID = lambda h: "GPU-1234"
    return m


@pytest.mark.parametrize(
    "error",
    [
        OSError("libnvidia-ml.so.1: cannot open shared object file"),
        RuntimeError("Driver/library version mismatch"),
        PermissionError("Insufficient Permissions"),
    ],
)
def test_nvml_init_failures_are_notes_not_crashes(monkeypatch, error):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(init_error=error))
    monkeypatch.setattr(
        probe_mod, "_torch_cuda_info", lambda: (False, 0, [], "no CUDA in this torch")
    )
    (p,) = probe()
    assert p.kind == "cpu"
    assert any("NVML unavailable" in n and str(error) in n for n in p.notes)


def test_nvml_gpu_with_a_cpu_torch_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(
        probe_mod, "_torch_cuda_info", lambda: (False, 0, [], "this torch build has no CUDA")
    )
    (p,) = probe()
    assert p.kind == "cuda" and p.name == "NVIDIA H200" and p.capability == (9, 0)
    assert p.sources.name is Source.NVML and p.sources.capability is Source.NVML
    assert p.driver_version == "580.159.04" and p.sources.driver_version is Source.NVML
    assert p.torch_cuda is False and p.sm_count is None and p.sources.sm_count is Source.UNAVAILABLE
    from quantdispatch import select

    d = select("nvfp4", device=p)
    triton = next(c for c in d.trace if c.backend == "triton")
    assert "cannot launch kernels" in triton.reason
    assert d.backend == "reference"


def test_cuda_visible_devices_maps_nvml_indices(monkeypatch):
    m = _fake_nvml()
    m.nvmlDeviceGetCount = lambda: 2
    names = [b"GPU zero", b"GPU one"]
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: names[h]
    monkeypatch.setitem(sys.modules, "pynvml", m)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(probe_mod, "_torch_cuda_info", lambda: (False, 0, [], "cpu torch"))
    profiles = probe()
    assert [p.name for p in profiles] == ["GPU one"]


def test_provider_oserror_counts_as_not_importable(monkeypatch):
    real = importlib.import_module

    def fake_import(name, *a, **k):
        if name == "sgl_kernel":
            raise OSError("libcudart.so.12: cannot open shared object file")
        return real(name, *a, **k)

    monkeypatch.setattr(host_mod.importlib, "import_module", fake_import)
    info = {p.name: p for p in probe_providers()}["sgl-kernel"]
    assert not info.available
    assert info.reason.startswith("OSError: libcudart.so.12")


def test_device_profile_accepts_the_documented_forms():
    assert device_profile("h100").preset == "h100"
    assert device_profile("cpu").kind == "cpu"
    assert device_profile(preset_profile("t4")).preset == "t4"
    with pytest.raises(ConfigurationError, match="unknown device"):
        device_profile("tpu")


def test_device_profile_leaves_quantdispatch_device_to_its_callers(monkeypatch):
    monkeypatch.setenv("QUANTDISPATCH_DEVICE", "l40s")
    assert device_profile(None).preset is None  # the probed device: a setting, not a probe
    from quantdispatch import select

    assert select("nvfp4").device.preset == "l40s"  # select() passes settings.device


def test_import_is_cheap_and_quiet():
    import subprocess

    code = (
        "import sys, quantdispatch; "
        "bad = [m for m in ('triton', 'pynvml', 'sgl_kernel', 'pydantic') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]" and out.stderr == ""


def test_device_package_imports_only_itself_and_errors():
    import ast
    from pathlib import Path

    import quantdispatch.device

    for path in Path(quantdispatch.device.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):  # module level and inside functions
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quantdispatch"):
                assert node.module.startswith(("quantdispatch.device", "quantdispatch.errors")), (
                    f"{path.name} imports {node.module}"
                )

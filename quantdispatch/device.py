"""Device profiles: what GPU (or CPU) is here, which kernel libraries import, and who said so.

A :class:`DeviceProfile` is frozen data. Every hardware field has a twin in ``sources`` that
names the probe that filled it (``nvml``, ``torch``, ``preset``, ``system``) or says it is
``unavailable``. NVML is asked first because it creates no CUDA context; torch fills what NVML
cannot (SM count, whether this torch build can drive the GPU). No GPU, no NVML library, a
driver/library mismatch or no permission all give a valid profile whose ``notes`` say so: probing
never raises.

Presets simulate a GPU for explanation (``quantdispatch doctor --device h100``): the hardware
fields come from the preset, the software providers are still the ones importable here, and
nothing may run a kernel on a simulated profile.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
import platform
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantdispatch.errors import ConfigurationError, format_error

__all__ = [
    "PRESETS",
    "PROVIDERS",
    "DeviceProfile",
    "Preset",
    "ProfileSources",
    "ProviderInfo",
    "Source",
    "device_profile",
    "preset_profile",
    "probe",
    "probe_providers",
]


class Source(StrEnum):
    """Which probe filled a profile field."""

    NVML = "nvml"
    TORCH = "torch"
    PRESET = "preset"
    SYSTEM = "system"
    UNAVAILABLE = "unavailable"


class ProviderInfo(BaseModel):
    """One optional kernel library: importable (with version) or why not."""

    model_config = ConfigDict(frozen=True)

    name: str
    module: str
    available: bool
    version: str | None = None
    reason: str | None = None
    install_hint: str = ""

    def describe(self) -> str:
        if self.available:
            return f"{self.name} {self.version or '(version unknown)'}"
        return f"{self.name}: not importable ({self.reason})"


class ProfileSources(BaseModel):
    """The source of each hardware field of a DeviceProfile (same names)."""

    model_config = ConfigDict(frozen=True)

    name: Source
    capability: Source
    sm_count: Source
    memory_bytes: Source
    driver_version: Source
    cuda_version: Source
    torch_cuda: Source


class DeviceProfile(BaseModel):
    """One device as the resolver sees it. Frozen and hashable, so decisions can be cached."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["cuda", "cpu"]
    index: int | None
    name: str
    capability: tuple[int, int] | None
    sm_count: int | None
    memory_bytes: int | None
    driver_version: str | None
    cuda_version: str | None
    """CUDA version of the torch build (``torch.version.cuda``), or a preset's assumption."""
    torch_cuda: bool
    """Whether this torch build can launch kernels on the device."""
    torch_version: str
    simulated: bool = False
    preset: str | None = None
    providers: tuple[ProviderInfo, ...] = ()
    sources: ProfileSources
    notes: tuple[str, ...] = ()

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def sm(self) -> str:
        """Compute capability as ``"9.0"``, or ``"-"`` for a CPU."""
        return f"{self.capability[0]}.{self.capability[1]}" if self.capability else "-"

    def provider(self, name: str) -> ProviderInfo:
        for p in self.providers:
            if p.name == name:
                return p
        valid = ", ".join(p.name for p in self.providers)
        raise ConfigurationError(
            format_error(f"unknown kernel provider {name!r}", f"known providers: {valid}", "")
        )

    def label(self) -> str:
        """Short human label: ``NVIDIA H200 (SM 9.0)`` or ``CPU (x86_64)``."""
        if self.kind == "cpu":
            return self.name
        sim = f", simulated preset {self.preset!r}" if self.simulated else ""
        return f"{self.name} (SM {self.sm}{sim})"


# ---------------------------------------------------------------------------------------------
# Providers: optional kernel libraries, imported lazily and only when probed.


class _ProviderSpec(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    module: str
    distribution: str
    install_hint: str


PROVIDERS: tuple[_ProviderSpec, ...] = (
    _ProviderSpec(
        name="triton",
        module="triton",
        distribution="triton",
        install_hint="pip install 'quantdispatch[triton]'",
    ),
    _ProviderSpec(
        name="sgl-kernel",
        module="sgl_kernel",
        distribution="sgl-kernel",
        install_hint="pip install 'quantdispatch[sgl]' (its wheels pin a torch/CUDA pair)",
    ),
    _ProviderSpec(
        name="flashinfer",
        module="flashinfer",
        distribution="flashinfer-python",
        install_hint="pip install flashinfer-python",
    ),
)


def _probe_provider(spec: _ProviderSpec) -> ProviderInfo:
    try:
        mod = importlib.import_module(spec.module)
    except Exception as exc:  # OSError from a CUDA library counts as "not importable"
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ProviderInfo(
            name=spec.name,
            module=spec.module,
            available=False,
            reason=f"{type(exc).__name__}: {msg}",
            install_hint=spec.install_hint,
        )
    version = getattr(mod, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(spec.distribution)
        except importlib.metadata.PackageNotFoundError:
            version = None
    return ProviderInfo(
        name=spec.name,
        module=spec.module,
        available=True,
        version=str(version) if version else None,
        install_hint=spec.install_hint,
    )


@functools.lru_cache(maxsize=1)
def probe_providers() -> tuple[ProviderInfo, ...]:
    """Which optional kernel libraries import here (cached for the process)."""
    return tuple(_probe_provider(spec) for spec in PROVIDERS)


# ---------------------------------------------------------------------------------------------
# Presets: simulated GPUs.


class Preset(BaseModel):
    model_config = ConfigDict(frozen=True)
    key: str
    name: str
    capability: tuple[int, int] | None
    sm_count: int | None
    memory_gib: float | None


def _p(key: str, name: str, cc: tuple[int, int] | None, sms: int | None, gib: float | None):
    return Preset(key=key, name=name, capability=cc, sm_count=sms, memory_gib=gib)


PRESETS: dict[str, Preset] = {
    p.key: p
    for p in (
        _p("cpu", "CPU (simulated)", None, None, None),
        _p("v100", "Tesla V100-SXM2-32GB", (7, 0), 80, 32),
        _p("t4", "Tesla T4", (7, 5), 40, 15),
        _p("a100", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 80),
        _p("a10", "NVIDIA A10", (8, 6), 72, 24),
        _p("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 82, 24),
        _p("orin", "NVIDIA Jetson AGX Orin", (8, 7), 16, 64),
        _p("l40s", "NVIDIA L40S", (8, 9), 142, 48),
        _p("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 128, 24),
        _p("h100", "NVIDIA H100 80GB HBM3", (9, 0), 132, 80),
        _p("h200", "NVIDIA H200", (9, 0), 132, 141),
        _p("b200", "NVIDIA B200", (10, 0), 148, 180),
        _p("b300", "NVIDIA B300", (10, 3), 148, 270),
        _p("thor", "NVIDIA Jetson AGX Thor", (11, 0), 20, 128),
        _p("rtx5090", "NVIDIA GeForce RTX 5090", (12, 0), 170, 32),
        _p("rtxpro6000", "NVIDIA RTX PRO 6000 Blackwell", (12, 0), 188, 96),
        _p("gb10", "NVIDIA GB10 (DGX Spark)", (12, 1), 48, 128),
    )
}

#: CUDA version a simulated profile assumes when this torch build has none (CPU build).
ASSUMED_CUDA_FOR_PRESETS = "12.8"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _torch_cuda_version() -> str | None:
    import torch

    return torch.version.cuda


def preset_profile(name: str) -> DeviceProfile:
    """A simulated profile from a preset name (case-insensitive)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigurationError(
            format_error(
                f"unknown device preset {name!r}",
                f"valid presets: {', '.join(PRESETS)}",
                "pick one of those (quantdispatch doctor --list-presets shows them)",
            )
        )
    preset = PRESETS[key]
    if preset.capability is None:
        return _cpu_profile(notes=("simulated CPU preset",), simulated=True, preset=key)
    cuda = _torch_cuda_version()
    cuda_source = Source.TORCH
    notes = [f"simulated from preset {key!r}: hardware fields are the preset's, not a probe's"]
    if cuda is None:
        cuda, cuda_source = ASSUMED_CUDA_FOR_PRESETS, Source.PRESET
        notes.append(
            f"this torch build has no CUDA; the simulation assumes a CUDA {cuda} build of torch"
        )
    return DeviceProfile(
        kind="cuda",
        index=None,
        name=preset.name,
        capability=preset.capability,
        sm_count=preset.sm_count,
        memory_bytes=int(preset.memory_gib * 2**30) if preset.memory_gib else None,
        driver_version=None,
        cuda_version=cuda,
        torch_cuda=True,
        torch_version=_torch_version(),
        simulated=True,
        preset=key,
        providers=probe_providers(),
        sources=ProfileSources(
            name=Source.PRESET,
            capability=Source.PRESET,
            sm_count=Source.PRESET,
            memory_bytes=Source.PRESET,
            driver_version=Source.UNAVAILABLE,
            cuda_version=cuda_source,
            torch_cuda=Source.PRESET,
        ),
        notes=tuple(notes),
    )


# ---------------------------------------------------------------------------------------------
# Probing the real machine.


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU ({line.split(':', 1)[1].strip()})"
    except OSError:
        pass
    return f"CPU ({platform.machine() or 'unknown'})"


def _cpu_profile(
    notes: tuple[str, ...], simulated: bool = False, preset: str | None = None
) -> DeviceProfile:
    unavailable = Source.UNAVAILABLE
    return DeviceProfile(
        kind="cpu",
        index=None,
        name=_cpu_name(),
        capability=None,
        sm_count=None,
        memory_bytes=None,
        driver_version=None,
        cuda_version=_torch_cuda_version(),
        torch_cuda=False,
        torch_version=_torch_version(),
        simulated=simulated,
        preset=preset,
        providers=probe_providers(),
        sources=ProfileSources(
            name=Source.SYSTEM,
            capability=unavailable,
            sm_count=unavailable,
            memory_bytes=unavailable,
            driver_version=unavailable,
            cuda_version=Source.TORCH,
            torch_cuda=Source.TORCH,
        ),
        notes=notes,
    )


class _NvmlGpu(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    capability: tuple[int, int] | None
    memory_bytes: int | None
    uuid: str | None


def _nvml_probe() -> tuple[list[_NvmlGpu], str | None, list[str]]:
    """Ask NVML for every GPU. Returns (gpus, driver_version, notes); never raises."""
    notes: list[str] = []
    try:
        import pynvml
    except Exception as exc:
        return [], None, [f"NVML not used: the pynvml module (nvidia-ml-py) did not import: {exc}"]
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # library not found, driver not loaded, mismatch, no permission
        return [], None, [f"NVML unavailable: {type(exc).__name__}: {exc}"]
    gpus: list[_NvmlGpu] = []
    driver: str | None = None
    try:
        try:
            raw = pynvml.nvmlSystemGetDriverVersion()
            driver = raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception as exc:
            notes.append(f"NVML could not read the driver version: {exc}")
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else str(name)
                try:
                    cc = tuple(int(v) for v in pynvml.nvmlDeviceGetCudaComputeCapability(h))
                except Exception:
                    cc = None
                try:
                    mem = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
                except Exception:
                    mem = None
                try:
                    uuid = pynvml.nvmlDeviceGetUUID(h)
                    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                except Exception:
                    uuid = None
                gpus.append(
                    _NvmlGpu(
                        name=name,
                        capability=cc if cc and len(cc) == 2 else None,  # type: ignore[arg-type]
                        memory_bytes=mem,
                        uuid=uuid,
                    )
                )
            except Exception as exc:
                notes.append(f"NVML could not read GPU {i}: {type(exc).__name__}: {exc}")
    except Exception as exc:
        notes.append(f"NVML failed while listing GPUs: {type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return gpus, driver, notes


def _visible(gpus: list[_NvmlGpu]) -> tuple[list[_NvmlGpu], list[str]]:
    """Apply CUDA_VISIBLE_DEVICES (indices or UUID prefixes) to NVML's list of all GPUs."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return gpus, []
    out: list[_NvmlGpu] = []
    for item in (s.strip() for s in env.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit():
            idx = int(item)
            if idx < 0 or idx >= len(gpus):
                break  # CUDA stops at the first invalid entry
            out.append(gpus[idx])
        else:
            match = [g for g in gpus if g.uuid and g.uuid.startswith(item)]
            if len(match) != 1:
                return gpus, [f"CUDA_VISIBLE_DEVICES={env!r} not mapped to NVML GPUs; listing all"]
            out.append(match[0])
    return out, []


def _torch_cuda_info() -> tuple[bool, int, list[tuple[str, tuple[int, int], int, int]], str | None]:
    """(usable, count, [(name, cc, sms, mem)], note) from torch; never raises."""
    try:
        import torch

        if torch.version.cuda is None:
            return False, 0, [], f"this torch build ({torch.__version__}) has no CUDA support"
        if not torch.cuda.is_available():
            return False, 0, [], "torch.cuda.is_available() is False"
        infos = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            infos.append((p.name, (p.major, p.minor), p.multi_processor_count, p.total_memory))
        return True, len(infos), infos, None
    except Exception as exc:
        return False, 0, [], f"torch could not query CUDA: {type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=1)
def probe() -> tuple[DeviceProfile, ...]:
    """Profiles of every visible GPU, or one CPU profile when there is none (cached)."""
    nvml_gpus, driver, notes = _nvml_probe()
    nvml_gpus, map_notes = _visible(nvml_gpus)
    notes += map_notes
    torch_ok, torch_count, torch_infos, torch_note = _torch_cuda_info()
    if torch_note:
        notes.append(torch_note)
    count = max(len(nvml_gpus), torch_count)
    if count == 0:
        return (_cpu_profile(notes=("no GPU found", *notes)),)
    profiles = []
    for i in range(count):
        nv = nvml_gpus[i] if i < len(nvml_gpus) else None
        th = torch_infos[i] if i < len(torch_infos) else None
        name, name_src = (nv.name, Source.NVML) if nv else (th[0], Source.TORCH)  # type: ignore[index]
        if nv and nv.capability:
            cc, cc_src = nv.capability, Source.NVML
        elif th:
            cc, cc_src = th[1], Source.TORCH
        else:
            cc, cc_src = None, Source.UNAVAILABLE
        if nv and nv.memory_bytes is not None:
            mem, mem_src = nv.memory_bytes, Source.NVML
        elif th:
            mem, mem_src = th[3], Source.TORCH
        else:
            mem, mem_src = None, Source.UNAVAILABLE
        sms, sms_src = (th[2], Source.TORCH) if th else (None, Source.UNAVAILABLE)
        cuda = _torch_cuda_version()
        profiles.append(
            DeviceProfile(
                kind="cuda",
                index=i,
                name=name,
                capability=cc,
                sm_count=sms,
                memory_bytes=mem,
                driver_version=driver,
                cuda_version=cuda,
                torch_cuda=torch_ok and th is not None,
                torch_version=_torch_version(),
                providers=probe_providers(),
                sources=ProfileSources(
                    name=name_src,
                    capability=cc_src,
                    sm_count=sms_src,
                    memory_bytes=mem_src,
                    driver_version=Source.NVML if driver else Source.UNAVAILABLE,
                    cuda_version=Source.TORCH if cuda else Source.UNAVAILABLE,
                    torch_cuda=Source.TORCH,
                ),
                notes=tuple(notes),
            )
        )
    return tuple(profiles)


def device_profile(device: object = None) -> DeviceProfile:
    """The profile a decision is made for.

    ``device`` may be a DeviceProfile, a preset name (``"h100"``), a torch device or string
    (``"cuda:1"``, ``"cpu"``), an int GPU index, or None: then ``QUANTDISPATCH_DEVICE`` if set,
    else the current CUDA device, else the CPU.
    """
    if isinstance(device, DeviceProfile):
        return device
    if device is None:
        from quantdispatch.settings import current_settings

        env_device = current_settings().device
        if env_device:
            return preset_profile(env_device)
        return _probed_for_index(None)
    if isinstance(device, int):
        return _probed_for_index(device)
    text = str(device).strip()
    lowered = text.lower()
    if lowered in PRESETS and lowered != "cpu":
        return preset_profile(lowered)
    if lowered == "cpu":
        return _cpu_profile(notes=("CPU requested",))
    if lowered == "cuda" or lowered.startswith("cuda:"):
        suffix = lowered.split(":", 1)[1] if ":" in lowered else ""
        if suffix and not suffix.isdigit():
            raise ConfigurationError(
                format_error(f"device {device!r} has no valid GPU index", "write cuda:N", "")
            )
        return _probed_for_index(int(suffix) if suffix else None)
    raise ConfigurationError(
        format_error(
            f"unknown device {device!r}",
            f"valid presets: {', '.join(PRESETS)}; or 'cuda', 'cuda:N', a GPU index",
            "pass one of those",
        )
    )


def _probed_for_index(index: int | None) -> DeviceProfile:
    profiles = probe()
    gpus = [p for p in profiles if p.kind == "cuda"]
    if not gpus:
        if index is not None:
            raise ConfigurationError(
                format_error(
                    f"GPU index {index} requested but no GPU was found",
                    "; ".join(profiles[0].notes),
                    "use device='cpu' or a preset to simulate a GPU",
                )
            )
        return profiles[0]
    if index is None:
        index = _current_cuda_index()
    if index < 0 or index >= len(gpus):
        raise ConfigurationError(
            format_error(
                f"GPU index {index} is out of range",
                f"{len(gpus)} GPU(s) are visible",
                f"use an index from 0 to {len(gpus) - 1}",
            )
        )
    return gpus[index]


def _current_cuda_index() -> int:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:
        pass
    return 0

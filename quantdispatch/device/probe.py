"""Probing the real machine: NVML first (it creates no CUDA context), then torch.

torch fills what NVML cannot (SM count, whether this torch build can drive the GPU). No GPU, no
NVML library, a driver/library mismatch or no permission all give a valid profile whose
``notes`` say so: probing never raises.
"""

from __future__ import annotations

import contextlib
import functools
import os

from pydantic import BaseModel, ConfigDict

from quantdispatch.device.host import (
    cpu_profile,
    probe_providers,
    torch_cuda_version,
    torch_version,
)
from quantdispatch.device.presets import PRESETS, preset_profile
from quantdispatch.device.profile import DeviceProfile, ProfileSources, Source
from quantdispatch.errors import ConfigurationError, format_error

__all__ = ["device_profile", "probe"]


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
        return (cpu_profile(notes=("no GPU found", *notes)),)
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
        cuda = torch_cuda_version()
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
                torch_version=torch_version(),
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
    (``"cuda:1"``, ``"cpu"``), an int GPU index, or None: the current CUDA device, else the CPU.
    ``QUANTDISPATCH_DEVICE`` is a setting: callers that honour it pass ``settings.device`` (as
    ``select()`` and ``quantdispatch doctor`` do).
    """
    if isinstance(device, DeviceProfile):
        return device
    if device is None:
        return _probed_for_index(None)
    if isinstance(device, int):
        return _probed_for_index(device)
    text = str(device).strip()
    lowered = text.lower()
    if lowered in PRESETS and lowered != "cpu":
        return preset_profile(lowered)
    if lowered == "cpu":
        return cpu_profile(notes=("CPU requested",))
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

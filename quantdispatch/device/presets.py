"""Presets: simulated GPUs, for explaining decisions (``quantdispatch doctor --device h100``).

The hardware fields come from the preset, the software providers are still the ones importable
here, and nothing may run a kernel on a simulated profile.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from quantdispatch.device.host import (
    cpu_profile,
    probe_providers,
    torch_cuda_version,
    torch_version,
)
from quantdispatch.device.profile import DeviceProfile, ProfileSources, Source
from quantdispatch.errors import ConfigurationError, format_error

__all__ = ["ASSUMED_CUDA_FOR_PRESETS", "PRESETS", "Preset", "preset_profile"]


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


def preset_profile(name: str) -> DeviceProfile:
    """A simulated profile from a preset name (case-insensitive)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigurationError(
            format_error(
                f"unknown device preset {name!r}",
                f"valid presets: {', '.join(PRESETS)}",
                "pick one of those (quantdispatch presets lists them)",
            )
        )
    preset = PRESETS[key]
    if preset.capability is None:
        return cpu_profile(notes=("simulated CPU preset",), simulated=True, preset=key)
    cuda = torch_cuda_version()
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
        torch_version=torch_version(),
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

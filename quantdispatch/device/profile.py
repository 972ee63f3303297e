"""The device profile: frozen data about one GPU (or the CPU), and which probe said what.

Every hardware field of a :class:`DeviceProfile` has a twin in ``sources`` that names the probe
that filled it (``nvml``, ``torch``, ``preset``, ``system``) or says it is ``unavailable``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from quantdispatch.errors import ConfigurationError, format_error

__all__ = ["DeviceProfile", "ProfileSources", "ProviderInfo", "Source"]


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

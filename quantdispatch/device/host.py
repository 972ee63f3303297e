"""Facts of this process rather than of a GPU: the torch build, the CPU, the kernel libraries.

Optional kernel libraries are imported lazily and only when probed; an import that fails for any
reason (not installed, a CUDA library missing: OSError) makes the provider "not importable" with
the reason, never an exception.
"""

from __future__ import annotations

import functools
import importlib
import platform

from quantdispatch.device.profile import DeviceProfile, ProfileSources, ProviderInfo, Source
from quantdispatch.device.providers import PROBED, Provider, installed_version

__all__ = ["PROVIDERS", "cpu_profile", "probe_providers", "torch_cuda_version", "torch_version"]


#: The providers the profile probes (the registry's PROBED; ``quantdispatch.device.PROVIDERS``).
PROVIDERS: tuple[Provider, ...] = PROBED


def _probe_provider(spec: Provider) -> ProviderInfo:
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
    version = getattr(mod, "__version__", None) or installed_version(spec.distribution)
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


def torch_version() -> str:
    """The installed torch version."""
    import torch

    return str(torch.__version__)


def torch_cuda_version() -> str | None:
    """CUDA version of this torch build (``torch.version.cuda``), None for a CPU build."""
    import torch

    return torch.version.cuda


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU ({line.split(':', 1)[1].strip()})"
    except OSError:
        pass
    return f"CPU ({platform.machine() or 'unknown'})"


def cpu_profile(
    notes: tuple[str, ...], simulated: bool = False, preset: str | None = None
) -> DeviceProfile:
    """The profile of this machine's CPU (also what the ``cpu`` preset simulates)."""
    unavailable = Source.UNAVAILABLE
    return DeviceProfile(
        kind="cpu",
        index=None,
        name=_cpu_name(),
        capability=None,
        sm_count=None,
        memory_bytes=None,
        driver_version=None,
        cuda_version=torch_cuda_version(),
        torch_cuda=False,
        torch_version=torch_version(),
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

"""Device profiles: what GPU (or CPU) is here, which kernel libraries import, and who said so.

A :class:`DeviceProfile` is frozen data; :func:`probe` fills it from NVML and torch (never
raising), :func:`preset_profile` from a simulated GPU, :func:`device_profile` from whatever a
caller names. ``profile`` holds the data model, ``host`` the torch build / CPU / kernel library
facts, ``presets`` the simulated GPUs, ``probe`` the GPU probes.

``quantdispatch.device.probe`` is the function; the module of that name is
``sys.modules["quantdispatch.device.probe"]`` (``importlib.import_module`` returns it).
"""

from __future__ import annotations

from quantdispatch.device.host import PROVIDERS, probe_providers
from quantdispatch.device.presets import ASSUMED_CUDA_FOR_PRESETS, PRESETS, Preset, preset_profile
from quantdispatch.device.probe import device_profile, probe
from quantdispatch.device.profile import DeviceProfile, ProfileSources, ProviderInfo, Source

__all__ = [
    "ASSUMED_CUDA_FOR_PRESETS",
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

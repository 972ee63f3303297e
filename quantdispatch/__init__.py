"""quantdispatch: pick the fastest correct kernel for each quantized layer, and say why.

Importing the package is cheap and quiet: nothing is probed and no kernel library is imported
until a decision is asked for.

>>> import quantdispatch
>>> quantdispatch.select("nvfp4", device="h100").backend
'triton'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "select": "quantdispatch.api",
    "Decision": "quantdispatch.resolver",
    "Candidate": "quantdispatch.resolver",
    "resolve": "quantdispatch.resolver",
    "Request": "quantdispatch.request",
    "DeviceProfile": "quantdispatch.device",
    "probe": "quantdispatch.device",
    "device_profile": "quantdispatch.device",
    "preset_profile": "quantdispatch.device",
    "PRESETS": "quantdispatch.device",
    "Settings": "quantdispatch.settings",
    "load_settings": "quantdispatch.api",
    "Policy": "quantdispatch.policy",
    "load_policy": "quantdispatch.policy",
    "QuantLinear": "quantdispatch.layers",
    "load_linear": "quantdispatch.layers",
    "QuantMoE": "quantdispatch.layers",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from quantdispatch.api import load_settings, select
    from quantdispatch.device import PRESETS, DeviceProfile, device_profile, preset_profile, probe
    from quantdispatch.layers import QuantLinear, QuantMoE, load_linear
    from quantdispatch.policy import Policy, load_policy
    from quantdispatch.request import Request
    from quantdispatch.resolver import Candidate, Decision, resolve
    from quantdispatch.settings import Settings


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'quantdispatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

"""Quantized layers: :class:`QuantLinear` (and :func:`load_linear`) and :class:`QuantMoE`.

Each makes its kernel decision once, at construction, keeps the backend's prepared tensors as
buffers, and runs one custom op in ``forward``. :mod:`.base` holds what both share.
"""

from quantdispatch.layers.base import (
    FixedDtypeBuffers,
    QuantLayer,
    activations_2d,
    format_of,
    profile_for,
    resolve_quant_config,
    target_device,
)
from quantdispatch.layers.linear import QuantLinear, load_linear
from quantdispatch.layers.moe import QuantMoE

__all__ = [
    "FixedDtypeBuffers",
    "QuantLayer",
    "QuantLinear",
    "QuantMoE",
    "activations_2d",
    "format_of",
    "load_linear",
    "profile_for",
    "resolve_quant_config",
    "target_device",
]

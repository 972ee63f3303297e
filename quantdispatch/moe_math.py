"""Alias of :mod:`quantdispatch.moe.activations` for modules that import the old path."""

from quantdispatch.moe.activations import (
    ACTIVATIONS,
    ActivationSpec,
    apply_activation,
    get_activation,
)

__all__ = ["ACTIVATIONS", "ActivationSpec", "apply_activation", "get_activation"]

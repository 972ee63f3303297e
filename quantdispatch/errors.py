"""Exception types. Every message says what is wrong (with the value), the rule, and the fix.

All of them derive from :class:`QuantDispatchError`, so an engine can catch one type; each also
derives from the builtin that fits (``ValueError`` for bad input, ``RuntimeError`` for a backend
that cannot run), so generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigurationError",
    "InputError",
    "QuantDispatchError",
    "WeightFormatError",
    "format_error",
]


class QuantDispatchError(Exception):
    """Base class of every error quantdispatch raises on purpose."""


class ConfigurationError(QuantDispatchError, ValueError):
    """A setting, env variable, policy file, flag, or name (format, backend, preset) is invalid."""


class BackendUnavailableError(QuantDispatchError, RuntimeError):
    """A backend was forced (or is the only one left) but cannot run here; says why."""


class WeightFormatError(QuantDispatchError, ValueError):
    """Quantized tensors are inconsistent: shapes, dtypes, group sizes or scale values."""


class CheckpointError(WeightFormatError):
    """A checkpoint is missing tensors, has unexpected ones, or disagrees with its config."""


class InputError(QuantDispatchError, ValueError):
    """An activation passed to a layer or op has the wrong shape, dtype or device."""


def format_error(what: str, rule: str, fix: str) -> str:
    """Join the three parts every message must have: ``what. rule. fix.``"""
    parts = [p.strip().rstrip(".") for p in (what, rule, fix) if p and p.strip()]
    return ". ".join(parts) + "."

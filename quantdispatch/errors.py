"""Exception types. Every message says what is wrong (with the value), the rule, and the fix.

All of them derive from :class:`QuantDispatchError`, so an engine can catch one type; each also
derives from the builtin that fits (``ValueError`` for bad input, ``RuntimeError`` for a backend
that cannot run), so generic handlers keep working.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

_V = TypeVar("_V")

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigurationError",
    "InputError",
    "QuantDispatchError",
    "WeightFormatError",
    "clauses",
    "format_error",
    "lookup",
]


class QuantDispatchError(Exception):
    """Base class of every error quantdispatch raises on purpose."""


class ConfigurationError(QuantDispatchError, ValueError):
    """A setting, env variable, policy file, flag, or name (format, backend, preset) is invalid."""


class BackendUnavailableError(QuantDispatchError, RuntimeError):
    """A backend was forced (or is the only one left) but cannot run here; says why.

    The resolver also gives the parts ``doctor`` lays out on lines of their own: ``headline``
    (a short what), ``rejected`` ((backend, reason) per candidate) and ``fix``."""

    def __init__(
        self,
        message: str = "",
        *,
        headline: str | None = None,
        rejected: tuple[tuple[str, str], ...] = (),
        fix: str | None = None,
    ) -> None:
        super().__init__(message)
        self.headline = headline
        self.rejected = tuple(rejected)
        self.fix = fix


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


def lookup(
    table: Mapping[str, _V],
    name: object,
    *,
    unknown: str,
    valid: str,
    fix: str,
    exc: type[Exception] = ConfigurationError,
) -> _V:
    """``table`` at ``name`` stripped and lower-cased; else ``exc`` saying
    ``"{unknown} {name!r}. {valid}: <the keys>. {fix}."``."""
    key = str(name).strip().lower()
    if key not in table:
        raise exc(format_error(f"{unknown} {name!r}", f"{valid}: {', '.join(table)}", fix))
    return table[key]


def clauses(text: str) -> list[str]:
    """A reason's clauses: ``text`` split at "; " outside brackets (the first one is its gist)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if depth == 0 and text.startswith("; ", i):
            out.append(text[start:i])
            start = i + 2
    return [*out, text[start:]]

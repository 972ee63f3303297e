"""The backend registry: one module per backend, one instance per name; each has its facts
(:func:`get_facts`: what it can run and says, all the resolver and doctor read) and its life
cycle (:func:`get_backend`: prepare, bind, run).

Order here is only for listings; the policy table ranks backends.
"""

from __future__ import annotations

from quantdispatch.backends.base import Backend, PreparedWeight
from quantdispatch.backends.cutlass import CutlassBackend
from quantdispatch.backends.facts import BackendFacts
from quantdispatch.backends.marlin import MarlinBackend
from quantdispatch.backends.reference import ReferenceBackend
from quantdispatch.backends.torch_scaled_mm import TorchScaledMMBackend
from quantdispatch.backends.triton import TritonBackend
from quantdispatch.errors import ConfigurationError, format_error

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendFacts",
    "PreparedWeight",
    "backend_names",
    "get_backend",
    "get_facts",
]

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        CutlassBackend(),
        TorchScaledMMBackend(),
        TritonBackend(),
        MarlinBackend(),
        ReferenceBackend(),
    )
}


def backend_names() -> list[str]:
    return list(BACKENDS)


def get_backend(name: str) -> Backend:
    key = str(name).strip().lower()
    if key not in BACKENDS:
        raise ConfigurationError(
            format_error(
                f"unknown backend {name!r}",
                f"valid backends: {', '.join(BACKENDS)}",
                "pick one of those",
            )
        )
    return BACKENDS[key]


def get_facts(name: str) -> BackendFacts:
    """The facts of backend ``name`` (:mod:`.facts`)."""
    return get_backend(name).facts

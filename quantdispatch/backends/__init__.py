"""The backend registry: one module per backend, one instance per name.

Order here is only for listings; the policy table ranks backends.
"""

from __future__ import annotations

from quantdispatch.backends.base import Backend, PreparedWeight
from quantdispatch.backends.cutlass import CutlassBackend
from quantdispatch.backends.marlin import MarlinBackend
from quantdispatch.backends.reference import ReferenceBackend
from quantdispatch.backends.torch_scaled_mm import TorchScaledMMBackend
from quantdispatch.backends.triton import TritonBackend
from quantdispatch.errors import ConfigurationError, format_error

__all__ = ["BACKENDS", "Backend", "PreparedWeight", "backend_names", "get_backend"]

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

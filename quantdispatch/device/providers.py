"""The optional kernel libraries quantdispatch knows, in one registry: their names, import and
package names, how their installed version is read, and version ranges as text.

``host`` probes which of them import (doctor's provider list); the Marlin and native-FP4
backends (``backends/marlin_providers.py``, ``backends/fp4_providers.py``) bind versions of
them to kernels. Nothing here imports a provider: versions come from package metadata.
"""

from __future__ import annotations

import importlib.metadata
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "FLASHINFER",
    "KNOWN",
    "PROBED",
    "SGL_KERNEL",
    "TRITON",
    "VLLM",
    "Detections",
    "Provider",
    "Version",
    "installed_version",
    "parse_version",
    "range_text",
]

#: MAJOR, MINOR, PATCH.
Version = tuple[int, int, int]


@dataclass(frozen=True)
class Provider:
    """One kernel library: the name quantdispatch gives it, its top-level module, its package
    (metadata) name, and how to install it (doctor's provider list)."""

    name: str
    module: str
    distribution: str
    install_hint: str


TRITON = Provider("triton", "triton", "triton", "pip install 'quantdispatch[triton]'")
SGL_KERNEL = Provider(
    "sgl-kernel",
    "sgl_kernel",
    "sgl-kernel",
    "pip install 'quantdispatch[sgl]' (its wheels pin a torch/CUDA pair)",
)
FLASHINFER = Provider(
    "flashinfer", "flashinfer", "flashinfer-python", "pip install flashinfer-python"
)
VLLM = Provider("vllm", "vllm", "vllm", "pip install vllm")

#: Every provider by name.
KNOWN: dict[str, Provider] = {p.name: p for p in (TRITON, SGL_KERNEL, FLASHINFER, VLLM)}

#: The providers doctor's profile imports to say which are there (vLLM is not imported: the
#: Marlin backend reads its package metadata instead).
PROBED: tuple[Provider, ...] = (TRITON, SGL_KERNEL, FLASHINFER)

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: object) -> Version | None:
    """``"0.33.0"``, ``"v0.3.21.post1"``, ``"2.9"`` -> (major, minor, patch); None or text
    that does not start with MAJOR.MINOR -> None."""
    if text is None or text == "":
        return None
    m = _VERSION.match(str(text))
    if m is None:
        return None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def installed_version(distribution: str) -> str | None:
    """The installed package's version from its metadata (None: not installed)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def range_text(min_version: Version, below_version: Version) -> str:
    """``>=0.3.21,<0.4.0``: a half-open version range as pip writes it."""
    lo = ".".join(map(str, min_version))
    hi = ".".join(map(str, below_version))
    return f">={lo},<{hi}"


_Item = TypeVar("_Item")
_Status = TypeVar("_Status")


class Detections(Generic[_Status]):
    """What a backend found of its providers, each detected once per process, by name.
    ``lock`` (re-entrant) also guards what the backend records beside them (registrations)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._found: dict[str, _Status] = {}

    def all(
        self,
        items: Sequence[_Item],
        name: Callable[[_Item], str],
        detect: Callable[[_Item], _Status],
    ) -> tuple[_Status, ...]:
        """Each item's status, detected on first ask."""
        with self.lock:
            for item in items:
                if name(item) not in self._found:
                    self._found[name(item)] = detect(item)
            return tuple(self._found[name(item)] for item in items)

    def forget(self, name: str | None = None) -> None:
        """Detect ``name`` (None: every provider) again on the next ask."""
        with self.lock:
            if name is None:
                self._found.clear()
            else:
                self._found.pop(name, None)

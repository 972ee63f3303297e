"""Which Marlin kernels this process can call: providers, their versions, their contract row.

A provider is a compiled library that registers Marlin ops with torch: vLLM's extension
(``torch.ops._C.marlin_gemm`` / ``gptq_marlin_repack``, MoE ``torch.ops._moe_C.
moe_wna16_marlin_gemm``) or sgl-kernel's (``torch.ops.sgl_kernel.gptq_marlin_gemm``). A
provider is usable only at a version listed in ``CONTRACTS`` (marlin_table.py): the weight
preparation (marlin_contract.py) and the kernel are one versioned contract, and the table says
which versions the preparation was established for (docs/design/marlin.md has the sources).

Detection is lazy and cheap: package metadata and the library file, never an import of the
engine. The library is loaded (``torch.ops.load_library``) only when a weight is prepared.
Engines, and machines that carry the library without the package, register it explicitly::

    from quantdispatch.backends import marlin_providers
    marlin_providers.load_library("/tmp/vllm/_C_stable_libtorch.abi3.so",
                                  provider="vllm", version="0.33.0")
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantdispatch.backends.marlin_table import CONTRACTS, REFUSED, SCHEMA_ARGS, Contract, Schema
from quantdispatch.device.providers import (
    SGL_KERNEL,
    VLLM,
    Detections,
    Provider,
    installed_version,
    parse_version,
)
from quantdispatch.errors import BackendUnavailableError, ConfigurationError, format_error

__all__ = [
    "CONTRACTS",
    "PROVIDERS",
    "Contract",
    "ProviderStatus",
    "Schema",
    "active",
    "ensure_loaded",
    "load_library",
    "register",
    "reset",
    "schema_mismatch",
    "statuses",
]


#: The Marlin providers, in the order ``active`` prefers them.
PROVIDERS: tuple[Provider, ...] = (VLLM, SGL_KERNEL)

#: How to get each one (what a "not installed" reason says).
_INSTALL = {
    "vllm": "pip install 'vllm>=0.30,<0.34', or register its compiled library with "
    "quantdispatch.backends.marlin_providers.load_library(path, provider='vllm', "
    "version=...)",
    "sgl-kernel": "pip install sgl-kernel",
}


@dataclass(frozen=True)
class ProviderStatus:
    """One provider as this process sees it."""

    name: str
    version: str | None
    installed: bool
    """The package is installed or its library was registered."""
    contract: Contract | None = None
    """The table row; None when the provider cannot be used (``reason`` says why)."""
    reason: str | None = None
    source: str = "package"
    """"package" (metadata), "load_library" or "register"."""
    library_dir: str | None = None
    pending: tuple[str, ...] = field(default_factory=tuple)
    """Library files to load on first use (package detection does not load them)."""

    @property
    def usable(self) -> bool:
        return self.contract is not None

    def offers(self, role: str) -> bool:
        """Whether the op of ``role`` ("gemm", "repack", "moe") is registered or will be
        (its library is pending)."""
        row = self.contract
        if row is None or role not in row.ops:
            return False
        ns, name = row.ops[role]
        if _op_present(ns, name):
            return True
        return any(Path(p).name in row.libraries.get(ns, ()) for p in self.pending)

    def describe(self) -> str:
        ver = self.version or "(version unknown)"
        if self.usable:
            assert self.contract is not None
            verified = self.contract.gpu_verified or "contract from sources, not GPU-verified"
            return f"{self.name} {ver} [{self.contract.key}; {verified}]"
        if not self.installed:
            return f"{self.name}: {self.reason}"
        return f"{self.name} {ver}: {self.reason}"


_detections: Detections[ProviderStatus] = Detections()
_registered: dict[str, tuple[str, str, str | None]] = {}
"""provider -> (version, source, library path)."""


#: A package's installed version (this module's own name for it: tests stand in fake versions).
_dist_version = installed_version


def _package_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)  # locates a top-level package, runs nothing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _op_present(ns: str, name: str) -> bool:
    try:
        return hasattr(getattr(torch.ops, ns), name)
    except Exception:  # a namespace lookup can raise on odd builds; absent either way
        return False


def _namespace_loaded(row: Contract, ns: str) -> bool:
    return any(_op_present(n, name) for n, name in row.ops.values() if n == ns)


def schema_mismatch(contract: Contract, role: str) -> str | None:
    """None if the registered op's arguments are the ones the row expects, else what differs."""
    expected = SCHEMA_ARGS[contract.schema].get(role)
    if expected is None:
        return None
    try:
        schema = contract.op(role).default._schema
    except Exception as exc:  # not registered
        return f"{contract.ops[role][0]}::{contract.ops[role][1]} is not registered ({exc})"
    got = [a.name for a in schema.arguments]
    if got != expected:
        return f"{contract.ops[role][0]}::{contract.ops[role][1]} takes ({', '.join(got)})"
    return None


def _row_for(name: str, version: str | None) -> tuple[Contract | None, str | None]:
    parsed = parse_version(version)
    if parsed is None:
        return None, f"version {version!r} cannot be read; the contract table is per version"
    for row in CONTRACTS:
        if row.provider == name and row.covers(parsed):
            return row, None
    for lo, hi, why in REFUSED.get(name, ()):
        if lo <= parsed < hi:
            return None, f"version {version} is refused: {why}"
    ranges = ", ".join(r.range_text() for r in CONTRACTS if r.provider == name) or "none"
    return None, f"version {version} is outside the contract table (verified ranges: {ranges})"


def _detect(spec: Provider) -> ProviderStatus:
    reg = _registered.get(spec.name)
    if reg is not None:
        version, source, path = reg
        row, why = _row_for(spec.name, version)
        if row is not None:
            missing = [r for r in row.ops if r != "moe" and schema_mismatch(row, r)]
            if missing:
                why = "; ".join(str(schema_mismatch(row, r)) for r in missing)
                row = None
        lib_dir = str(Path(path).parent) if path else None
        return ProviderStatus(spec.name, version, True, row, why, source, lib_dir)
    version = _dist_version(spec.distribution)
    if version is None:
        why = f"not installed ({_INSTALL[spec.name]})"
        return ProviderStatus(spec.name, None, False, None, why)
    row, why = _row_for(spec.name, version)
    if row is None:
        return ProviderStatus(spec.name, version, True, None, why)
    package = _package_dir(spec.module)
    pending: list[str] = []
    for ns, files in row.libraries.items():
        if _namespace_loaded(row, ns):
            continue
        found = [f for f in files if package is not None and (package / f).is_file()]
        if found:
            pending.append(str(package / found[0]))
        elif ns == row.ops["gemm"][0]:
            why = f"none of {', '.join(files)} found in {package}"
            return ProviderStatus(spec.name, version, True, None, why)
    return ProviderStatus(
        spec.name, version, True, row, None, "package", str(package), tuple(pending)
    )


def statuses() -> tuple[ProviderStatus, ...]:
    """Every known provider, detected once per process (``reset`` forgets)."""
    return _detections.all(PROVIDERS, lambda spec: spec.name, _detect)


def active() -> ProviderStatus | None:
    """The provider the backend uses: the first usable one (registered ones are detected as
    their registration says; vLLM before sgl-kernel)."""
    for status in statuses():
        if status.usable:
            return status
    return None


def ensure_loaded(status: ProviderStatus, roles: tuple[str, ...] = ("gemm", "repack")) -> None:
    """Load the provider's pending libraries, then check the ops of ``roles`` against the
    row's schema; raise BackendUnavailableError with the reason otherwise."""
    assert status.contract is not None
    row = status.contract
    for path in status.pending:
        ns = next((n for n, files in row.libraries.items() if Path(path).name in files), None)
        if ns is not None and _namespace_loaded(row, ns):
            continue
        try:
            torch.ops.load_library(path)
        except Exception as exc:
            raise BackendUnavailableError(
                format_error(
                    f"{status.name} {status.version}: loading {path} failed "
                    f"({type(exc).__name__}: {str(exc).strip().splitlines()[0]})",
                    "the Marlin backend calls the provider's compiled ops",
                    "install a build of the provider that matches this torch/CUDA, or force "
                    "another backend",
                )
            ) from exc
    problems = [p for p in (schema_mismatch(row, r) for r in roles) if p]
    if problems:
        raise BackendUnavailableError(
            format_error(
                f"{status.name} {status.version}: " + "; ".join(problems),
                f"contract {row.key} expects the {row.schema.value} schema",
                "use a provider version from the table (marlin_providers.CONTRACTS)",
            )
        )


def register(provider: str, version: str, *, source: str = "register", path=None) -> None:
    """Record that ``provider`` at ``version`` has registered its ops in this process (an
    engine that loaded its own library). Decisions made before this call are not redone."""
    names = [p.name for p in PROVIDERS]
    if provider not in names:
        raise ConfigurationError(
            format_error(
                f"unknown Marlin provider {provider!r}",
                f"known providers: {', '.join(names)}",
                "pass one of those",
            )
        )
    if parse_version(version) is None:
        raise ConfigurationError(
            format_error(
                f"version {version!r} of {provider} cannot be read",
                "the contract table is keyed by MAJOR.MINOR[.PATCH]",
                "pass the provider's release, e.g. version='0.33.0'",
            )
        )
    with _detections.lock:
        _registered[provider] = (str(version), source, None if path is None else str(path))
        _detections.forget(provider)


def load_library(path: str | Path, *, provider: str = "vllm", version: str) -> ProviderStatus:
    """``torch.ops.load_library(path)`` (a provider's compiled extension, e.g. vLLM's
    ``_C_stable_libtorch.abi3.so``), then register ``provider`` at ``version``. Call it for
    each library (the MoE ops live in a second one) before the first decision."""
    p = Path(path)
    if not p.is_file():
        raise ConfigurationError(
            format_error(f"no library at {p}", "load_library takes a .so file", "check the path")
        )
    try:
        torch.ops.load_library(str(p))
    except OSError as exc:
        raise BackendUnavailableError(
            format_error(
                f"{provider} {version}: torch.ops.load_library({str(p)!r}) failed ({exc})",
                "the library must match this torch (stable-ABI builds: torch 2.10+) and the "
                "CUDA runtime it links (vLLM 0.33.0: libcudart.so.13)",
                "use the provider build made for this machine's torch and CUDA",
            )
        ) from exc
    register(provider, version, source="load_library", path=p)
    return next(s for s in statuses() if s.name == provider)


def reset() -> None:
    """Forget registrations and detections (tests; a process that swaps providers)."""
    with _detections.lock:
        _registered.clear()
        _detections.forget()

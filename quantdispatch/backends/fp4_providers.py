"""Which native NVFP4 GEMM providers the cutlass backend can call, at which versions, and how.

A binding is one row: a provider, the version range our adapter was written for (from the
provider's released build: docs/design/native-fp4.md, section 5, has the sources), the GEMM
entry point and its argument convention, and which activation quantizer runs before it. A
provider outside its row is refused with its version in the reason.

* sgl-kernel >= 0.3.21, < 0.4: ``sgl_kernel.cutlass_scaled_fp4_mm(a, b, block_scale_a,
  block_scale_b, alpha, out_dtype) -> out`` and ``sgl_kernel.scaled_fp4_quant(input,
  input_global_scale) -> (packed, block_scale)``.
* vLLM >= 0.33, < 0.34: ``torch.ops._C.cutlass_scaled_fp4_mm(out!, a, b, block_scale_a,
  block_scale_b, alpha) -> ()``, activations quantized by quantdispatch (the same rule; vLLM's
  ``scaled_fp4_quant`` changed its schema across releases, ours does not).

Both GEMMs: ``a`` uint8 [M, K/2] and ``b`` uint8 [N, K/2], both row-major (K contiguous), e2m1
codes with element 2j in the low nibble; block scales float8_e4m3fn 2-D [round_up(rows, 128),
round_up(K/16, 4)] in the 128x4 swizzled layout; ``alpha`` fp32 one element = a * w (applied
to the fp32 accumulator); K and N multiples of 32; output bf16 / fp16 (fp32 on the sm100 family
only). Nothing here imports a provider: packages are detected from their metadata, modules are
imported and libraries loaded when a weight is prepared.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from quantdispatch.device.providers import (
    KNOWN,
    Detections,
    Version,
    installed_version,
    parse_version,
    range_text,
)
from quantdispatch.errors import BackendUnavailableError, format_error

__all__ = [
    "BINDINGS",
    "GEMM_ARGS",
    "Fp4Binding",
    "Fp4ProviderStatus",
    "active",
    "load",
    "reset",
    "statuses",
]

#: Argument names of the registered GEMM op (checked before vLLM's op is called).
GEMM_ARGS = ["out", "a", "b", "block_scale_a", "block_scale_b", "alpha"]


@dataclass(frozen=True)
class Fp4Binding:
    """One provider's version range and how the adapter calls it."""

    provider: str
    """A name of the provider registry (``quantdispatch.device.providers.KNOWN``)."""
    min_version: Version
    below_version: Version
    gemm: str
    quantizer: str
    """"provider": its own NVFP4 quantizer; "quantdispatch": ours (Triton on GPUs)."""
    source: str

    def covers(self, version: Version) -> bool:
        return self.min_version <= version < self.below_version

    def range_text(self) -> str:
        return range_text(self.min_version, self.below_version)


BINDINGS: tuple[Fp4Binding, ...] = (
    Fp4Binding(
        "sgl-kernel",
        (0, 3, 21),
        (0, 4, 0),
        "sgl_kernel.cutlass_scaled_fp4_mm",
        "provider",
        "sgl-kernel 0.3.21 wheel: sgl_kernel/gemm.py, op schema and cubins of sm100/common_ops",
    ),
    Fp4Binding(
        "vllm",
        (0, 33, 0),
        (0, 34, 0),
        "torch.ops._C.cutlass_scaled_fp4_mm",
        "quantdispatch",
        "vLLM 0.33.0 wheel: op schema and cubins of _C_stable_libtorch.abi3.so",
    ),
)

_INSTALL = {
    "sgl-kernel": "pip install 'sgl-kernel>=0.3.21,<0.4' (its wheels pin a torch/CUDA pair)",
    "vllm": "pip install 'vllm>=0.33,<0.34', or load its library with "
    "quantdispatch.backends.marlin_providers.load_library(path, provider='vllm', version=...)",
}


@dataclass(frozen=True)
class Fp4ProviderStatus:
    """One provider as this process sees it: its version and row, or why it cannot be used."""

    name: str
    version: str | None
    binding: Fp4Binding | None
    reason: str | None = None

    @property
    def usable(self) -> bool:
        return self.binding is not None

    def describe(self) -> str:
        if self.usable:
            return f"{self.name} {self.version} ({self.binding.gemm})"  # type: ignore[union-attr]
        return f"{self.name}: {self.reason}"


#: A package's installed version (this module's own name for it: tests stand in fake versions).
_dist_version = installed_version


def _installed_version(binding: Fp4Binding) -> str | None:
    """The provider's version: package metadata, or (vLLM) a library an engine registered."""
    if binding.provider == "vllm":
        from quantdispatch.backends import marlin_providers

        for status in marlin_providers.statuses():
            if status.name == "vllm" and status.installed:
                return status.version
        return None
    return _dist_version(KNOWN[binding.provider].distribution)


def _detect(binding: Fp4Binding) -> Fp4ProviderStatus:
    version = _installed_version(binding)
    name = binding.provider
    if version is None:
        return Fp4ProviderStatus(name, None, None, f"not installed ({_INSTALL[name]})")
    parsed = parse_version(version)
    if parsed is None or not binding.covers(parsed):
        return Fp4ProviderStatus(
            name,
            version,
            None,
            f"version {version} is outside the range the NVFP4 binding was written for "
            f"({name} {binding.range_text()})",
        )
    return Fp4ProviderStatus(name, version, binding)


_detections: Detections[Fp4ProviderStatus] = Detections()


def statuses() -> tuple[Fp4ProviderStatus, ...]:
    """Every binding's provider, detected once per process (``reset`` forgets)."""
    return _detections.all(BINDINGS, lambda b: b.provider, _detect)


def active() -> Fp4ProviderStatus | None:
    """The provider the cutlass backend uses: the first usable one (sgl-kernel before vLLM)."""
    return next((s for s in statuses() if s.usable), None)


def reset() -> None:
    """Forget detections (tests; a process that installs a provider)."""
    _detections.forget()


def _unavailable(status: Fp4ProviderStatus, what: str, fix: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        format_error(
            f"{status.name} {status.version}: {what}",
            "the cutlass backend calls the provider's compiled NVFP4 GEMM",
            fix,
        )
    )


def load(status: Fp4ProviderStatus):
    """Import / load the provider and return its module (sgl-kernel) or op (vLLM); raise
    BackendUnavailableError with the reason when it is not there as the binding expects."""
    if status.binding is None:
        raise _unavailable(status, str(status.reason), _INSTALL[status.name])
    if status.name == "sgl-kernel":
        try:
            mod = importlib.import_module("sgl_kernel")
        except Exception as exc:  # OSError from a CUDA library counts as "cannot be used"
            raise _unavailable(
                status,
                f"import sgl_kernel failed ({type(exc).__name__}: {exc})",
                _INSTALL[status.name],
            ) from exc
        missing = [f for f in ("cutlass_scaled_fp4_mm", "scaled_fp4_quant") if not hasattr(mod, f)]
        if missing:
            raise _unavailable(
                status, f"sgl_kernel has no {', '.join(missing)}", _INSTALL[status.name]
            )
        return mod
    from quantdispatch.backends import marlin_providers

    vllm = next(s for s in marlin_providers.statuses() if s.name == "vllm")
    if not hasattr(torch.ops._C, "cutlass_scaled_fp4_mm") and vllm.contract is not None:
        marlin_providers.ensure_loaded(vllm, roles=())
    try:
        op = torch.ops._C.cutlass_scaled_fp4_mm
        args = [a.name for a in op.default._schema.arguments]
    except Exception as exc:  # not registered
        raise _unavailable(
            status,
            f"torch.ops._C.cutlass_scaled_fp4_mm is not registered ({exc})",
            _INSTALL["vllm"],
        ) from exc
    if args != GEMM_ARGS:
        raise _unavailable(
            status,
            f"_C::cutlass_scaled_fp4_mm takes ({', '.join(args)}), not ({', '.join(GEMM_ARGS)})",
            "use a vLLM version from the binding table (fp4_providers.BINDINGS)",
        )
    return op

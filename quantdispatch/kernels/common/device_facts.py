"""What the kernels take from the GPU, asked once per device and passed down.

:func:`device_facts` asks the driver, torch and Triton once per device (cached); the backend
asks it at each call (a dictionary lookup) and hands the object to the plans and launchers.
:meth:`DeviceFacts.for_capability` answers from a compute capability alone, for the simulated
GPUs doctor explains. No triton import at module level (doctor runs without it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quantdispatch.capability import SM90_PLUS

__all__ = ["DeviceFacts", "device_facts", "has_host_descriptors"]

#: Opt-in shared memory per block (bytes) by compute capability where torch does not report
#: it: 163 KB on A100 / Orin, 227 KB on Hopper and datacenter Blackwell, 99 KB on the others
#: (RTX 30 / 40 / 50 series, L40S, A10).
_SHARED_BY_CAPABILITY = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): 227 * 1024,
                         (10, 0): 227 * 1024, (10, 3): 227 * 1024}  # fmt: skip
_SHARED_DEFAULT = 99 * 1024
#: Off the GPU (the Triton interpreter): the H100 / H200's SM count and shared memory, so plans
#: pick the tiles they pick there.
_CPU_SMS = 132
_CPU_SHARED = 227 * 1024


@dataclass(frozen=True)
class DeviceFacts:
    """One device as the kernels see it.

    ``compiled``: a CUDA GPU that runs compiled kernels (not Triton's CPU interpreter; PTX
    kernels need it). ``grouped_mm``: torch._grouped_mm runs there (SM 9.0+). ``tma``: tiles
    may load by TMA (SM 9.0+ and Triton's host tensor descriptors). ``dependent_launches``:
    programmatic dependent launches are possible (SM 9.0+ and Triton's grid dependency
    control; whether a call uses them is the caller's ``pdl`` argument). ``rs_wgmma_hazard``:
    the wgmma guard's verdict (:mod:`.wgmma_guard`): kernels settle their accumulators."""

    name: str
    capability: tuple[int, int] | None
    sm_count: int
    shared_bytes: int
    compiled: bool = False
    grouped_mm: bool = False
    tma: bool = False
    dependent_launches: bool = False
    rs_wgmma_hazard: bool = False

    @classmethod
    def for_capability(
        cls, capability: tuple[int, int] | None, sm_count: int | None = None
    ) -> DeviceFacts:
        """The facts of a GPU of ``capability`` with the installed torch and Triton (None: a
        CPU), without asking a device: doctor's simulated GPUs."""
        if capability is None:
            return _cpu_facts()
        hopper = capability in SM90_PLUS
        return cls(
            name=f"SM {capability[0]}.{capability[1]}",
            capability=capability,
            sm_count=sm_count or _CPU_SMS,
            shared_bytes=_SHARED_BY_CAPABILITY.get(capability, _SHARED_DEFAULT),
            compiled=True,
            grouped_mm=hopper and hasattr(torch, "_grouped_mm"),
            tma=hopper and has_host_descriptors(),
            dependent_launches=hopper and _grid_dependency_control(),
            rs_wgmma_hazard=_wgmma_hazard(capability),
        )


def _cpu_facts() -> DeviceFacts:
    return DeviceFacts("cpu", None, _CPU_SMS, _CPU_SHARED)


@functools.cache
def device_facts(device: torch.device) -> DeviceFacts:
    """The facts of ``device``, asked once (a CPU: no GPU facts)."""
    if device.type != "cuda":
        return _cpu_facts()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    capability = (props.major, props.minor)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    shared = int(optin) if optin else _SHARED_BY_CAPABILITY.get(capability, _SHARED_DEFAULT)
    compiled = not _interpreting()
    hopper = capability in SM90_PLUS
    return DeviceFacts(
        name=torch.cuda.get_device_name(idx),
        capability=capability,
        sm_count=int(props.multi_processor_count),
        shared_bytes=shared,
        compiled=compiled,
        grouped_mm=compiled and hopper and hasattr(torch, "_grouped_mm"),
        tma=hopper and has_host_descriptors(),
        dependent_launches=hopper and _grid_dependency_control(),
        rs_wgmma_hazard=_wgmma_hazard(capability),
    )


def _interpreting() -> bool:
    try:
        from quantdispatch.kernels.common.interpreter import interpreting
    except ImportError:  # no triton: nothing is interpreted
        return False
    return interpreting()


def _grid_dependency_control() -> bool:
    try:
        from quantdispatch.kernels.common.pdl import HAS_GDC
    except ImportError:  # no triton
        return False
    return HAS_GDC


def _wgmma_hazard(capability: tuple[int, int]) -> bool:
    try:
        from quantdispatch.kernels.common.wgmma_guard import rs_wgmma_hazard
    except ImportError:  # no triton: no kernels to guard
        return False
    return rs_wgmma_hazard(capability)


@functools.cache
def has_host_descriptors() -> bool:
    """Whether the installed Triton makes TMA descriptors on the host (triton.tools.
    tensor_descriptor, Triton 3.3+)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True

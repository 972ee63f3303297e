"""Grid dependency control: programmatic dependent launch (PDL) on SM 9.0+.

Why: a small kernel's fixed cost (launch, the first loads' latency) is a large share of its time
at decode sizes. Launched as a programmatic dependent launch, a kernel may start while the
kernel before it in the stream still runs, load what does not depend on it (weights, routing),
and wait (``griddepcontrol.wait``: the earlier kernel complete, its writes visible) only before
it reads that kernel's outputs or writes any memory. A kernel that calls
``gdc_launch_dependents`` lets the next one start early; both are no-ops without PDL.

The rule every PDL kernel here keeps: before its wait it reads only memory that its immediate
predecessor in the stream cannot have written, and it releases its own dependents only after
its own wait (so theirs never run ahead of an unfinished kernel further back).
``QUANTDISPATCH_PDL=0`` turns PDL off (every launch then waits for the kernel before it).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton

from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.kernels.configs import device_info

try:  # Triton 3.3+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: pdl_capable() is False, never traced
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


__all__ = ["HAS_GDC", "PDL_ENV", "gdc_launch_dependents", "gdc_wait", "pdl_capable", "pdl_enabled"]

PDL_ENV = "QUANTDISPATCH_PDL"


@cache
def pdl_enabled() -> bool:
    """``QUANTDISPATCH_PDL``: 1 (default) lets kernels use PDL where the GPU has it, 0 never.
    Read once per process."""
    raw = os.environ.get(PDL_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ConfigurationError(
            format_error(
                f"{PDL_ENV}={raw!r}",
                "it is 1 (programmatic dependent launches on SM 9.0+) or 0 (never)",
                f"set {PDL_ENV}=0 or 1, or unset it",
            )
        )
    return raw == "1"


def pdl_capable(device: torch.device) -> bool:
    """A CUDA GPU of SM 9.0+, a Triton with grid dependency control, and PDL not turned off
    (``QUANTDISPATCH_PDL=0``)."""
    return HAS_GDC and device.type == "cuda" and device_info(device)[1] >= (9, 0) and pdl_enabled()

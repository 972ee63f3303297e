"""Grid dependency control: programmatic dependent launch (PDL) on SM 9.0+.

Why: a small kernel's fixed cost (launch, the first loads' latency) is a large share of its time
at decode sizes. Launched as a programmatic dependent launch, a kernel may start while the
kernel before it in the stream still runs, load what does not depend on it (weights, routing),
and wait (``griddepcontrol.wait``: the earlier kernel complete, its writes visible) only before
it reads that kernel's outputs or writes any memory. A kernel that calls
``gdc_launch_dependents`` lets the next one start early; both are no-ops without PDL.

The rule every PDL kernel here keeps: before its wait it reads only memory that its immediate
predecessor in the stream cannot have written, and it releases its own dependents only after
its own wait (so theirs never run ahead of an unfinished kernel further back). Where the
dependent has nothing to load early, release it late (after the work, not at the top): its
waiting programs would hold SM slots from the start (docs/design/wgmma-gemm.md).
``QUANTDISPATCH_PDL=0`` turns PDL off (every launch then waits for the kernel before it).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton

from quantdispatch.errors import ConfigurationError
from quantdispatch.kernels.common.configs import device_info
from quantdispatch.settings import ENV_PREFIX, parse_pdl

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

PDL_ENV = ENV_PREFIX + "PDL"


def pdl_enabled() -> bool:
    """``QUANTDISPATCH_PDL`` (a setting, :mod:`quantdispatch.settings`): unset or true lets
    kernels use PDL where the GPU has it; 0 / false never. A malformed value raises."""
    return _parse(os.environ.get(PDL_ENV))


@cache
def _parse(raw: str | None) -> bool:
    try:
        return parse_pdl(raw)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None


def pdl_capable(device: torch.device) -> bool:
    """A CUDA GPU of SM 9.0+, a Triton with grid dependency control, and PDL not turned off
    (``QUANTDISPATCH_PDL=0``)."""
    return HAS_GDC and device.type == "cuda" and device_info(device)[1] >= (9, 0) and pdl_enabled()

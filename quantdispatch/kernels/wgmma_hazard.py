"""A Triton bug our Hopper kernels step around: register-operand wgmma pipelined unsafely.

Several of our ``tl.dot`` kernels decode the weight in registers and hand it to the MMA as its
*A* operand (the mid-M GEMM on the mma16x64 layout, the swap-AB tiles of the checkpoint-layout
FP4 and FP8 kernels). On SM 9.x Triton lowers these to ``wgmma.mma_async`` with A in registers
("RS"). When it also pipelines the loop (``num_stages`` >= 2), Triton before 3.7 splits the dot
into several wgmmas, waits only for ``pendings = N - 1`` of them, and lets the next iteration's
decode overwrite the A registers of wgmmas that may not have read them yet. The PTX ISA makes
that undefined behaviour; upstream: triton-lang/triton#9433, fixed by #9514 (Triton 3.7).

What we saw on the H200 (Triton 3.6, benchmarks/NOTES.md, session 8): tiles whose decode starts
earlier (activations by TMA, words already in registers) returned wrong results intermittently
(relative error 1-14% instead of 2e-3), and the Triton 3.6 PTX of every pipelined RS tile has
``wgmma.wait_group 7`` (or 3) at the end of the loop body and no wait 0. With
``num_stages = 1`` the same kernels get one ``wait_group 0`` per step (checked in the PTX of
Triton 3.6 for the GEMM, its TMA variant and the swap-AB checkpoint kernel); Triton 3.7 emits
the fixed pattern for pipelined tiles (checked too: ``benchmarks/wgmma_waits.py``).

So on SM 9.x with Triton < 3.7 every launch whose MMA takes a decoded A operand runs with one
stage: slower (its loads no longer overlap the MMA), never wrong.
"""

from __future__ import annotations

import re
from functools import cache

import torch
import triton

__all__ = ["FIXED_IN", "rs_wgmma_hazard", "safe_stages", "triton_version"]

#: The first Triton release whose pipeliner keeps register-operand wgmma inputs intact.
FIXED_IN: tuple[int, int] = (3, 7)


@cache
def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton; (0, 0) when the version string is unreadable
    (treated as affected)."""
    found = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def rs_wgmma_hazard(device: torch.device) -> bool:
    """Whether pipelined register-operand wgmma is unsafe for launches on ``device``: a CUDA
    GPU of SM 9.x (the only wgmma generation) with Triton older than :data:`FIXED_IN`."""
    if device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return triton_version() < FIXED_IN


def safe_stages(stages: int, device: torch.device) -> int:
    """``num_stages`` for a launch whose MMA takes its A operand from registers: 1 where
    :func:`rs_wgmma_hazard` holds (one ``wgmma.wait_group 0`` per step), else ``stages``."""
    return 1 if rs_wgmma_hazard(device) else stages

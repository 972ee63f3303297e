"""A Triton bug our Hopper kernels step around: register-operand wgmma pipelined unsafely.

Several of our ``tl.dot`` kernels decode the weight in registers and hand it to the MMA as its
*A* operand (the mid-M GEMM on the mma16x64 layout, the MoE grouped GEMM, the swap-AB tiles of
the checkpoint-layout FP4 and FP8 kernels). On SM 9.x Triton lowers these to
``wgmma.mma_async`` with A in registers ("RS"). When it also pipelines the loop
(``num_stages`` >= 2), Triton before 3.7 splits the dot into several wgmmas, waits only for
``pendings = N - 1`` of them, and lets the next iteration's decode overwrite the A registers of
wgmmas that may not have read them yet. The PTX ISA makes that undefined behaviour; upstream:
triton-lang/triton#9433, fixed by #9514 (Triton 3.7).

On the H200 with Triton 3.6, tiles whose decode starts earlier (activations by TMA, words
already in registers) returned wrong results intermittently, and the Triton 3.6 PTX of every
pipelined RS tile has ``wgmma.wait_group 7`` (or 3) at the end of the loop body and no wait 0
(docs/design/wgmma-gemm.md). With
``num_stages = 1`` the same kernels get one ``wait_group 0`` per step and no instruction writes
an A register of a pending wgmma group in the SASS (``benchmarks/probes/wgmma_waits.py``, Triton
3.6 and 3.7); Triton 3.7 emits upstream's fixed pattern for pipelined tiles.

So on SM 9.x every such kernel reads its accumulator inside each K step (:func:`settle`, an
identity that ptxas removes): Triton must then wait for the step's wgmmas (``wait_group 0``)
before anything later in the step, and so before the next step's decode writes registers, while
its loads stay pipelined (``num_stages`` as tuned). ``benchmarks/probes/wgmma_waits.py`` checks
every kernel: settled, Triton 3.6, 3.7 and 3.9 give one ``wait_group 0`` per step, no SASS write to
an A register of a pending wgmma group, and the same cp.async / TMA stages as unsettled
(benchmarks/results/rs-wgmma-hazard-h200-*/wgmma-waits-*-settled.txt). One stage per launch is
safe too, but loses the load pipelining.

That includes Triton 3.7+: its fixed pipeliner is upstream's claim, not yet checked by us on a GPU,
and in its SASS of our GEMM instructions still write registers that in-flight wgmma groups read
(Triton 3.9: none; ptxas may manage those itself, the SASS alone cannot tell). Once a GPU run shows
a version safe for our kernels, :data:`VERIFIED_SAFE_FROM` names it and the settle goes from that
version on.
"""

from __future__ import annotations

import re
from functools import cache

import triton
import triton.language as tl

from quantdispatch.capability import SM9X

__all__ = [
    "UPSTREAM_FIX",
    "VERIFIED_SAFE_FROM",
    "rs_wgmma_hazard",
    "settle",
    "triton_version",
]

#: The first Triton release with upstream's fix (triton-lang/triton#9514).
UPSTREAM_FIX: tuple[int, int] = (3, 7)
#: The first Triton release verified on a GPU to pipeline our register-operand wgmma loops
#: correctly; None: none yet, so every version settles them. Setting it also means re-sweeping
#: the mid-M GEMM's TMA tiles (:data:`..mma_layout.gemm_tiles._TMA_TILES` holds the settled
#: winners).
VERIFIED_SAFE_FROM: tuple[int, int] | None = None


@cache
def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton; (0, 0) when the version string is unreadable
    (treated as affected)."""
    found = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def rs_wgmma_hazard(capability: tuple[int, int] | None) -> bool:
    """Whether pipelined register-operand wgmma is not known safe on a GPU of ``capability``
    (None: not a GPU): SM 9.x (the only wgmma generation) with a Triton older than
    :data:`VERIFIED_SAFE_FROM` (every Triton while that is None). Launchers read it from
    :class:`.device_facts.DeviceFacts`."""
    if capability not in SM9X:
        return False
    return VERIFIED_SAFE_FROM is None or triton_version() < VERIFIED_SAFE_FROM


@triton.jit
def settle(acc):
    """``acc`` unchanged, but read inside the K step (``mov`` to itself, removed by ptxas), so
    Triton waits for the wgmmas that produced it (``wait_group 0``) before the rest of the step.
    Call it on every accumulator after the step's last ``tl.dot`` when ``SETTLE`` (the device's
    :func:`rs_wgmma_hazard`) is set."""
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1
    )

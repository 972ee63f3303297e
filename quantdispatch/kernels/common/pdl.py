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
Whether a call uses PDL is its launcher's ``pdl`` argument (the layer passes its decision's
``Settings.pdl``, ``QUANTDISPATCH_PDL``), and only where :class:`.device_facts.DeviceFacts` has
``dependent_launches``; nothing here reads the environment.
"""

from __future__ import annotations

import triton

try:  # Triton 3.3+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: no dependent launches, never traced
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


__all__ = ["HAS_GDC", "gdc_launch_dependents", "gdc_wait"]

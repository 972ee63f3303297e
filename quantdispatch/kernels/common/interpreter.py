"""Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1 when the kernels were built)."""

from __future__ import annotations

import triton

__all__ = ["interpreting"]


@triton.jit
def _probe():
    pass


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at
    import): decided by a kernel object itself, so a later change of the env var cannot make
    the wrappers and the kernels disagree."""
    return type(_probe).__name__ == "InterpretedFunction"

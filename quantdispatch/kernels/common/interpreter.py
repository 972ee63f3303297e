"""Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1 when the kernels were built).
Imports without triton (then nothing is interpreted)."""

from __future__ import annotations

try:
    import triton
except ImportError:  # triton is optional: the kernels that need it are never built
    triton = None

__all__ = ["interpreting"]

if triton is not None:

    @triton.jit
    def _probe():
        pass


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at
    import): decided by a kernel object itself, so a later change of the env var cannot make
    the wrappers and the kernels disagree. False without triton."""
    return triton is not None and type(_probe).__name__ == "InterpretedFunction"

"""The scope in which the FP8 linears of an HF model share quantized activations.

The handoff itself is a plain data structure (:class:`ActivationHandoff`, in kernels/); this
module owns the one the HF integration uses and opens it: inside :func:`sharing` the triton
backend hands it to its FP8 prefill kernels (``backends.triton.fp8_compute.handing_off``) and
the fused norms / MLPs offer their codes to it (:func:`offer`). A scope promises that nothing
writes an activation's memory except through torch while it is open (an HF decoder layer's
plain torch ops keep that promise; a Triton kernel writing a persistent buffer, or a compiled
graph reusing one, would not bump the version counter the handoff's key holds). Scopes nest;
leaving the outermost empties this thread's slot. An engine may open its own scope.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from quantdispatch.backends.triton.fp8_compute import handing_off
from quantdispatch.kernels.native.fp8_handoff import ActivationHandoff

__all__ = ["clear", "counts", "handoff", "offer", "sharing"]

_HANDOFF = ActivationHandoff()
_local = threading.local()


def handoff() -> ActivationHandoff:
    """The handoff the scopes open (per-thread slots inside)."""
    return _HANDOFF


@contextlib.contextmanager
def sharing() -> Iterator[None]:
    """A scope in which the FP8 linears share quantized activations (module doc: nothing may
    write an activation's memory except through torch while it is open). Nests; leaving the
    outermost scope empties the slot."""
    outer = getattr(_local, "depth", 0) == 0
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with handing_off(_HANDOFF) if outer else contextlib.nullcontext():
            yield
    finally:
        _local.depth -= 1
        if _local.depth == 0:
            _HANDOFF.empty()


def offer(x: torch.Tensor, codes: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Inside a scope, keep a producer's FP8 ``codes`` (e4m3, ``scale_a``) of x for its
    readers; nothing outside one (or without codes)."""
    if codes is not None and getattr(_local, "depth", 0) > 0:
        _HANDOFF.offer(x, *codes)


def clear() -> None:
    """Empty this thread's slot and zero its counts."""
    _HANDOFF.clear()


def counts() -> dict[str, int]:
    """This thread's FP8 linears that found their codes in the handoff (``hits``) or
    quantized inside a scope (``misses``) since :func:`clear`: what a benchmark or test reads
    to see the sharing happen."""
    return _HANDOFF.counts()

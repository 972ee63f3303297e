"""One quantized activation handed from its producer to every FP8 linear that reads it.

Sibling projections read the same activation (q / k / v after one norm, gate / up after
another): with FP8 compute each would quantize it again. Inside a :func:`sharing` scope the
slot here keeps the last quantized activation (e4m3 codes and ``scale_a``, per token and per 128
columns, M padded to 16: the layout both block recipes take) with a key that proves it is the
same data:

- the memory (data pointer, shape, strides, dtype, device) and the tensor's version counter,
  which every in-place torch write bumps, so a changed activation misses;
- a weak reference to the activation's root tensor (its ``_base``, or itself) whose callback
  empties the slot: the codes live no longer than the activation, and freed memory reused by
  another tensor at the same address can never match;
- the CUDA stream it was produced on (another stream misses, as the allocator would let it
  reuse the codes' memory while that stream reads them).

Why a scope: a kernel launched from Python that writes a tensor's memory directly (a Triton
kernel into a persistent buffer, a compiled graph reusing a buffer) does not bump its version
counter, so an engine that rewrites one activation buffer layer after layer would find the
previous layer's codes. Outside a scope nothing is kept or shared; a scope promises that
nothing writes the activations behind torch's back while it is open. The HF integration opens
one around each decoder layer it sets up (plain torch ops only), an engine may open its own.
Leaving the outermost scope empties the slot. Nothing is shared while compiling, for tensor
subclasses, or for tensors made under ``torch.inference_mode`` (no version counter).

A fused producer (:mod:`.fp8_producers`) offers its output's codes here, so the first linear
finds them too.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

__all__ = ["clear", "counts", "lookup", "offer", "quantized", "sharing"]

_Codes = tuple[torch.Tensor, torch.Tensor]
_local = threading.local()


def _root(x: torch.Tensor) -> torch.Tensor:
    return x._base if x._base is not None else x


def _key(x: torch.Tensor) -> tuple:
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
    return (
        x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version, stream,
    )  # fmt: skip


@contextlib.contextmanager
def sharing() -> Iterator[None]:
    """A scope in which the FP8 linears share quantized activations (module doc: nothing may
    write an activation's memory except through torch while it is open). Nests; leaving the
    outermost scope empties the slot."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        if _local.depth == 0:
            _local.slot = None


def _usable(x: torch.Tensor) -> bool:
    # inference tensors have no version counter, so an in-place write could not be seen
    return (
        getattr(_local, "depth", 0) > 0
        and not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and x.dim() == 2
        and not x.is_inference()
    )


def clear() -> None:
    """Empty this thread's slot and zero its counts."""
    _local.slot = None
    _local.hits = _local.misses = 0


def counts() -> dict[str, int]:
    """This thread's linears that found their codes here (``hits``) or quantized (``misses``)
    since :func:`clear`: what a benchmark or test reads to see the sharing happen."""
    return {"hits": getattr(_local, "hits", 0), "misses": getattr(_local, "misses", 0)}


def lookup(x: torch.Tensor) -> _Codes | None:
    """The codes and ``scale_a`` offered for exactly this x [M, K] in the open scope, or
    None."""
    slot = getattr(_local, "slot", None)
    if slot is None or not _usable(x):
        return None
    ref, key, codes = slot
    if ref() is not _root(x) or key != _key(x):
        return None
    return codes


def offer(x: torch.Tensor, xq: torch.Tensor, scale_a: torch.Tensor) -> None:
    """Inside a :func:`sharing` scope, keep (``xq``, ``scale_a``), the block-quantized form of
    x [M, K], for the next readers of x; replaces what the slot held."""
    if not _usable(x):
        return

    def emptied(_ref: weakref.ref, local: threading.local = _local) -> None:
        slot = getattr(local, "slot", None)
        if slot is not None and slot[0] is _ref:
            local.slot = None

    ref = weakref.ref(_root(x), emptied)
    _local.slot = (ref, _key(x), (xq, scale_a))


def quantized(x: torch.Tensor, quantize: Callable[[torch.Tensor], _Codes]) -> _Codes:
    """x's codes from the slot, or ``quantize(x)`` offered to it."""
    codes = lookup(x)
    if codes is None:
        codes = quantize(x)
        offer(x, *codes)
        _local.misses = getattr(_local, "misses", 0) + 1
    else:
        _local.hits = getattr(_local, "hits", 0) + 1
    return codes

"""One quantized activation handed from its producer to every FP8 linear that reads it.

Sibling projections read the same activation (q / k / v after one norm, gate / up after
another): with FP8 compute each would quantize it again. The slot here keeps the last
quantized activation (e4m3 codes and ``scale_a``, per token and per 128 columns, M padded to
16: the layout both block recipes take) with a key that proves it is the same data:

- the memory (data pointer, shape, strides, dtype, device) and the tensor's version counter,
  which every in-place write bumps, so a changed activation misses;
- a weak reference to the activation's root tensor (its ``_base``, or itself) whose callback
  empties the slot: the codes live no longer than the activation, and freed memory reused by
  another tensor at the same address can never match;
- the CUDA stream it was produced on (another stream misses, as the allocator would let it
  reuse the codes' memory while that stream reads them).

A fused producer (:mod:`.fp8_producers`) offers its output's codes here, so the first linear
finds them too. Nothing is kept while compiling or tracing: the layers call the kernels
directly only in eager mode (``layers.base.direct_call_ok``), and inside a custom op's body the
tensors are the op's arguments, so the key works the same. Tensors made under
``torch.inference_mode`` have no version counter: they are never shared (each linear quantizes).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

__all__ = ["clear", "counts", "lookup", "offer", "quantized"]

_Codes = tuple[torch.Tensor, torch.Tensor]
_local = threading.local()


def _root(x: torch.Tensor) -> torch.Tensor:
    return x._base if x._base is not None else x


def _key(x: torch.Tensor) -> tuple:
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
    return (
        x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version, stream,
    )  # fmt: skip


def _usable(x: torch.Tensor) -> bool:
    # inference tensors have no version counter, so an in-place write could not be seen
    return (
        not torch.compiler.is_compiling()
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
    """The codes and ``scale_a`` offered for exactly this x [M, K], or None."""
    slot = getattr(_local, "slot", None)
    if slot is None or not _usable(x):
        return None
    ref, key, codes = slot
    if ref() is not _root(x) or key != _key(x):
        return None
    return codes


def offer(x: torch.Tensor, xq: torch.Tensor, scale_a: torch.Tensor) -> None:
    """Keep (``xq``, ``scale_a``), the block-quantized form of x [M, K], for the next readers
    of x; replaces what the slot held."""
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

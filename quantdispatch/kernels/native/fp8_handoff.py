"""One quantized activation handed from its producer to every FP8 linear that reads it: a
plain data structure, :class:`ActivationHandoff`, that the caller makes, owns and passes to
the kernels (no state in this module).

Sibling projections read the same activation (q / k / v after one norm, gate / up after
another): with FP8 compute each would quantize it again. A handoff keeps the last quantized
activation (e4m3 codes and ``scale_a``, per token and per 128 columns, M padded to 16: the
layout both block recipes take) per thread, with a key that proves it is the same data:

- the memory (data pointer, shape, strides, dtype, device) and the tensor's version counter,
  which every in-place torch write bumps, so a changed activation misses;
- a weak reference to the activation's root tensor (its ``_base``, or itself) whose callback
  empties the slot: the codes live no longer than the activation, and freed memory reused by
  another tensor at the same address can never match;
- the CUDA stream it was produced on (another stream misses, as the allocator would let it
  reuse the codes' memory while that stream reads them).

A kernel launched from Python that writes a tensor's memory directly (a Triton kernel into a
persistent buffer, a compiled graph reusing a buffer) does not bump its version counter, so
whoever hands a handoff to the kernels promises that nothing writes the activations behind
torch's back meanwhile (the HF integration's scope:
quantdispatch.integrations.transformers.fp8_handoff). Nothing is shared while compiling, for
tensor subclasses, or for tensors made under ``torch.inference_mode`` (no version counter).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

__all__ = ["ActivationHandoff"]

Codes = tuple[torch.Tensor, torch.Tensor]


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


class ActivationHandoff:
    """The last offered activation's codes, per thread, and how many readers found them."""

    def __init__(self) -> None:
        self._local = threading.local()

    def slot(self) -> tuple | None:
        """This thread's slot (weak reference, key, codes), or None when empty."""
        return getattr(self._local, "slot", None)

    def empty(self) -> None:
        """Empty this thread's slot (the counts stay)."""
        self._local.slot = None

    def clear(self) -> None:
        """Empty this thread's slot and zero its counts."""
        self._local.slot = None
        self._local.hits = self._local.misses = 0

    def counts(self) -> dict[str, int]:
        """This thread's readers that found their codes here (``hits``) or quantized
        (``misses``) since :meth:`clear`."""
        local = self._local
        return {"hits": getattr(local, "hits", 0), "misses": getattr(local, "misses", 0)}

    def lookup(self, x: torch.Tensor) -> Codes | None:
        """The codes and ``scale_a`` offered for exactly this x [M, K], or None."""
        slot = self.slot()
        if slot is None or not _usable(x):
            return None
        ref, key, codes = slot
        if ref() is not _root(x) or key != _key(x):
            return None
        return codes

    def offer(self, x: torch.Tensor, xq: torch.Tensor, scale_a: torch.Tensor) -> None:
        """Keep (``xq``, ``scale_a``), the block-quantized form of x [M, K], for the next
        readers of x; replaces what the slot held."""
        if not _usable(x):
            return

        def emptied(_ref: weakref.ref, local: threading.local = self._local) -> None:
            slot = getattr(local, "slot", None)
            if slot is not None and slot[0] is _ref:
                local.slot = None

        ref = weakref.ref(_root(x), emptied)
        self._local.slot = (ref, _key(x), (xq, scale_a))

    def quantized(self, x: torch.Tensor, quantize: Callable[[torch.Tensor], Codes]) -> Codes:
        """x's codes from the slot, or ``quantize(x)`` offered to it."""
        local = self._local
        codes = self.lookup(x)
        if codes is None:
            codes = quantize(x)
            self.offer(x, *codes)
            local.misses = getattr(local, "misses", 0) + 1
        else:
            local.hits = getattr(local, "hits", 0) + 1
        return codes

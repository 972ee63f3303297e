"""Fused rotary embedding in HF attention layers: one kernel where eager HF runs ten.

The attention forwards of the Llama family call their module's ``apply_rotary_pos_emb`` by its
global name. A patched attention module runs its class's own forward, unchanged, as a copy of
that function whose globals differ in one name: ``apply_rotary_pos_emb`` is
:func:`fused_apply_rotary`, which runs the kernel of :mod:`quantdispatch.kernels.native.rope`
for eager CUDA calls in the layout it takes and the module's own function for every other call
(autograd, CPU tensors, other layouts); without triton nothing is patched. Under torch.compile
the class's own forward runs (dynamo guards a function's globals as its module's, so it must not
trace the copy; inductor fuses the rotation itself). Nothing global changes: other modules of
the same class, and other models, keep the original forward. The kernel's results are HF's bit
for bit.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable

import torch
from torch import nn

from quantdispatch.layers.base import direct_call_ok

__all__ = [
    "ATTENTION_CLASSES",
    "attention_ok",
    "fused_apply_rotary",
    "rotary_attention_forward",
    "rotary_forward",
]

#: Attention modules whose forward applies ``apply_rotary_pos_emb(q, k, cos, sin)`` of their
#: module to the projections (LlamaAttention's copies).
ATTENTION_CLASSES = frozenset(
    {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
     "Qwen3MoeAttention"}
)  # fmt: skip
_NAME = "apply_rotary_pos_emb"


def _kernel_call(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Eager inference on CUDA tensors (tests widen this to the CPU interpreter)."""
    return q.is_cuda and direct_call_ok(q) and direct_call_ok(k)


def fused_apply_rotary(original: Callable[..., object]) -> Callable[..., object] | None:
    """``apply_rotary_pos_emb`` that runs the fused kernel where it can, else ``original``;
    None where the kernel cannot be imported (no triton): then nothing is patched. The kernel
    module is imported here, once, not per call."""
    try:
        from quantdispatch.kernels.native import rope as kernel
    except ImportError:
        return None

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):  # type: ignore[no-untyped-def]
        default = not args and kwargs.get("unsqueeze_dim", 1) == 1 and len(kwargs) <= 1
        if (
            default
            and (not kwargs or "unsqueeze_dim" in kwargs)
            and _kernel_call(q, k, cos, sin)
            and kernel.rope_eligible(q, k, cos, sin)
        ):
            return kernel.rope_launch(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rebuilt(fn, inner, new_inner):  # type: ignore[no-untyped-def]
    """``fn`` (``inner`` itself, or decorators' wrappers around it holding the next function in
    a closure cell) with ``inner`` replaced by ``new_inner``; None where a wrapper holds it some
    other way."""
    if fn is inner:
        return new_inner
    nxt = getattr(fn, "__wrapped__", None)
    cells = getattr(fn, "__closure__", None)
    if nxt is None or not cells or not isinstance(fn, types.FunctionType):
        return None
    replaced = _rebuilt(nxt, inner, new_inner)
    if replaced is None:
        return None
    new_cells, found = [], False
    for cell in cells:
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            new_cells.append(cell)
            continue
        if held is nxt:
            new_cells.append(types.CellType(replaced))
            found = True
        else:
            new_cells.append(cell)
    if not found:
        return None
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             tuple(new_cells))  # fmt: skip
    out.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(out, replaced)
    return out


@functools.cache
def rotary_forward(cls: type) -> Callable[..., object] | None:
    """``cls.forward`` with ``apply_rotary_pos_emb`` bound to :func:`fused_apply_rotary` of the
    module's own function (module doc); None where the forward does not call it by that name."""
    forward = cls.forward
    inner = inspect.unwrap(forward)
    if not isinstance(inner, types.FunctionType) or _NAME not in inner.__code__.co_names:
        return None
    original = inner.__globals__.get(_NAME)
    fused = fused_apply_rotary(original) if callable(original) else None
    if fused is None:
        return None
    names = dict(inner.__globals__)
    names[_NAME] = fused
    new_inner = types.FunctionType(inner.__code__, names, inner.__name__, inner.__defaults__,
                                   inner.__closure__)  # fmt: skip
    new_inner.__kwdefaults__ = inner.__kwdefaults__
    new_inner.__qualname__, new_inner.__doc__ = inner.__qualname__, inner.__doc__
    new_inner.__dict__.update(inner.__dict__)
    return _rebuilt(forward, inner, new_inner)


def rotary_attention_forward(self: nn.Module, *args, **kwargs):  # type: ignore[no-untyped-def]
    """A patched attention module's forward: the class's forward with the fused rotary
    (:func:`rotary_forward`) in eager mode, the class's own forward when compiling."""
    if torch.compiler.is_compiling():
        return type(self).forward(self, *args, **kwargs)
    return rotary_forward(type(self))(self, *args, **kwargs)


def attention_ok(module: object) -> bool:
    return (
        isinstance(module, nn.Module)
        and type(module).__name__ in ATTENTION_CLASSES
        and rotary_forward(type(module)) is not None
    )

"""The bound call path: what a layer runs per eager call, made once when it is prepared.

A layer's custom op (quantdispatch.ops) takes flat arguments and, per call, decodes the weight's
meta, looks the backend up and asks the regime table which kernel family runs this M: right for
compile, export and fake tensors, too slow for an eager decode step whose kernels take a few
microseconds. :meth:`Backend.bind_linear` / :meth:`Backend.bind_moe` do that work once and
return a :class:`BoundLinear` / :class:`BoundMoe`: per call only the lookup of M's step, that
step's launch (its own arguments prepared per M, once) and the output allocation remain.

What is bound is read-only (the layer's prepared tensors, shapes, launch configs): outputs and
scratch still come from the caching allocator per call, so two streams, two threads or a graph
capture never share a buffer. A bound object holds the layer's tensors; the layer drops it when
its buffers move or are replaced (:class:`quantdispatch.layers.base.QuantLayer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quantdispatch.backends.prepared import Layout, LayoutMeta, PreparedWeight

__all__ = ["BoundLinear", "BoundMoe", "LinearBinding", "Step"]


@dataclass(frozen=True)
class LinearBinding:
    """What a layer binds a linear call path to: its prepared tensors (the op's form: float8 as
    uint8 views), bias, format, layout and meta, whether kernels may use programmatic dependent
    launches (the decision's ``pdl``), and the device the tensors live on."""

    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    fmt: str
    layout: Layout
    meta: LayoutMeta
    pdl: bool
    device: torch.device

    @classmethod
    def of(
        cls,
        prepared: PreparedWeight,
        fmt: str,
        bias: torch.Tensor | None = None,
        *,
        pdl: bool = True,
    ) -> LinearBinding:
        """The binding of a backend's prepared weight (what a layer would bind)."""
        t = tuple(prepared.tensors)
        return cls(t, bias, fmt, prepared.layout, prepared.meta, pdl, t[0].device)


#: One step of a bound call: calls of up to ``max_m`` rows (None: any) run ``fn``.
Step = tuple[int | None, Callable[..., torch.Tensor]]


class BoundLinear:
    """y[M, N] = x[M, K] @ W.T (+ bias) with everything but the launch made once.

    ``steps``: (largest M or None, callable) in increasing M, the last taking any M;
    ``families``: the kernel family of each step (for doctor's words and tests)."""

    __slots__ = ("families", "steps")

    def __init__(self, steps: Sequence[Step], families: Sequence[str] = ()) -> None:
        if not steps or steps[-1][0] is not None:
            raise ValueError("a bound linear's last step must take any M (max_m None)")
        self.steps = tuple(steps)
        self.families = tuple(families)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        for top, fn in self.steps:
            if top is None or m <= top:
                return fn(x)
        raise AssertionError("unreachable: the last step takes any M")

    def family_for(self, m: int) -> str | None:
        """The kernel family a call of ``m`` rows runs (None: not recorded)."""
        if not self.families:
            return None
        for (top, _), family in zip(self.steps, self.families, strict=True):
            if top is None or m <= top:
                return family
        return None


class BoundMoe:
    """out[M, H] = the routed experts of x, with everything but the per-call routing-dependent
    work made once: ``fn(x, topk_ids, topk_weights)``."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
        self.fn = fn

    def __call__(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.fn(x, topk_ids, topk_weights)

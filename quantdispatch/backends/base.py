"""What every backend does: its life cycle (can_implement -> prepare -> bind / apply) over a
typed canonical weight and named prepared tensors. What it can run and the words doctor prints
are its facts (:mod:`.facts`), a separate object the resolver reads.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, NoReturn

import torch

from quantdispatch.backends.bound import BoundLinear, BoundMoe, LinearBinding
from quantdispatch.backends.facts import BackendFacts, KernelRange
from quantdispatch.backends.prepared import (
    CheckpointMeta,
    CutlassFp4Meta,
    ExpertStacks,
    Layout,
    LayoutMeta,
    MarlinMeta,
    Mma16x64Meta,
    MoeCall,
    PreparedMoe,
    PreparedWeight,
    ScaledMmMeta,
    decode_meta,
    encode_meta,
)
from quantdispatch.errors import BackendUnavailableError, format_error
from quantdispatch.request import Op, Request

if TYPE_CHECKING:
    from quantdispatch.checkpoints import QuantWeight
    from quantdispatch.device import DeviceProfile

__all__ = [
    "Backend",
    "BackendFacts",
    "BoundLinear",
    "BoundMoe",
    "CheckpointMeta",
    "CutlassFp4Meta",
    "ExpertStacks",
    "KernelRange",
    "Layout",
    "LayoutMeta",
    "LinearBinding",
    "MarlinMeta",
    "Mma16x64Meta",
    "MoeCall",
    "PreparedMoe",
    "PreparedWeight",
    "ScaledMmMeta",
    "as_op_tensors",
    "decode_meta",
    "encode_meta",
    "op_view",
]


_FP8 = (torch.float8_e4m3fn, torch.float8_e8m0fnu)


def as_op_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float8 tensors cross the op boundary as uint8 views of the same bytes.

    torch cannot run generic ops (opcheck's schema test, some dispatch paths) on float8 on every
    device; the kernels read bits anyway. Backends view them back with :func:`op_view`.
    """
    return [t.view(torch.uint8) if t.dtype in _FP8 else t for t in tensors]


def op_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor as ``dtype`` again (a no-op view when it already is)."""
    return t if t.dtype == dtype else t.view(dtype)


class Backend(ABC):
    """The life cycle of a backend: ``can_implement`` -> ``prepare`` (once, at load: a typed
    canonical weight in, named prepared tensors out) -> ``bind_linear`` / ``bind_moe`` (once
    per layer: the bound call path that applies it), with ``linear`` / ``moe`` the same per
    call behind the custom ops. What it can run and says is its :attr:`facts`."""

    facts: ClassVar[BackendFacts]
    """Its declarative facts (:mod:`.facts`)."""

    @property
    def name(self) -> str:
        return self.facts.name

    def can_implement(self, request: Request, profile: DeviceProfile) -> str | None:
        """None if it can run ``request`` on ``profile``, else every reason why not."""
        return self.facts.explain_unsupported(request, profile)

    def refuse_simulated(self, profile: DeviceProfile) -> None:
        if profile.simulated:
            raise BackendUnavailableError(
                format_error(
                    f"cannot run the {self.name} kernel: the decision was made for a simulated "
                    f"device (preset {profile.preset!r})",
                    "presets explain decisions; kernels run only on a probed device",
                    "drop device=... / unset QUANTDISPATCH_DEVICE to run on this machine",
                )
            )

    # -- life cycle ---------------------------------------------------------------------------

    def prepare(
        self, weight: QuantWeight, request: Request, *, options: object = None
    ) -> PreparedWeight:
        """Turn the canonical weight of ``request``'s format (formats.*Weight) into this
        backend's named tensors, once, at load (``options``: the decision's options of this
        backend, ``Decision.options``): :meth:`check_weight`, then :meth:`prepare_linear`."""
        self.check_weight(weight, request)
        return self.prepare_linear(weight, request, options)

    def check_weight(self, weight: QuantWeight, request: Request) -> None:
        """Refuse a weight that is not the canonical type of ``request``'s format, or a
        format whose linear this backend has no kernel for."""
        from quantdispatch.formats import get_format

        done = self.facts.implemented.get(request.format, frozenset())
        if Op.LINEAR not in done or not isinstance(weight, get_format(request.format).weight_type):
            self.cannot_prepare(request)

    def cannot_prepare(self, request: Request) -> NoReturn:
        raise BackendUnavailableError(
            format_error(
                f"backend {self.name} cannot prepare {request.describe()}",
                "its kernel binding is not implemented yet",
                "let the resolver choose (unset QUANTDISPATCH_BACKEND_*), or use 'triton' / "
                "'reference'",
            )
        )

    def prepare_linear(
        self, weight: QuantWeight, request: Request, options: object
    ) -> PreparedWeight:
        """This backend's tensors for a weight :meth:`check_weight` accepted."""
        self.cannot_prepare(request)

    def prepare_moe(self, stacks: ExpertStacks, request: Request) -> PreparedMoe:
        """The layer's expert stacks as this backend's MoE kernel reads them, once, at load.
        Default: kept as they are."""
        s = stacks
        return PreparedMoe(tuple(s.names), tuple(s.w13), tuple(s.w2), Layout.CHECKPOINT, s.meta)

    def linear(self, x: torch.Tensor, w: LinearBinding) -> torch.Tensor:
        """y = x @ W.T (+ bias) for 2-D x [M, K] and the prepared weight ``w`` (its tensors,
        bias, format, layout and meta; ``pdl``: kernels may use programmatic dependent launches,
        the decision's Settings.pdl); returns [M, N] in x.dtype. The custom op's body, per call.
        Default: :meth:`make_linear`'s callable, made for this call."""
        return self.make_linear(w)(x)

    def make_linear(self, w: LinearBinding) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> y for the prepared weight ``w`` with its per-weight work (operand views, the
        provider's op) done once: a backend with one kernel family per weight says only this."""
        raise BackendUnavailableError(
            format_error(f"backend {self.name} has no linear kernel", "not implemented yet", "")
        )

    def bind_linear(self, w: LinearBinding) -> BoundLinear:
        """The bound call path of one prepared weight (:mod:`.bound`): made once, then called
        with x [M, K] for what :meth:`linear` computes, the same bits. Default: one step, the
        :meth:`make_linear` callable; backends with regime steps override it."""
        return BoundLinear(((None, self.make_linear(w)),), (self.name,))

    def bind_moe(self, template: MoeCall) -> BoundMoe:
        """The bound call path of one prepared MoE layer: ``template`` holds everything but the
        per-call x, ids and weights (those fields are placeholders). Default: :meth:`moe` on a
        copy of it per call; backends override it to make the per-call work once."""
        moe, fields = self.moe, template.__dict__

        def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return moe(MoeCall(**{**fields, "x": x, "topk_ids": ids, "topk_weights": weights}))

        return BoundMoe(run)

    def moe(self, call: MoeCall) -> torch.Tensor:
        """Routed experts: out[t] = sum_k w[t, k] * expert_{id[t, k]}(x[t]); [M, H] in x.dtype."""
        raise BackendUnavailableError(
            format_error(f"backend {self.name} has no MoE kernel", "not implemented yet", "")
        )

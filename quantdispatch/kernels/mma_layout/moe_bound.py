"""The repacked (mma16x64) MoE bound to one layer (the bound call path): the stacks checked once,
the single-pair regime on launches bound once (:class:`.moe_pairs.SmallMoe`), every other regime
through :func:`.moe_gemm.mma_layout_moe` with the plan's config, so both paths run the same
kernels on the same arguments."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.common.moe_activations import activation_args
from quantdispatch.kernels.common.moe_stages import ExpertWeights
from quantdispatch.kernels.mma_layout.moe_gemm import mma_layout_moe
from quantdispatch.kernels.mma_layout.moe_pairs import SmallMoe
from quantdispatch.kernels.mma_layout.moe_plan import SmallMoeConfig
from quantdispatch.kernels.mma_layout.moe_stacks import check_stack

__all__ = ["MmaLayoutMoe"]


class MmaLayoutMoe:
    """:func:`mma_layout_moe` over one layer's repacked stacks and biases (``weights``), checked
    once (the bound MoE
    path): a call checks the per-call tensors' shapes and runs the plan's regime, the single
    pairs on their bound launches (:class:`.moe_pairs.SmallMoe`), the others through
    :func:`mma_layout_moe` with the same config."""

    def __init__(
        self,
        weights: ExpertWeights,
        *,
        activation: str,
        params: Sequence[float],
        packed_for: torch.dtype,
        pdl: bool = True,
        facts: DeviceFacts | None = None,
    ) -> None:
        w13, w2, w13_bias, w2_bias = weights
        act = activation_args(activation, params)
        _, _, self.hidden = check_stack(w13, "w13")
        _, _, self.inter = check_stack(w2, "w2")
        self.w13, self.w2, self.b13, self.b2 = tuple(w13), tuple(w2), w13_bias, w2_bias
        self.activation, self.params, self.packed_for = activation, tuple(params), packed_for
        self.pdl, self.facts = pdl, facts or device_facts(w13[0].device)
        self._small: dict[int, SmallMoe] = {}
        self._small_args = (self.w13, self.w2, w13_bias, w2_bias, act.code, act.alpha, act.limit,
                            self.inter)  # fmt: skip
        self._gated = act.gated

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, config: object
    ) -> torch.Tensor:
        m = x.shape[0]
        fast = (
            isinstance(config, SmallMoeConfig)
            and self._gated
            and x.dtype == self.packed_for
            and x.dim() == 2
            and x.shape[1] == self.hidden
            and x.is_contiguous()
            and x.is_cuda
            and ids.dim() == 2
            and ids.shape[0] == m
            and ids.dtype in (torch.int32, torch.int64)
            and ids.is_contiguous()
            and tw.dtype == torch.float32
            and tw.shape == ids.shape
            and tw.is_contiguous()
            and m > 0
            and (not config.pdl or self.facts.dependent_launches)  # type: ignore[attr-defined]
        )
        if not fast:
            return mma_layout_moe(
                x, ids, tw, self.w13, self.w2, self.b13, self.b2, activation=self.activation,
                params=self.params, packed_for=self.packed_for, config=config, pdl=self.pdl,  # type: ignore[arg-type]
                facts=self.facts,
            )  # fmt: skip
        top_k = ids.shape[1]
        small = self._small.get(top_k)
        if small is None:
            small = self._small[top_k] = SmallMoe(*self._small_args, top_k)
        out = checks.empty((m, self.hidden), x.dtype, x.device)
        small(x, ids, tw, config, out)  # type: ignore[arg-type]
        return out

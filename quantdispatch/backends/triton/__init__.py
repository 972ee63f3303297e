"""quantdispatch's own Triton weight-only kernels: FP4 / FP8 weights stay packed on the GPU and
are dequantized in registers inside the GEMM; activations stay fp16 / bf16.

Facts: any CUDA GPU from SM 7.5 with fp16 activations, from SM 8.0 with bf16 (no bf16 tensor
cores before Ampere). Scales are decoded with integer ops, so GPUs without hardware FP8
conversion (SM 7.5-8.6) work. Needs triton and a CUDA build of torch. K must be a multiple of
the format's group (16 NVFP4, 32 MXFP4). Weight-only: serves W4A16 checkpoints exactly and W4A4
ones with unquantized activations (it says so).

The package: :mod:`.facts` (what it can run, doctor's words, kernel ranges), :mod:`.dispatch`
(layout and kernel family from the regime table, quantdispatch.kernels.regimes),
:mod:`.prepare` (layout choice and repack), :mod:`.options` (the backend's options, from the
settings and policy), :mod:`.fp8_compute` (its one option: the opt-in, lossy FP8 compute for
prefill: which weights take it, the resident copy, the trace's words), :mod:`.meta` (the metas
of weights prepared for it), :mod:`.run` (a call
-> its kernel family -> one kernel file's launcher; imported at the first call, as it imports
triton), :mod:`.bind` (the bound call path: the same launchers, built once per weight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantdispatch.backends.base import (
    Backend,
    BoundLinear,
    BoundMoe,
    ExpertStacks,
    LinearBinding,
    MoeCall,
    PreparedMoe,
    PreparedWeight,
)
from quantdispatch.backends.triton import prepare as _prepare
from quantdispatch.backends.triton.facts import TritonFacts
from quantdispatch.backends.triton.options import TritonOptions
from quantdispatch.request import Request

if TYPE_CHECKING:
    from quantdispatch.checkpoints import QuantWeight

__all__ = ["TritonBackend", "TritonFacts"]


class TritonBackend(Backend):
    """The triton backend's life cycle (its facts: :class:`.facts.TritonFacts`)."""

    facts = TritonFacts()

    def prepare_linear(
        self, weight: QuantWeight, request: Request, options: object
    ) -> PreparedWeight:
        mode = (options if isinstance(options, TritonOptions) else TritonOptions()).fp8_compute
        return _prepare.prepare_linear(weight, request, mode)

    def prepare_moe(self, stacks: ExpertStacks, request: Request) -> PreparedMoe:
        return _prepare.prepare_moe(stacks, request)

    def linear(self, x: torch.Tensor, w: LinearBinding) -> torch.Tensor:
        from quantdispatch.backends.triton import run

        return run.linear(x, w)

    def bind_linear(self, w: LinearBinding) -> BoundLinear:
        from quantdispatch.backends.triton.bind import bind_linear

        return bind_linear(w)

    def bind_moe(self, template: MoeCall) -> BoundMoe:
        from quantdispatch.backends.triton.bind import bind_moe

        return bind_moe(template)

    def moe(self, call: MoeCall) -> torch.Tensor:
        from quantdispatch.backends.triton import run

        return run.moe(call)

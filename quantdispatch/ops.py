"""torch.library custom ops: how layers call kernels.

Every backend runs behind ``torch.ops.quantdispatch.linear`` (and ``.moe``), each with a fake
(meta) implementation, so torch.compile(fullgraph=True) traces layers without looking inside the
kernels and CUDA graphs capture them as opaque calls. The real implementation
(:func:`run_linear` / :func:`run_moe`) looks the backend up by name and hands it the prepared
tensors; layers call it directly, with the op's arguments, in eager inference, where the op's
dispatch would cost more host time than a decode kernel (``layers.base.direct_call_ok``).
"""

from __future__ import annotations

import torch

from quantdispatch.backends import get_backend
from quantdispatch.backends.base import MoeCall, decode_meta

__all__ = ["linear", "moe", "run_linear", "run_moe"]

NAMESPACE = "quantdispatch"


def run_linear(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    bias: torch.Tensor | None,
    backend: str,
    fmt: str,
    meta: list[int],
    out_features: int,
    pdl: bool = True,
) -> torch.Tensor:
    """y[M, N] = x[M, K] @ W.T (+ bias), W given as ``backend``'s prepared tensors."""
    layout, typed = decode_meta(meta)
    return get_backend(backend).linear(x, weights, bias, fmt, layout, typed, pdl=pdl)


linear = torch.library.custom_op(f"{NAMESPACE}::linear", run_linear, mutates_args=())


@linear.register_fake
def _linear_fake(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    bias: torch.Tensor | None,
    backend: str,
    fmt: str,
    meta: list[int],
    out_features: int,
    pdl: bool = True,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def run_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: list[torch.Tensor],
    w2: list[torch.Tensor],
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    backend: str,
    fmt: str,
    activation: str,
    params: list[float],
    meta: list[int],
    pdl: bool = True,
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), shape [M, H]."""
    layout, typed = decode_meta(meta)
    call = MoeCall(
        x, topk_ids, topk_weights, tuple(w13), tuple(w2), w13_bias, w2_bias, fmt, activation,
        tuple(params), layout, typed, pdl,
    )  # fmt: skip
    return get_backend(backend).moe(call)


moe = torch.library.custom_op(f"{NAMESPACE}::moe", run_moe, mutates_args=())


@moe.register_fake
def _moe_fake(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: list[torch.Tensor],
    w2: list[torch.Tensor],
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    backend: str,
    fmt: str,
    activation: str,
    params: list[float],
    meta: list[int],
    pdl: bool = True,
) -> torch.Tensor:
    return x.new_empty(x.shape)

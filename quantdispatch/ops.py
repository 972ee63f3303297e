"""torch.library custom ops: how layers call kernels.

Every backend runs behind ``torch.ops.quantdispatch.linear`` (and ``.moe``), each with a fake
(meta) implementation, so torch.compile(fullgraph=True) traces layers without looking inside the
kernels and CUDA graphs capture them as opaque calls. The real implementation
(:func:`run_linear` / :func:`run_moe`) looks the backend up by name and hands it the prepared
tensors; layers call it directly, with the op's arguments, in eager inference, where the op's
dispatch would cost more host time than a decode kernel (``layers.base.direct_call_ok``).
The fused norm and activation ops of the HF integration are here too, for the same reasons.
"""

from __future__ import annotations

import torch

from quantdispatch.backends import get_backend
from quantdispatch.backends.base import LinearBinding, MoeCall, decode_meta

__all__ = [
    "add_rms_norm",
    "linear",
    "moe",
    "rms_norm",
    "run_add_rms_norm",
    "run_linear",
    "run_moe",
    "run_rms_norm",
    "run_silu_mul",
    "silu_mul",
]

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
    w = LinearBinding(tuple(weights), bias, fmt, layout, typed, pdl, x.device)
    return get_backend(backend).linear(x, w)


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
def _moe_fake(x: torch.Tensor, *_args: object, **_kwargs: object) -> torch.Tensor:
    """The output's shape and dtype: x's ([M, H]); the other arguments are :func:`run_moe`'s."""
    return x.new_empty(x.shape)


# -- fused norms and activations (the HF integration's fused ops) -------------------------------


def run_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [M, K] with ``weight`` [K], rounded as HF's LlamaRMSNorm rounds."""
    from quantdispatch.kernels.native.fp8_producers import rmsnorm

    return rmsnorm(x, weight, eps)[0]


rms_norm = torch.library.custom_op(f"{NAMESPACE}::rms_norm", run_rms_norm, mutates_args=())


@rms_norm.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def run_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of s, s) with s = x + residual rounded to x's dtype (the residual stream)."""
    from quantdispatch.kernels.native.fp8_producers import rmsnorm

    y, s, _ = rmsnorm(x, weight, eps, residual=residual)
    assert s is not None
    return y, s


add_rms_norm = torch.library.custom_op(
    f"{NAMESPACE}::add_rms_norm", run_add_rms_norm, mutates_args=()
)


@add_rms_norm.register_fake
def _add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def run_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [M, I], rounded as eager ``act_fn(gate) * up`` rounds."""
    from quantdispatch.kernels.native.fp8_producers import silu_mul_fp8

    return silu_mul_fp8(gate, up, quantize=False)[0]


silu_mul = torch.library.custom_op(f"{NAMESPACE}::silu_mul", run_silu_mul, mutates_args=())


@silu_mul.register_fake
def _silu_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate)

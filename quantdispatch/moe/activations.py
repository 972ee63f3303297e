"""MoE activations in plain torch: the contract every MoE backend follows (the table of names,
codes and parameters is :mod:`quantdispatch.kernels.common.moe_activations`).

Layout: a gated expert's first GEMM (w13) produces [tokens, 2*I] with the gate in the first I
columns and the up projection in the last I (gpt-oss's interleaved rows are de-interleaved at
load, so kernels see one layout). A non-gated expert's w13 produces [tokens, I].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantdispatch.kernels.common.moe_activations import (
    ACTIVATIONS,
    ActivationSpec,
    activation_args,
    get_activation,
)

__all__ = ["ACTIVATIONS", "ActivationSpec", "apply_activation", "get_activation"]


def apply_activation(
    h: torch.Tensor, activation: str, params: Sequence[float] = ()
) -> torch.Tensor:
    """Activation of the first expert GEMM's output h ([t, 2I] gated, [t, I] not), in h's dtype."""
    spec = get_activation(activation)
    if spec.gated:
        inter = h.shape[-1] // 2
        gate, up = h[..., :inter], h[..., inter:]
        if spec.name == "silu":
            return torch.nn.functional.silu(gate) * up
        if spec.name == "gelu":
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
        args = activation_args(spec.name, params)
        alpha, limit = args.alpha, args.limit
        g = gate.clamp(max=limit)
        u = up.clamp(min=-limit, max=limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)
    if spec.name == "relu2":
        return torch.relu(h).square()
    return torch.nn.functional.silu(h)

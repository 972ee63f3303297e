"""MoE activations in plain torch: the contract every MoE backend follows.

Layout: a gated expert's first GEMM (w13) produces [tokens, 2*I] with the gate in the first I
columns and the up projection in the last I (gpt-oss's interleaved rows are de-interleaved at
load, so kernels see one layout). A non-gated expert's w13 produces [tokens, I].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantdispatch.errors import ConfigurationError, format_error

__all__ = ["ACTIVATIONS", "ActivationSpec", "apply_activation", "get_activation"]


@dataclass(frozen=True)
class ActivationSpec:
    name: str
    gated: bool
    code: int
    """Stable integer id kernels switch on."""
    default_params: tuple[float, ...] = ()
    description: str = ""


ACTIVATIONS: dict[str, ActivationSpec] = {
    a.name: a
    for a in (
        ActivationSpec("silu", True, 0, (), "SwiGLU: silu(gate) * up (Qwen, DeepSeek, Mixtral)"),
        ActivationSpec("gelu", True, 1, (), "GeGLU: gelu_tanh(gate) * up"),
        ActivationSpec(
            "swiglu_oai",
            True,
            2,
            (1.702, 7.0),
            "gpt-oss clamped SwiGLU: g=min(gate, limit), u=clamp(up, -limit, limit), "
            "g*sigmoid(alpha*g)*(u+1); params (alpha, limit)",
        ),
        ActivationSpec("relu2", False, 3, (), "non-gated squared ReLU (Nemotron-H)"),
        ActivationSpec("silu_nogate", False, 4, (), "non-gated SiLU"),
    )
}


def get_activation(name: str) -> ActivationSpec:
    key = str(name).strip().lower()
    if key not in ACTIVATIONS:
        raise ConfigurationError(
            format_error(
                f"unknown MoE activation {name!r}",
                f"valid activations: {', '.join(ACTIVATIONS)}",
                "pick the one the model's config names (hidden_act)",
            )
        )
    return ACTIVATIONS[key]


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
        alpha, limit = (tuple(params) or spec.default_params)[:2]
        g = gate.clamp(max=limit)
        u = up.clamp(min=-limit, max=limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)
    if spec.name == "relu2":
        return torch.relu(h).square()
    return torch.nn.functional.silu(h)

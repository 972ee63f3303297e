"""The MoE activations as the kernels see them: each name's integer code (what
:func:`.activation.apply_activation` switches on), whether it is gated, and its parameters.

The table lives here, below every MoE path, so launchers resolve an activation without importing
:mod:`quantdispatch.moe` (which re-exports it next to the torch definitions). No triton import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quantdispatch.errors import lookup

__all__ = ["ACTIVATIONS", "ActivationArgs", "ActivationSpec", "activation_args", "get_activation"]


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
    return lookup(
        ACTIVATIONS,
        name,
        unknown="unknown MoE activation",
        valid="valid activations",
        fix="pick the one the model's config names (hidden_act)",
    )


@dataclass(frozen=True)
class ActivationArgs:
    """One call's activation as kernel arguments: the code, gated or not, and the clamped
    SwiGLU's ``alpha`` / ``limit`` (0.0 for the others, which ignore them)."""

    name: str
    code: int
    gated: bool
    alpha: float = 0.0
    limit: float = 0.0


def activation_args(name: str, params: Sequence[float] = ()) -> ActivationArgs:
    """``name`` with ``params`` as the kernels take them (the default parameters where none are
    given)."""
    spec = get_activation(name)
    alpha, limit = 0.0, 0.0
    if spec.name == "swiglu_oai":
        alpha, limit = (tuple(params) or spec.default_params)[:2]
    return ActivationArgs(spec.name, spec.code, spec.gated, alpha, limit)

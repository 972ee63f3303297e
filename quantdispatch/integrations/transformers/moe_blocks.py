"""QuantMoE-backed experts for transformers' MoE architectures.

In transformers 5 a sparse MoE block is a router module plus an experts module called as
``experts(hidden_states, top_k_index, top_k_weights)``. We replace the experts module only: the
model's own router keeps running, so routing is the architecture's by construction (softmax or
sigmoid scores, top-k, renormalization, grouped top-k, scaling factor, and the router logits
transformers records for ``output_router_logits``). The QuantMoE inside is still built with the
architecture's routing options, so ``QuantExperts.moe.route(logits)`` agrees with the router.

Two weight layouts:

- stacked (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3): ``gate_up_proj`` [E, 2I, H] with gate rows
  first, ``down_proj`` [E, H, I], activation ``config.hidden_act``; checkpoints store one linear
  per expert (``experts.{e}.gate_proj/up_proj/down_proj`` or Mixtral's ``w1/w3/w2``).
- gpt-oss: ``gate_up_proj`` [E, H, 2I] with interleaved gate/up columns, ``down_proj``
  [E, I, H], biases, clamped SwiGLU (alpha, limit); checkpoints store MXFP4 blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quantdispatch import QuantMoE
from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.formats import quantize_fp8, quantize_mxfp4, quantize_nvfp4

__all__ = [
    "SUPPORTED_EXPERTS",
    "ExpertsArch",
    "QuantExperts",
    "experts_arch",
    "is_experts_module",
    "moe_options",
    "quantize_experts",
    "unsupported_experts_error",
]


@dataclass(frozen=True)
class ExpertsArch:
    """How one architecture's experts map onto QuantMoE."""

    name: str
    classes: tuple[str, ...]
    layout: str  # "stacked" or "gpt_oss"
    routing: Callable[[Any], dict[str, Any]]


def _softmax(renorm: Callable[[Any], bool]) -> Callable[[Any], dict[str, Any]]:
    return lambda cfg: {"scoring": "softmax", "renormalize": bool(renorm(cfg))}


def _deepseek(cfg: Any) -> dict[str, Any]:
    return {
        "scoring": "sigmoid",
        "renormalize": bool(getattr(cfg, "norm_topk_prob", True)),
        "n_group": getattr(cfg, "n_group", None),
        "topk_group": getattr(cfg, "topk_group", None),
        "routed_scaling_factor": float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
    }


_norm = _softmax(lambda cfg: getattr(cfg, "norm_topk_prob", False))

SUPPORTED_EXPERTS: tuple[ExpertsArch, ...] = (
    ExpertsArch("qwen3_moe", ("Qwen3MoeExperts",), "stacked", _norm),
    ExpertsArch("qwen2_moe", ("Qwen2MoeExperts",), "stacked", _norm),
    ExpertsArch("olmoe", ("OlmoeExperts",), "stacked", _norm),
    ExpertsArch("mixtral", ("MixtralExperts",), "stacked", _softmax(lambda cfg: True)),
    ExpertsArch("deepseek_v3", ("DeepseekV3Experts",), "stacked", _deepseek),
    # softmax over the top-k logits == softmax over all, top-k, renormalized
    ExpertsArch("gpt_oss", ("GptOssExperts",), "gpt_oss", _softmax(lambda cfg: True)),
)

_BY_CLASS = {c: a for a in SUPPORTED_EXPERTS for c in a.classes}

#: transformers ``hidden_act`` names -> QuantMoE gated activations with the same maths.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}


def is_experts_module(module: nn.Module) -> bool:
    """A transformers 5 experts module: its class is known, or it holds 3-D expert stacks."""
    if type(module).__name__ in _BY_CLASS:
        return True
    own = dict(module.named_parameters(recurse=False))
    return any(n in own and own[n].dim() == 3 for n in ("gate_up_proj", "down_proj"))


def experts_arch(module: nn.Module) -> ExpertsArch | None:
    return _BY_CLASS.get(type(module).__name__)


def unsupported_experts_error(name: str, module: nn.Module, why: str = "") -> ConfigurationError:
    classes = ", ".join(c for a in SUPPORTED_EXPERTS for c in a.classes)
    return ConfigurationError(
        format_error(
            f"cannot map the MoE experts at {name!r} ({type(module).__name__}){why}",
            f"quantdispatch maps these experts classes onto QuantMoE: {classes}",
            "open an issue with the model's config.json, or keep these experts unquantized "
            "(quantize_model(..., experts=False); a checkpoint must then store them in float)",
        )
    )


def moe_options(module: nn.Module, name: str, text_config: Any) -> dict[str, Any]:
    """QuantMoE keyword arguments (top_k, activation, routing) for an experts module."""
    arch = experts_arch(module)
    if arch is None:
        raise unsupported_experts_error(name, module)
    top_k = getattr(text_config, "num_experts_per_tok", None)
    if top_k is None:
        raise unsupported_experts_error(name, module, ": the config has no num_experts_per_tok")
    opts: dict[str, Any] = {"top_k": int(top_k), "num_experts": int(module.num_experts)}
    opts.update(arch.routing(text_config))
    if arch.layout == "gpt_oss":
        opts["activation"] = "swiglu_oai"
        opts["activation_params"] = (
            float(getattr(module, "alpha", 1.702)),
            float(getattr(module, "limit", 7.0)),
        )
    else:
        act = str(getattr(text_config, "hidden_act", "silu"))
        if act not in _ACTIVATIONS:
            raise unsupported_experts_error(
                name,
                module,
                f": hidden_act={act!r} (QuantMoE's gated activations are silu and tanh-gelu: "
                f"{', '.join(_ACTIVATIONS)})",
            )
        opts["activation"] = _ACTIVATIONS[act]
    return opts


class QuantExperts(nn.Module):
    """Drop-in for a transformers experts module: ``forward(hidden_states, top_k_index,
    top_k_weights)`` runs the QuantMoE with the router's global ids and final weights."""

    def __init__(self, moe: QuantMoE, arch: str) -> None:
        super().__init__()
        self.moe = moe
        self.arch = arch
        self.num_experts = moe.num_experts

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.moe(hidden_states, topk_ids=top_k_index, topk_weights=top_k_weights)

    def extra_repr(self) -> str:
        return f"arch={self.arch}"


def _quantize(fmt: str, w: torch.Tensor) -> Any:
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    return quantize_fp8(w, kind="channel")


def quantize_experts(
    module: nn.Module, name: str, fmt: str, text_config: Any, **layer_kwargs: Any
) -> QuantExperts:
    """A float experts module -> QuantExperts (weight-only, per-expert quantization)."""
    arch = experts_arch(module)
    if arch is None:
        raise unsupported_experts_error(name, module)
    opts = moe_options(module, name, text_config)
    gu = module.gate_up_proj.detach()
    down = module.down_proj.detach()
    e = gu.shape[0]
    gates, ups, downs = [], [], []
    w13_bias = w2_bias = None
    for i in range(e):
        if arch.layout == "gpt_oss":
            w13 = gu[i].T  # [2I, H], rows interleaved gate/up
            gate, up, d = w13[0::2], w13[1::2], down[i].T
        else:
            inter = gu.shape[1] // 2
            gate, up, d = gu[i, :inter], gu[i, inter:], down[i]
        gates.append(_quantize(fmt, gate.contiguous()))
        ups.append(_quantize(fmt, up.contiguous()))
        downs.append(_quantize(fmt, d.contiguous()))
    if arch.layout == "gpt_oss":
        b = module.gate_up_proj_bias.detach().float()
        w13_bias = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
        w2_bias = module.down_proj_bias.detach().float()
    if fmt != "fp8":
        layer_kwargs.setdefault("scheme", "weight_only")
    moe = QuantMoE(
        gates,
        ups,
        downs,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        validate_ids=False,
        **opts,
        **layer_kwargs,
    )
    return QuantExperts(moe, arch.name)

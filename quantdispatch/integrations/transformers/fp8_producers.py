"""FP8 compute in HF decoder layers: the norms and the gated MLP quantize what they produce.

With FP8 compute on (``QUANTDISPATCH_FP8_COMPUTE``), every FP8 linear quantizes its input to
e4m3 first: a pass over the activation that, on the 8B shapes, costs about what separates
1.35x from 1.55x of bf16. Here the kernels that make those activations do it instead
(:mod:`quantdispatch.kernels.native.fp8_producers`), and the codes reach the linears through
:mod:`quantdispatch.kernels.native.fp8_handoff` (q / k / v, and gate / up, share one set):

- a decoder layer's ``input_layernorm`` (read by ``self_attn``'s q / k / v projections) and
  ``post_attention_layernorm`` (read by the MLP's gate / up) run :func:`rmsnorm_fp8`;
- a gated MLP runs :func:`silu_mul_fp8` before ``down_proj``;
- the decoder layer runs inside :func:`quantdispatch.kernels.native.fp8_handoff.sharing`, the
  scope in which the linears may take codes from the handoff (an HF layer writes its
  activations through torch only, which is what the scope requires).

Only for the module classes named below, whose forwards these kernels reproduce, and only for
calls with at least as many rows as the first M from which one of the reading linears runs FP8
compute (its decision's kernel ranges), in eager mode, in the norm weight's own dtype. Any other
call runs the module's own forward. Installed by ``load_model``, ``quantize_model`` and
``QuantDispatchConfig`` when a layer of the model runs FP8 compute; nothing changes otherwise.
:func:`remove_fp8_producers` gives the modules their own forwards back (every FP8 linear then
quantizes its own input, as without this module).
The patch is an instance attribute: ``copy.deepcopy`` keeps it, pickling the whole module does
not (state dicts are unaffected).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterable

import torch
from torch import nn

from quantdispatch.kernels.regimes import Family
from quantdispatch.layers.base import direct_call_ok
from quantdispatch.layers.linear import QuantLinear

__all__ = [
    "MLP_CLASSES",
    "NORM_CLASSES",
    "PATCHED",
    "SCOPED",
    "fp8_start",
    "install_fp8_producers",
    "remove_fp8_producers",
]

logger = logging.getLogger("quantdispatch")

#: RMSNorms computing ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (LlamaRMSNorm's copies).
NORM_CLASSES = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
     "Qwen3RMSNorm", "Qwen3MoeRMSNorm"}
)  # fmt: skip
#: MLPs computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (LlamaMLP's copies).
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_SILU = ("SiLU", "SiLUActivation")
#: The attribute a patched norm / MLP carries: the first M its producer quantizes at.
PATCHED = "_quantdispatch_fp8_producer"
#: The attribute of a decoder layer that runs inside a sharing scope: from which M.
SCOPED = "_quantdispatch_fp8_sharing"


def fp8_start(layers: Iterable[nn.Module | None]) -> int | None:
    """The smallest M from which one of ``layers`` (QuantLinears; others ignored) runs FP8
    compute, or None."""
    starts = [
        r.first_m
        for layer in layers
        if isinstance(layer, QuantLinear)
        for r in layer.decision.kernel_ranges()
        if r.family == Family.FP8_PREFILL.value
    ]
    return min(starts) if starts else None


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 0


def _eligible(x: torch.Tensor, dtype: torch.dtype, start: int) -> bool:
    return (
        x.is_cuda
        and x.dtype == dtype
        and x.shape[-1] % 128 == 0
        and _rows(x) >= start
        and direct_call_ok(x)
    )


def _patch_norm(norm: nn.Module, start: int) -> None:
    from quantdispatch.kernels.native.fp8_producers import rmsnorm_fp8

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _eligible(hidden_states, self.weight.dtype, start):
            return type(self).forward(self, hidden_states)
        x2 = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
        y, _ = rmsnorm_fp8(x2, self.weight, self.variance_epsilon)
        return y.view(hidden_states.shape)

    norm.forward = types.MethodType(forward, norm)
    setattr(norm, PATCHED, start)


def _patch_mlp(mlp: nn.Module, start: int) -> None:
    from quantdispatch.kernels.native.fp8_producers import silu_mul_fp8

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not (_eligible(gate, gate.dtype, start) and up.shape == gate.shape):
            return self.down_proj(self.act_fn(gate) * up)
        i = gate.shape[-1]
        h, _ = silu_mul_fp8(gate.reshape(-1, i).contiguous(), up.reshape(-1, i).contiguous())
        return self.down_proj(h.view(gate.shape))

    mlp.forward = types.MethodType(forward, mlp)
    setattr(mlp, PATCHED, start)


def _scope_layer(layer: nn.Module, start: int) -> None:
    from quantdispatch.kernels.native import fp8_handoff

    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        x = args[0] if args else kwargs.get("hidden_states")
        # a compiled graph may reuse buffers: no sharing; below ``start`` nothing to share
        if torch.compiler.is_compiling() or not isinstance(x, torch.Tensor) or _rows(x) < start:
            return type(self).forward(self, *args, **kwargs)
        with fp8_handoff.sharing():
            return type(self).forward(self, *args, **kwargs)

    layer.forward = types.MethodType(forward, layer)
    setattr(layer, SCOPED, start)


def _norm_ok(module: object) -> bool:
    return (
        type(module).__name__ in NORM_CLASSES
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, "variance_epsilon")
        and not hasattr(module, PATCHED)
    )


def _mlp_ok(module: object) -> bool:
    return (
        type(module).__name__ in MLP_CLASSES
        and type(getattr(module, "act_fn", None)).__name__ in _SILU
        and not hasattr(module, PATCHED)
    )


def install_fp8_producers(model: nn.Module) -> int:
    """Patch the decoder layers of ``model`` whose readers run FP8 compute (module doc);
    returns how many norms and MLPs now produce FP8 activations. Safe to call again (patched
    modules are skipped)."""
    done = 0
    for layer in model.modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        plan: list[tuple[object, Iterable[object], Callable[[nn.Module, int], None]]] = []
        if attn is not None and _norm_ok(getattr(layer, "input_layernorm", None)):
            readers = [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj")]
            plan.append((layer.input_layernorm, readers, _patch_norm))
        if mlp is not None and _norm_ok(getattr(layer, "post_attention_layernorm", None)):
            readers = [getattr(mlp, p, None) for p in ("gate_proj", "up_proj")]
            plan.append((layer.post_attention_layernorm, readers, _patch_norm))
        if mlp is not None and _mlp_ok(mlp):
            plan.append((mlp, [getattr(mlp, "down_proj", None)], _patch_mlp))
        for module, readers, patch in plan:
            start = fp8_start(readers)  # type: ignore[arg-type]
            if start is not None:
                patch(module, start)  # type: ignore[arg-type]
                done += 1
        if attn is not None and mlp is not None and not hasattr(layer, SCOPED):
            readers = [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
            readers += [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
            start = fp8_start(readers)
            if start is not None:
                _scope_layer(layer, start)
    if done:
        logger.info("quantdispatch: %d norms / MLPs produce FP8 activations for prefill", done)
    return done


def remove_fp8_producers(model: nn.Module) -> int:
    """Undo :func:`install_fp8_producers` (producers and sharing scopes); returns how many norms
    and MLPs got their forward back."""
    done = 0
    for module in model.modules():
        for mark in (PATCHED, SCOPED):
            if hasattr(module, mark):
                del module.forward
                delattr(module, mark)
                done += mark == PATCHED
    return done

"""FP8 compute in HF decoder layers: the norms and the gated MLP quantize what they produce.

With FP8 compute on (``QUANTDISPATCH_FP8_COMPUTE``), every FP8 linear quantizes its input to
e4m3 first: a pass over the activation that, on the 8B shapes, costs about what separates
1.35x from 1.55x of bf16. Here the kernels that make those activations do it instead
(:mod:`quantdispatch.kernels.native.fp8_producers`), and the codes reach the linears through
:mod:`.fp8_handoff` (q / k / v, and gate / up, share one set):

- a decoder layer's ``input_layernorm`` (read by ``self_attn``'s q / k / v projections) and
  ``post_attention_layernorm`` (read by the MLP's gate / up) run :func:`rmsnorm_fp8`;
- a gated MLP runs :func:`silu_mul_fp8` before ``down_proj``;
- the decoder layer runs inside :func:`.fp8_handoff.sharing`, the
  scope in which the linears may take codes from the handoff (an HF layer writes its
  activations through torch only, which is what the scope requires).

Only for the module classes :mod:`.fused_ops` knows (whose patched forwards these are: this
module sets from which M they quantize), and only for calls with at least as many rows as the
first M from which one of the reading linears runs FP8 compute (its decision's kernel ranges),
in eager mode, in the norm weight's own dtype. Installed by ``load_model``, ``quantize_model``
and ``QuantDispatchConfig`` when a layer of the model runs FP8 compute; nothing changes
otherwise. :func:`remove_fp8_producers` turns it off again (every FP8 linear then quantizes its
own input, as without this module).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterable

import torch
from torch import nn

from quantdispatch.integrations.transformers.fused_ops import (
    FP8_START,
    SCOPE_START,
    decoder_ok,
    mlp_ok,
    norm_ok,
    patch_decoder,
    patch_mlp,
    patch_norm,
    unpatch,
)
from quantdispatch.kernels.regimes import Family
from quantdispatch.layers.linear import QuantLinear

__all__ = [
    "PATCHED",
    "SCOPED",
    "fp8_start",
    "install_fp8_producers",
    "remove_fp8_producers",
]

logger = logging.getLogger("quantdispatch")

#: The attribute a norm / MLP producing FP8 activations carries: the first M it quantizes at.
PATCHED = FP8_START
#: The attribute of a decoder layer that runs inside a sharing scope: from which M.
SCOPED = SCOPE_START


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


def _set(module: nn.Module, flag: str, start: int, patch: Callable[[nn.Module], None]) -> None:
    setattr(module, flag, start)
    patch(module)


def install_fp8_producers(model: nn.Module) -> int:
    """Set the decoder layers of ``model`` whose readers run FP8 compute to produce and share
    FP8 activations (module doc); returns how many norms and MLPs now produce them. Safe to
    call again (modules already set are skipped)."""
    done = 0
    for layer in model.modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        plan: list[tuple[nn.Module, Iterable[object]]] = []
        if attn is not None and norm_ok(getattr(layer, "input_layernorm", None)):
            readers = [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj")]
            plan.append((layer.input_layernorm, readers))
        if mlp is not None and norm_ok(getattr(layer, "post_attention_layernorm", None)):
            readers = [getattr(mlp, p, None) for p in ("gate_proj", "up_proj")]
            plan.append((layer.post_attention_layernorm, readers))
        if mlp is not None and mlp_ok(mlp):
            plan.append((mlp, [getattr(mlp, "down_proj", None)]))
        for module, readers in plan:
            start = fp8_start(readers)  # type: ignore[arg-type]
            if start is not None and not hasattr(module, PATCHED):
                _set(module, PATCHED, start, patch_mlp if module is mlp else patch_norm)
                done += 1
        if attn is not None and mlp is not None and not hasattr(layer, SCOPED):
            readers = [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
            readers += [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
            start = fp8_start(readers)
            if start is not None:
                setattr(layer, SCOPED, start)
                if decoder_ok(layer):
                    patch_decoder(layer)
                else:
                    _patch_scope_only(layer)
    if done:
        logger.info("quantdispatch: %d norms / MLPs produce FP8 activations for prefill", done)
    return done


def _patch_scope_only(layer: nn.Module) -> None:
    """A decoder layer of a class the fused forward does not know: its own forward, inside a
    sharing scope from its start on."""
    from quantdispatch.integrations.transformers import fp8_handoff

    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        x = args[0] if args else kwargs.get("hidden_states")
        start = getattr(self, SCOPED, None)
        # a compiled graph may reuse buffers: no sharing; below ``start`` nothing to share
        if (
            start is None
            or torch.compiler.is_compiling()
            or not isinstance(x, torch.Tensor)
            or x.numel() // max(1, x.shape[-1]) < start
        ):
            return type(self).forward(self, *args, **kwargs)
        with fp8_handoff.sharing():
            return type(self).forward(self, *args, **kwargs)

    layer.forward = types.MethodType(forward, layer)
    layer._quantdispatch_forward = forward


def remove_fp8_producers(model: nn.Module) -> int:
    """Undo :func:`install_fp8_producers` (producers and sharing scopes; fused ops, if
    installed, stay); returns how many norms and MLPs stopped producing FP8 activations."""
    done = 0
    for module in model.modules():
        for mark in (PATCHED, SCOPED):
            if hasattr(module, mark):
                delattr(module, mark)
                unpatch(module)
                done += mark == PATCHED
    return done

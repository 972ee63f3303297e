"""Fused norms and activations in HF decoder layers: one kernel where eager HF runs a chain.

An eager ``LlamaRMSNorm`` is seven small kernels (cast, square, mean, add, rsqrt, multiply, cast
and multiply), the gated MLP's ``act_fn(gate) * up`` two, and the residual add one more; in a
decode step each costs host time, and in a captured step a few microseconds of GPU time. With
the quantized linears fast, those chains are most of a step. Here, for the module classes whose
forwards these kernels reproduce (:mod:`quantdispatch.kernels.native.fp8_producers`):

- every RMSNorm of the Llama family runs :func:`~quantdispatch.kernels.native.fp8_producers.rmsnorm`
  (decoder norms, Qwen3's q / k norms, the final norm);
- a decoder layer adds the attention output to the residual stream and normalizes the sum in
  one kernel (``add_rms_norm``) before its MLP;
- a gated SiLU MLP runs ``silu_mul`` before ``down_proj`` (gpt-oss's SwiGLU already runs inside
  the MoE kernels);
- an attention layer rotates its queries and keys in one kernel (:mod:`.fused_rope`, bit for bit
  HF's ``apply_rotary_pos_emb``).

The results are those of the eager modules within their own fp32 rounding (the kernels round
where the modules round; sums of squares are added in another order). Eager calls launch the
kernels directly; under torch.compile the same kernels run as custom ops
(``torch.ops.quantdispatch.rms_norm`` ...). Any other call (autograd, CPU tensors, another
dtype, a width the kernels do not take) runs the module's own forward.

With FP8 compute on, the same patched forwards also produce the FP8 activations
(:mod:`.fp8_producers` sets from which M). Installed by ``load_model`` / ``quantize_model`` /
``QuantDispatchConfig`` unless ``fused_ops=False``; :func:`remove_fused_ops` gives the modules
their own forwards back. The patch is an instance attribute: ``copy.deepcopy`` keeps it,
pickling the whole module does not (state dicts are unaffected).
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable

import torch
from torch import nn

from quantdispatch.integrations.transformers.fused_rope import (
    attention_ok,
    rotary_attention_forward,
    rotary_forward,
)
from quantdispatch.layers.base import direct_call_ok

__all__ = [
    "DECODER_CLASSES",
    "FP8_START",
    "FUSED",
    "MLP_CLASSES",
    "NORM_CLASSES",
    "SCOPE_START",
    "install_fused_ops",
    "patch_attention",
    "patch_decoder",
    "patch_mlp",
    "patch_norm",
    "remove_fused_ops",
    "unpatch",
]

logger = logging.getLogger("quantdispatch")

#: RMSNorms computing ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (LlamaRMSNorm's copies).
NORM_CLASSES = frozenset(
    {"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
     "Qwen3RMSNorm", "Qwen3MoeRMSNorm"}
)  # fmt: skip
#: MLPs computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (LlamaMLP's copies).
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP"})
#: Decoder layers computing ``h = x + attn(norm1(x))[0]; h + mlp(norm2(h))`` with the
#: attention's other arguments passed through (LlamaDecoderLayer's copies).
DECODER_CLASSES = frozenset(
    {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
     "Qwen3MoeDecoderLayer"}
)  # fmt: skip
_SILU = ("SiLU", "SiLUActivation")

#: Set on a module whose forward is patched here: whether the plain fusion is on.
FUSED = "_quantdispatch_fused"
#: Set by FP8 compute (:mod:`.fp8_producers`) on a norm or MLP: the first M it quantizes at.
FP8_START = "_quantdispatch_fp8_producer"
#: Set by FP8 compute on a decoder layer: from which M it runs inside a sharing scope.
SCOPE_START = "_quantdispatch_fp8_sharing"
_PATCH = "_quantdispatch_forward"  # which patch a module's forward is
_BOUND = "_quantdispatch_bound"  # a patched module's bound kernel (eager)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 0


def _kernels_run(x: torch.Tensor) -> bool:
    """Where the fused kernels run: CUDA tensors (tests also run them in Triton's CPU
    interpreter by replacing this)."""
    return x.is_cuda


def _eligible(x: torch.Tensor, dtype: torch.dtype, blocks: bool) -> bool:
    """Whether the fused kernels compute this call: a 16-bit tensor of the module's dtype on a
    GPU, no autograd, a width they take."""
    return (
        x.dtype == dtype
        and dtype in (torch.bfloat16, torch.float16)
        and x.dim() > 0
        and (not blocks or x.shape[-1] % 128 == 0)
        and not (x.requires_grad and torch.is_grad_enabled())
        and _kernels_run(x)
    )


def _fast(module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> bool:
    """The eager fast path: the plain fusion on, no FP8 producer set, a contiguous input the
    kernels take, eager inference (the bound kernels, nothing checked twice)."""
    d = module.__dict__
    return (
        d.get(FUSED, False)
        and FP8_START not in d
        and x.dtype is dtype
        and x.is_contiguous()
        and x.dim() > 0
        and _kernels_run(x)
        and direct_call_ok(x)
    )


def _bound_norm(norm: nn.Module):  # type: ignore[no-untyped-def]
    """The norm's bound kernel (kept on the module, made again when its weight moves), or None
    for a weight the kernel does not take."""
    w = norm.weight
    bound = norm.__dict__.get(_BOUND)
    if bound is None or bound.weight_ptr != w.data_ptr() or bound.dtype is not w.dtype:
        if w.dtype not in (torch.bfloat16, torch.float16) or w.dim() != 1:
            return None
        from quantdispatch.kernels.native.fp8_producers import RmsNorm

        bound = norm.__dict__[_BOUND] = RmsNorm(w.detach(), float(norm.variance_epsilon))
    return bound


def _bound_silu(mlp: nn.Module, gate: torch.Tensor):  # type: ignore[no-untyped-def]
    """The MLP's bound SiLU x mul (kept on the module, made again for another dtype or device)."""
    bound = mlp.__dict__.get(_BOUND)
    if bound is None or bound.dtype is not gate.dtype or bound.device != gate.device:
        from quantdispatch.kernels.native.fp8_producers import SiluMul

        bound = mlp.__dict__[_BOUND] = SiluMul(gate.shape[-1], gate.dtype, gate.device)
    return bound


def _quantize(module: nn.Module, x: torch.Tensor) -> bool:
    """FP8 compute's producer from this M on, in eager mode only (the handoff is eager)."""
    start = getattr(module, FP8_START, None)
    return start is not None and _rows(x) >= start and direct_call_ok(x)


def _norm2d(norm: nn.Module, x2: torch.Tensor, quantize: bool, residual=None):  # type: ignore[no-untyped-def]
    """(y, s): the norm of x2 (of s = x2 + residual) by the kernel, or by the op when
    compiling."""
    eps = float(norm.variance_epsilon)
    if quantize or direct_call_ok(x2):
        from quantdispatch.kernels.native.fp8_producers import rmsnorm

        y, s, codes = rmsnorm(x2, norm.weight, eps, residual=residual, quantize=quantize)
        _offer(y, codes)
        return y, s
    if residual is None:
        return torch.ops.quantdispatch.rms_norm(x2, norm.weight, eps), None
    return torch.ops.quantdispatch.add_rms_norm(x2, residual, norm.weight, eps)


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if _fast(self, hidden_states, w.dtype):
        bound = _bound_norm(self)
        if bound is not None and hidden_states.shape[-1] == bound.k:
            return bound(hidden_states.view(-1, bound.k)).view(hidden_states.shape)
    quantize = _quantize(self, hidden_states)
    if not (getattr(self, FUSED, False) or quantize) or not _eligible(
        hidden_states, w.dtype, quantize
    ):
        return type(self).forward(self, hidden_states)
    x2 = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
    y, _ = _norm2d(self, x2, quantize)
    return y.view(hidden_states.shape)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    i = gate.shape[-1]
    if (
        _fast(self, gate, gate.dtype)
        and i % 128 == 0
        and up.shape == gate.shape
        and up.dtype is gate.dtype
        and up.is_contiguous()
    ):
        h = _bound_silu(self, gate)(gate.view(-1, i), up.view(-1, i))
        return self.down_proj(h.view(gate.shape))
    quantize = _quantize(self, gate)
    if not (
        (getattr(self, FUSED, False) or quantize)
        and up.shape == gate.shape
        and _eligible(gate, gate.dtype, True)
        and up.dtype == gate.dtype
    ):
        return self.down_proj(self.act_fn(gate) * up)
    g2, u2 = gate.reshape(-1, i).contiguous(), up.reshape(-1, i).contiguous()
    if quantize or direct_call_ok(g2):
        from quantdispatch.kernels.native.fp8_producers import silu_mul_fp8

        h, codes = silu_mul_fp8(g2, u2, quantize=quantize)
        _offer(h, codes)
    else:
        h = torch.ops.quantdispatch.silu_mul(g2, u2)
    return self.down_proj(h.view(gate.shape))


def _decoder_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
    post = self.post_attention_layernorm
    fast = not args and SCOPE_START not in self.__dict__ and FP8_START not in post.__dict__
    if fast and _fast(self, hidden_states, post.weight.dtype):
        bound = _bound_norm(post)
        if bound is not None and hidden_states.shape[-1] == bound.k:
            shape, k = hidden_states.shape, bound.k
            h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
            h2 = h.reshape(-1, k)
            y, s = bound(h2 if h2.is_contiguous() else h2.contiguous(), hidden_states.view(-1, k))
            return s.view(shape) + self.mlp(y.view(shape))
    start = getattr(self, SCOPE_START, None)
    scoped = (
        start is not None
        and not torch.compiler.is_compiling()  # a compiled graph may reuse buffers: no sharing
        and isinstance(hidden_states, torch.Tensor)
        and _rows(hidden_states) >= start
    )
    with _sharing() if scoped else contextlib.nullcontext():
        if (
            args
            or not getattr(self, FUSED, False)
            or not isinstance(hidden_states, torch.Tensor)
            or not _eligible(hidden_states, post.weight.dtype, False)
        ):
            return type(self).forward(self, hidden_states, *args, **kwargs)
        shape, k = hidden_states.shape, hidden_states.shape[-1]
        h = self.input_layernorm(hidden_states)
        h, _ = self.self_attn(hidden_states=h, **kwargs)
        x2 = h.reshape(-1, k).contiguous()
        r2 = hidden_states.reshape(-1, k).contiguous()
        quantize = _quantize(post, x2) and k % 128 == 0
        y, s = _norm2d(post, x2, quantize, residual=r2)
        return s.view(shape) + self.mlp(y.view(shape))


def _sharing():  # type: ignore[no-untyped-def]
    from quantdispatch.integrations.transformers import fp8_handoff

    return fp8_handoff.sharing()


def _offer(y: torch.Tensor, codes: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """A producer's FP8 codes of y, for the linears reading it in the open scope."""
    if codes is not None:
        from quantdispatch.integrations.transformers import fp8_handoff

        fp8_handoff.offer(y, codes)


def _patch(module: nn.Module, forward: Callable[..., object]) -> None:
    if getattr(module, _PATCH, None) is not forward:
        module.forward = types.MethodType(forward, module)
        setattr(module, _PATCH, forward)


def patch_norm(norm: nn.Module) -> None:
    """Give a norm of :data:`NORM_CLASSES` the patched forward (what it does: its flags)."""
    _patch(norm, _norm_forward)


def patch_mlp(mlp: nn.Module) -> None:
    _patch(mlp, _mlp_forward)


def patch_decoder(layer: nn.Module) -> None:
    _patch(layer, _decoder_forward)


def patch_attention(attn: nn.Module) -> None:
    """Give an attention module of :data:`.fused_rope.ATTENTION_CLASSES` its class's forward
    with the fused rotary embedding (:func:`.fused_rope.rotary_forward`)."""
    if rotary_forward(type(attn)) is not None:
        _patch(attn, rotary_attention_forward)


def unpatch(module: nn.Module) -> bool:
    """Give ``module`` its own forward back once no flag asks for the patch; True if it did."""
    if getattr(module, _PATCH, None) is None or any(
        hasattr(module, flag) for flag in (FUSED, FP8_START, SCOPE_START)
    ):
        return False
    del module.forward
    delattr(module, _PATCH)
    return True


def norm_ok(module: object) -> bool:
    return (
        type(module).__name__ in NORM_CLASSES
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, "variance_epsilon")
    )


def mlp_ok(module: object) -> bool:
    return (
        type(module).__name__ in MLP_CLASSES
        and type(getattr(module, "act_fn", None)).__name__ in _SILU
        and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
    )


def decoder_ok(module: object) -> bool:
    return (
        type(module).__name__ in DECODER_CLASSES
        and norm_ok(getattr(module, "input_layernorm", None))
        and norm_ok(getattr(module, "post_attention_layernorm", None))
        and all(hasattr(module, p) for p in ("self_attn", "mlp"))
    )


def install_fused_ops(model: nn.Module) -> int:
    """Patch every norm, gated MLP, decoder layer and attention layer of ``model`` that this
    module knows (module doc); returns how many modules it patched. Safe to call again."""
    done = 0
    for module in model.modules():
        patch = (
            patch_norm if norm_ok(module) else patch_mlp if mlp_ok(module) else
            patch_decoder if decoder_ok(module) else
            patch_attention if attention_ok(module) else None
        )  # fmt: skip
        if patch is not None and not getattr(module, FUSED, False):
            setattr(module, FUSED, True)
            patch(module)
            done += 1
    if done:
        logger.info("quantdispatch: fused norms / activations / rotary in %d modules", done)
    return done


def remove_fused_ops(model: nn.Module) -> int:
    """Undo :func:`install_fused_ops` (FP8 compute's producers, if installed, stay); returns
    how many modules it turned back."""
    done = 0
    for module in model.modules():
        if hasattr(module, FUSED):
            delattr(module, FUSED)
            unpatch(module)
            done += 1
    return done

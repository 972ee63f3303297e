"""``load_model``: a quantized checkpoint folder -> a transformers model that generates.

Steps: read config.json and the quantization config; build the model from its config on the
meta device (per thread: ``meta_build``), then compute the buffers checkpoints do not hold (RoPE
frequencies) on the target device; put a ``QuantLinear`` in place of each linear whose checkpoint
tensors are quantized and a ``QuantExperts`` in place of each quantized experts module; load every
other tensor from the safetensors shards, one tensor at a time, straight to the device; tie what
the config ties. Relies on transformers >= 5 (experts modules called as
``experts(hidden_states, top_k_index, top_k_weights)``, ``from_config``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.integrations.transformers.architectures import build_model
from quantdispatch.integrations.transformers.checkpoint import open_checkpoint
from quantdispatch.integrations.transformers.common import resolve_device, warn_if_reference
from quantdispatch.integrations.transformers.float_tensors import load_float_tensors, tie_weights
from quantdispatch.integrations.transformers.fp8_producers import install_fp8_producers
from quantdispatch.integrations.transformers.fused_ops import install_fused_ops
from quantdispatch.integrations.transformers.meta_build import compute_buffers, on_meta
from quantdispatch.integrations.transformers.replace import swap_in_quantized

__all__ = ["keep_fp32_params", "load_model"]

logger = logging.getLogger("quantdispatch")


def load_model(
    path: str | Path,
    *,
    device: torch.device | str | None = None,
    act_dtype: torch.dtype = torch.bfloat16,
    policy: Any = None,
    settings: Any = None,
    model_class: Any = None,
    fused_ops: bool = True,
    **from_config_kwargs: Any,
) -> Any:
    """Load a quantized checkpoint folder as a transformers ``PreTrainedModel`` (eval mode).

    ``device``: where the model runs (default: the current GPU, else the CPU). ``act_dtype``:
    the model's float dtype and its quantized layers' activation dtype. ``policy`` / ``settings``
    go to every layer's ``select()``. The model is the class config.json's ``architectures``
    names (``AutoModelForCausalLM`` where it names none; ``model_class``: a transformers class
    to build instead). ``fused_ops``: one kernel per RMSNorm (with the residual add) and gated
    activation (:mod:`.fused_ops`; undo with ``remove_fused_ops``). Other keyword arguments go
    to its ``from_config`` (e.g. ``attn_implementation="sdpa"``).
    """
    from transformers import AutoConfig, GenerationConfig

    if act_dtype not in (torch.bfloat16, torch.float16):
        raise ConfigurationError(
            format_error(
                f"act_dtype={act_dtype}",
                "quantized layers take 16-bit activations (the kernels' decisions depend on "
                "which): torch.bfloat16 or torch.float16",
                "pass act_dtype=torch.bfloat16 (or torch.float16 on GPUs without bf16, e.g. T4)",
            )
        )
    ckpt = open_checkpoint(path)
    target = resolve_device(device)
    config = AutoConfig.from_pretrained(str(ckpt.path))
    quant_config = getattr(config, "quantization_config", None)
    if quant_config is not None:
        # building from the config must not start transformers' own quantizer
        del config.quantization_config
    # dtype=None: transformers would set the process-wide default dtype; on_meta does it for
    # this thread's new tensors only
    dtype = from_config_kwargs.pop("dtype", None) or act_dtype
    with on_meta(dtype):
        model = build_model(config, model_class, dtype=None, **from_config_kwargs)
    for cfg in (model.config, *(getattr(model.config, k, None) for k in model.config.sub_configs)):
        if cfg is not None:
            cfg.dtype = dtype
    if quant_config is not None:
        model.config.quantization_config = quant_config
    keep_fp32_params(model, dtype)
    compute_buffers(model, target)
    swap_in_quantized(
        model, ckpt, device=target, act_dtype=act_dtype, policy=policy, settings=settings
    )
    load_float_tensors(model, ckpt, target)
    tie_weights(model, ckpt)
    model.to(target)
    if (ckpt.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(ckpt.path))
    model.eval()
    if fused_ops:
        install_fused_ops(model)
    install_fp8_producers(model)
    warn_if_reference(model)
    return model


def keep_fp32_params(model: nn.Module, dtype: torch.dtype) -> None:
    """transformers' rule for modules kept in fp32 (``_keep_in_fp32_modules`` under fp16,
    ``_keep_in_fp32_modules_strict`` under fp16 and bf16): their (meta) parameters become fp32,
    so their tensors load in fp32."""
    names = set()
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        names |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not names:
        return
    pattern = re.compile(r"(^|\.)(" + "|".join(re.escape(n) for n in names) + r")(\.|$)")
    for mod_name, module in model.named_modules():
        if not pattern.search(mod_name):
            continue
        for pname, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point() and p.device.type == "meta":
                module._parameters[pname] = nn.Parameter(p.to(torch.float32), requires_grad=False)

"""``AutoModelForCausalLM.from_pretrained(path, quantization_config=QuantDispatchConfig())``.

transformers (>= 5) lets a library register a quantization method
(``transformers.quantizers.register_quantization_config`` / ``register_quantizer``); importing
this module registers ``quant_method="quantdispatch"``. The quantizer's two hooks do the work:

- before the weights load (the model is on the meta device; transformers passes the checkpoint
  files): if the checkpoint is quantized, every linear / experts module it stores quantized is
  swapped for a placeholder without parameters, so transformers loads only the float tensors and
  the quantized ones are expected-unexpected keys;
- after the weights load: the placeholders become ``QuantLinear`` / ``QuantExperts`` built from
  the checkpoint on the device the float weights went to (``device_map="cuda"``, which needs
  accelerate; without one, the CPU); a float checkpoint is quantized with ``quantize_model``.
  Each layer's kernel is chosen for that device: move the model with ``device_map``, not with
  ``.to()`` afterwards (a layer built on the CPU keeps the CPU's reference backend).

Limit (transformers' rule, not ours): when config.json carries a ``quantization_config`` whose
``quant_method`` transformers knows (compressed-tensors, fp8, mxfp4), ``from_pretrained`` merges
it with the config passed and refuses two config classes before any hook runs ("quantized with
CompressedTensorsConfig but you are passing a QuantDispatchConfig"). Such checkpoints load with
:func:`~quantdispatch.integrations.transformers.load_model`, or through this path with the
config :func:`hf_config` reads (the same, without that key; the hooks read the checkpoint's own
quantization config from the folder)::

    model = AutoModelForCausalLM.from_pretrained(
        path, config=hf_config(path), quantization_config=QuantDispatchConfig()
    )

ModelOpt checkpoints (``hf_quant_config.json``, or ``quant_method: modelopt``, which transformers
does not know) and float checkpoints take this path directly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.formats import get_format
from quantdispatch.integrations.transformers.checkpoint import Checkpoint, open_checkpoint
from quantdispatch.integrations.transformers.common import (
    replace_module,
    text_config,
    warn_if_reference,
)
from quantdispatch.integrations.transformers.fp8_producers import install_fp8_producers
from quantdispatch.integrations.transformers.fused_ops import install_fused_ops
from quantdispatch.integrations.transformers.quantize import quantize_model
from quantdispatch.integrations.transformers.replace import (
    build_layer,
    layer_kwargs,
    quantized_targets,
)

__all__ = ["METHOD", "QuantDispatchConfig", "QuantDispatchHfQuantizer", "hf_config"]

METHOD = "quantdispatch"


class QuantDispatchConfig(QuantizationConfigMixin):
    """How ``from_pretrained`` should quantize a float checkpoint (``format``, ``exclude``,
    ``experts``, ``fused_ops``, as in ``quantize_model``); a quantized checkpoint is loaded as
    it is stored."""

    def __init__(
        self,
        format: str = "nvfp4",
        exclude: tuple[str, ...] | list[str] = ("lm_head",),
        experts: bool = True,
        fused_ops: bool = True,
        **kwargs: Any,
    ) -> None:
        self.quant_method = METHOD
        self.format = get_format(format).name
        if isinstance(exclude, str) or not all(isinstance(e, str) for e in exclude):
            raise ConfigurationError(
                format_error(
                    f"quantdispatch config exclude={exclude!r}",
                    "exclude is a list of module names or patterns",
                    f"write exclude: [{exclude!r}]" if isinstance(exclude, str) else "fix it",
                )
            )
        self.exclude = list(exclude)
        self.experts = _flag("experts", experts)
        self.fused_ops = _flag("fused_ops", fused_ops)


def _flag(name: str, value: object) -> bool:
    """A yes / no option of the config, which a JSON string must not stand in for."""
    if not isinstance(value, bool):
        raise ConfigurationError(
            format_error(
                f"quantdispatch config {name}={value!r}",
                f"{name} is true or false (a JSON boolean, not a string)",
                f"write {name}: true or {name}: false",
            )
        )
    return value


def hf_config(path: str | Path, **kwargs: Any) -> Any:
    """``AutoConfig.from_pretrained(path, **kwargs)`` without a ``quantization_config``, for
    ``from_pretrained(path, config=hf_config(path), quantization_config=QuantDispatchConfig())``
    on any checkpoint (transformers refuses a second quantization config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), **kwargs)
    for holder in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
        if getattr(holder, "quantization_config", None) is not None:
            del holder.quantization_config
    return config


class _Pending(nn.Module):
    """Stands where a quantized layer will go while transformers loads the float tensors; holds
    the original (meta) module without registering it, so no parameter is expected for it."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("quantdispatch: a quantized layer was not built after loading")


class QuantDispatchHfQuantizer(HfQuantizer):
    requires_calibration = False

    def __init__(self, quantization_config: QuantDispatchConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._ckpt: Checkpoint | None = None
        self._pending: dict[str, nn.Module] = {}

    def validate_environment(self, *args: Any, device_map: Any = None, **kwargs: Any) -> None:
        devices = (
            sorted({str(v) for v in device_map.values()}) if isinstance(device_map, dict) else []
        )
        if len(devices) > 1:
            raise ConfigurationError(
                format_error(
                    f"device_map places the model on {devices}",
                    "quantdispatch layers run on the device they were built on: one device",
                    "pass device_map='cuda' (or one device)",
                )
            )

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        # quantized layers take 16-bit activations; an fp32 model would feed them fp32
        if dtype in (torch.float16, torch.bfloat16):
            return dtype
        return torch.bfloat16

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> None:
        if not checkpoint_files:
            return
        ckpt = open_checkpoint(Path(checkpoint_files[0]).parent)
        targets = quantized_targets(model, ckpt)
        if not targets:
            return  # a float checkpoint: quantized after loading
        self._ckpt = ckpt
        self._pending = targets
        patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        for name, module in targets.items():
            replace_module(model, name, _Pending(module))
            block = name.rpartition(".")[0] if name.endswith(".experts") else name
            for candidate in {block, ckpt.name_for(block) or block}:
                patterns.add("^" + re.escape(candidate) + r"[._]")
        model._keys_to_ignore_on_load_unexpected = patterns

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        ref = next((p for p in model.parameters() if p.device.type != "meta"), None)
        device = ref.device if ref is not None else torch.device("cpu")
        act_dtype = ref.dtype if ref is not None else torch.bfloat16
        if act_dtype not in (torch.float16, torch.bfloat16):
            act_dtype = torch.bfloat16
        cfg = self.quantization_config
        if self._ckpt is None:
            quantize_model(
                model, cfg.format, exclude=tuple(cfg.exclude), experts=cfg.experts,
                fused_ops=getattr(cfg, "fused_ops", True),
            )  # fmt: skip
            return model
        kwargs = layer_kwargs(device, act_dtype, None, None)
        text_cfg = text_config(model)
        for name, original in self._pending.items():
            layer = build_layer(name, original, self._ckpt, text_cfg, kwargs)
            replace_module(model, name, layer)
        self._pending = {}
        if getattr(cfg, "fused_ops", True):
            install_fused_ops(model)
        install_fp8_producers(model)
        warn_if_reference(model)
        return model

    @property
    def is_trainable(self) -> bool:
        return False

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _register() -> None:
    try:
        register_quantization_config(METHOD)(QuantDispatchConfig)
        register_quantizer(METHOD)(QuantDispatchHfQuantizer)
    except ValueError as exc:  # registered by an earlier import of a reloaded module
        if "already registered" not in str(exc):
            raise


_register()

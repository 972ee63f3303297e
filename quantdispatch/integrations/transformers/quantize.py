"""``quantize_model``: a float transformers model -> quantdispatch layers, in place, weight-only.

For users without a quantized checkpoint, and for tests. Round-to-nearest with the format's
reference quantizer (ModelOpt's NVFP4 recipe, OCP MXFP4, per-channel FP8): no calibration data,
no activation scales, so the result is a weight-only (W4A16 / W8A16) model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from quantdispatch import QuantLinear
from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.formats import FP4_GROUP_SIZES, get_format
from quantdispatch.integrations.transformers.common import (
    matches,
    replace_module,
    text_config,
    warn_if_reference,
)
from quantdispatch.integrations.transformers.fp8_producers import install_fp8_producers
from quantdispatch.integrations.transformers.fused_ops import install_fused_ops
from quantdispatch.integrations.transformers.moe_blocks import (
    experts_arch,
    is_experts_module,
    quantize_experts,
    unsupported_experts_error,
)

__all__ = ["quantize_model"]

logger = logging.getLogger("quantdispatch")

_GROUP = {**FP4_GROUP_SIZES, "fp8": 1}


def quantize_model(
    model: nn.Module,
    format: str = "nvfp4",
    *,
    exclude: Sequence[str] = ("lm_head",),
    experts: bool = True,
    act_dtype: torch.dtype | None = None,
    policy: Any = None,
    settings: Any = None,
    fused_ops: bool = True,
) -> nn.Module:
    """Quantize ``model`` in place and return it.

    Every ``nn.Linear`` whose name ``exclude`` does not match (exact name, dotted suffix, fnmatch
    pattern or ``re:`` regex) becomes a ``QuantLinear`` on the device its weight is on; with
    ``experts=True`` the experts of the MoE architectures in ``SUPPORTED_EXPERTS`` become
    ``QuantExperts`` (an experts module of another architecture raises). A linear whose
    in_features the format's group size does not divide stays float (logged). ``act_dtype``
    defaults to each weight's dtype (bf16 / fp16; fp32 weights get bf16 activations).
    ``fused_ops``: one kernel per RMSNorm (with the residual add) and gated activation
    (:mod:`.fused_ops`; undo with ``remove_fused_ops``).
    """
    fmt = get_format(format).name
    if isinstance(exclude, str):
        raise ConfigurationError(
            format_error(
                f"exclude={exclude!r} is a string",
                "exclude is a sequence of names or patterns",
                f"pass exclude=({exclude!r},)",
            )
        )
    text_cfg = text_config(model) if hasattr(model, "config") else None
    common: dict[str, Any] = {"policy": policy}
    if settings is not None:
        common["settings"] = settings
    for name, module in list(model.named_modules()):
        if not name or matches(name, exclude):
            continue
        if isinstance(module, nn.Linear):
            new = _linear(name, module, fmt, act_dtype, common)
        elif experts and is_experts_module(module):
            if experts_arch(module) is None:
                raise unsupported_experts_error(name, module)
            new = quantize_experts(
                module,
                name,
                fmt,
                text_cfg,
                act_dtype=_act_dtype(act_dtype, module.down_proj.dtype),
                device=module.down_proj.device,
                **common,
            )
        else:
            continue
        if new is not None:
            replace_module(model, name, new)
    if fused_ops:
        install_fused_ops(model)
    install_fp8_producers(model)
    warn_if_reference(model)
    return model


def _act_dtype(requested: torch.dtype | None, weight_dtype: torch.dtype) -> torch.dtype:
    if requested is not None:
        return requested
    return weight_dtype if weight_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _linear(
    name: str, module: nn.Linear, fmt: str, act_dtype: torch.dtype | None, common: dict[str, Any]
) -> QuantLinear | None:
    if module.weight.device.type == "meta":
        raise ConfigurationError(
            format_error(
                f"{name!r} has its weight on the meta device",
                "quantize_model quantizes loaded float weights",
                "load the float model first (or use load_model for a quantized checkpoint)",
            )
        )
    if module.in_features % _GROUP[fmt]:
        logger.info(
            "quantdispatch: %s stays float (in_features %d is not a multiple of %s's group %d)",
            name,
            module.in_features,
            fmt,
            _GROUP[fmt],
        )
        return None
    return QuantLinear.from_float(
        module,
        fmt,
        act_dtype=_act_dtype(act_dtype, module.weight.dtype),
        device=module.weight.device,
        **common,
    )

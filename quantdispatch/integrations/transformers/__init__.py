"""Whole models in HF transformers (>= 5) with quantized layers chosen by quantdispatch.

- :func:`load_model`: an NVFP4 / MXFP4 / FP8 checkpoint (ModelOpt, compressed-tensors, gpt-oss,
  FP8) -> a ``PreTrainedModel`` whose quantized linears are ``QuantLinear`` and whose MoE experts
  are ``QuantMoE``-backed, ready for ``generate()``.
- :func:`quantize_model`: a float model -> the same, weight-only, in place.
- :class:`QuantDispatchConfig`: ``AutoModelForCausalLM.from_pretrained(path,
  quantization_config=QuantDispatchConfig())`` takes the same path (see ``hf_quantizer``);
  :func:`hf_config` for checkpoints whose config.json has its own ``quantization_config``.
- :func:`install_fused_ops` / :func:`remove_fused_ops`: one kernel per RMSNorm (with the
  residual add) and gated activation (on by default in the three above).
- :func:`capture_decode`: a model's one-token decode step captured in a CUDA graph, for
  greedy or sampled generation at a fixed batch size.
- :func:`describe_model` / :func:`render_description`: what ``quantdispatch doctor --model``
  prints; reads tensor headers only and does not need transformers.

Names resolve lazily, so importing this package costs nothing until one is used; transformers
itself is imported only by the modules that need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "load_model": "loader",
    "quantize_model": "quantize",
    "QuantExperts": "moe_blocks",
    "SUPPORTED_EXPERTS": "moe_blocks",
    "QuantDispatchConfig": "hf_quantizer",
    "hf_config": "hf_quantizer",
    "describe_model": "describe",
    "render_description": "describe",
    "ReferenceBackendWarning": "common",
    "install_fused_ops": "fused_ops",
    "remove_fused_ops": "fused_ops",
    "capture_decode": "capture",
}

__all__ = [
    "SUPPORTED_EXPERTS",
    "QuantDispatchConfig",
    "QuantExperts",
    "ReferenceBackendWarning",
    "capture_decode",
    "describe_model",
    "hf_config",
    "install_fused_ops",
    "load_model",
    "quantize_model",
    "remove_fused_ops",
    "render_description",
]

if TYPE_CHECKING:
    from quantdispatch.integrations.transformers.capture import capture_decode
    from quantdispatch.integrations.transformers.common import ReferenceBackendWarning
    from quantdispatch.integrations.transformers.describe import (
        describe_model,
        render_description,
    )
    from quantdispatch.integrations.transformers.fused_ops import (
        install_fused_ops,
        remove_fused_ops,
    )
    from quantdispatch.integrations.transformers.hf_quantizer import QuantDispatchConfig, hf_config
    from quantdispatch.integrations.transformers.loader import load_model
    from quantdispatch.integrations.transformers.moe_blocks import SUPPORTED_EXPERTS, QuantExperts
    from quantdispatch.integrations.transformers.quantize import quantize_model


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

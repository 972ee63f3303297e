"""Which modules of a transformers model a checkpoint stores quantized, and the quantdispatch
layer for each: ``QuantLinear`` for a linear (its checkpoint tensors, or the separate shards of a
fused model linear), ``QuantExperts`` for an experts module. Used by ``load_model`` and by the
``from_pretrained`` hook."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.integrations.transformers.checkpoint import Checkpoint
from quantdispatch.integrations.transformers.common import replace_module, text_config
from quantdispatch.integrations.transformers.float_tensors import (
    load_float_experts,
    load_fused_float,
)
from quantdispatch.integrations.transformers.moe_blocks import (
    QuantExperts,
    experts_arch,
    is_experts_module,
    moe_options,
    unsupported_experts_error,
)

__all__ = ["FUSED_SHARDS", "build_layer", "layer_kwargs", "quantized_targets", "swap_in_quantized"]

#: A fused linear in the model and the separate shards a checkpoint may store instead.
FUSED_SHARDS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def layer_kwargs(device: torch.device, act_dtype: torch.dtype, policy: Any, settings: Any) -> dict:
    kwargs: dict[str, Any] = {"act_dtype": act_dtype, "device": device, "policy": policy}
    if settings is not None:
        kwargs["settings"] = settings
    return kwargs


def swap_in_quantized(
    model: nn.Module,
    ckpt: Checkpoint,
    *,
    device: torch.device,
    act_dtype: torch.dtype,
    policy: Any = None,
    settings: Any = None,
    targets: dict[str, nn.Module] | None = None,
) -> list[str]:
    """Replace every linear / experts module whose checkpoint tensors are quantized by its
    quantdispatch layer (``targets``: {name: original module}, default: found by walking the
    model). Float linears stored as separate shards of a fused module are loaded here too.
    Returns the names replaced."""
    kwargs = layer_kwargs(device, act_dtype, policy, settings)
    text_cfg = text_config(model)
    if targets is None:
        targets = quantized_targets(model, ckpt, load_float=True)
    for name, module in targets.items():
        replace_module(model, name, build_layer(name, module, ckpt, text_cfg, kwargs))
    return list(targets)


def quantized_targets(
    model: nn.Module, ckpt: Checkpoint, *, load_float: bool = False
) -> dict[str, nn.Module]:
    """{name: module} of the linears and experts modules the checkpoint stores quantized
    (``load_float``: float layers stored in another shape, separate q/k/v shards of a fused
    linear or per-expert linears, are loaded into their modules on the way)."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if is_experts_module(module):
            if _experts_quantized(name, module, ckpt, load_float=load_float):
                out[name] = module
        elif isinstance(module, nn.Linear):
            shards = _linear_shards(name, ckpt)
            kinds = {ckpt.linear_kind(s) for s in shards}
            if shards and kinds == {"quantized"}:
                out[name] = module
            elif len(shards) > 1 and kinds == {"float"} and load_float:
                load_fused_float(module, shards, ckpt)
            elif shards and len(kinds) > 1:
                raise CheckpointError(
                    format_error(
                        f"the shards {shards} of {name!r} mix quantized and float tensors",
                        "a fused layer's shards share one quantization",
                        "check the checkpoint",
                    )
                )
    return out


def build_layer(
    name: str, module: nn.Module, ckpt: Checkpoint, text_cfg: Any, kwargs: dict[str, Any]
) -> nn.Module:
    """The quantdispatch layer for a module the checkpoint stores quantized."""
    if not is_experts_module(module):
        shards = _linear_shards(name, ckpt)
        layer = QuantLinear.from_checkpoint(
            ckpt.view(*shards), shards if len(shards) > 1 else shards[0], ckpt.quant, **kwargs
        )
        _same_shape(name, shards, (layer.out_features, layer.in_features), module)
        return layer
    arch = experts_arch(module)
    if arch is None:
        raise unsupported_experts_error(name, module)
    opts = moe_options(module, name, text_cfg)
    ck_block = ckpt.name_for(name.rpartition(".")[0]) or name.rpartition(".")[0]
    moe = QuantMoE.from_checkpoint(
        ckpt.view(ck_block, recursive=True),
        ck_block,
        ckpt.quant,
        validate_ids=False,
        **opts,
        **kwargs,
    )
    return QuantExperts(moe, arch.name)


def _same_shape(name: str, shards: list[str], shape: tuple[int, int], module: nn.Module) -> None:
    """The quantized layer computes what the module it replaces would: same [N, K]."""
    want = (getattr(module, "out_features", None), getattr(module, "in_features", None))
    if shape != want:
        raise CheckpointError(
            format_error(
                f"the checkpoint's {' + '.join(shards)} is [N, K] = {list(shape)} but the "
                f"model's {name!r} is {list(want)}",
                "config.json describes the checkpoint's shapes (hidden size, heads, "
                "num_key_value_heads, intermediate size)",
                "use the config.json that came with these weights",
            )
        )


def _linear_shards(name: str, ckpt: Checkpoint) -> list[str]:
    """The checkpoint module(s) holding a model linear: itself, or a fused layer's shards."""
    ck = ckpt.name_for(name)
    if ck is not None:
        return [ck]
    parent, _, leaf = name.rpartition(".")
    shards = []
    for part in FUSED_SHARDS.get(leaf, ()):
        found = ckpt.name_for(f"{parent}.{part}" if parent else part)
        if found is None:
            return []
        shards.append(found)
    return shards


def _experts_quantized(name: str, module: nn.Module, ckpt: Checkpoint, *, load_float: bool) -> bool:
    block = name.rpartition(".")[0]
    base = f"{ckpt.name_for(block) or block}.experts"
    keys = ckpt.under(base + ".") + ckpt.module_keys(base)
    if any(
        k.endswith(("_blocks", ".weight_packed", ".weight_scale", ".weight_scale_inv"))
        for k in keys
    ):
        return True
    if (
        load_float
        and experts_arch(module) is not None
        and any(k.startswith(base + ".0.") for k in keys)
    ):
        load_float_experts(name, module, ckpt, base)
    # else: stacked float tensors under the model's own names, loaded with the rest
    return False

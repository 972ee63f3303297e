"""``load_model``: a quantized checkpoint folder -> a transformers model that generates.

Steps: read config.json and the quantization config; build the model from its config with every
parameter on the meta device (buffers such as RoPE frequencies are computed as usual: they are
small and not in checkpoints); put a ``QuantLinear`` in place of each linear whose checkpoint
tensors are quantized and a ``QuantExperts`` in place of each quantized experts module; load every
other tensor from the safetensors shards, one tensor at a time, straight to the device; tie what
the config ties. Relies on transformers >= 5 (experts modules called as
``experts(hidden_states, top_k_index, top_k_weights)``, ``AutoModelForCausalLM.from_config``).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.integrations.transformers.checkpoint import Checkpoint, open_checkpoint
from quantdispatch.integrations.transformers.common import (
    replace_module,
    resolve_device,
    warn_if_reference,
)
from quantdispatch.integrations.transformers.moe_blocks import (
    QuantExperts,
    experts_arch,
    is_experts_module,
    moe_options,
    unsupported_experts_error,
)

__all__ = ["load_model", "params_on_meta", "swap_in_quantized"]

logger = logging.getLogger("quantdispatch")

#: A fused linear in the model and the separate shards a checkpoint may store instead.
FUSED_SHARDS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device as it is registered (before
    a module's own init touches it), so building the model allocates no float weights; buffers
    stay where they are created."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def load_model(
    path: str | Path,
    *,
    device: torch.device | str | None = None,
    act_dtype: torch.dtype = torch.bfloat16,
    policy: Any = None,
    settings: Any = None,
    **from_config_kwargs: Any,
) -> Any:
    """Load a quantized checkpoint folder as a transformers ``PreTrainedModel`` (eval mode).

    ``device``: where the model runs (default: the current GPU, else the CPU). ``act_dtype``:
    the model's float dtype and its quantized layers' activation dtype. ``policy`` / ``settings``
    go to every layer's ``select()``. Other keyword arguments go to
    ``AutoModelForCausalLM.from_config`` (e.g. ``attn_implementation="sdpa"``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    ckpt = open_checkpoint(path)
    target = resolve_device(device)
    config = AutoConfig.from_pretrained(str(ckpt.path))
    quant_config = getattr(config, "quantization_config", None)
    if quant_config is not None:
        # building from the config must not start transformers' own quantizer
        del config.quantization_config
    from_config_kwargs.setdefault("dtype", act_dtype)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, **from_config_kwargs)
    if quant_config is not None:
        model.config.quantization_config = quant_config
    keep_fp32_params(model, act_dtype)
    swap_in_quantized(
        model, ckpt, device=target, act_dtype=act_dtype, policy=policy, settings=settings
    )
    load_float_tensors(model, ckpt, target)
    tie_weights(model, ckpt)
    model.to(target)
    if (ckpt.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(ckpt.path))
    model.eval()
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


def _text_config(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _layer_kwargs(device: torch.device, act_dtype: torch.dtype, policy: Any, settings: Any) -> dict:
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
    layer_kwargs = _layer_kwargs(device, act_dtype, policy, settings)
    text_config = _text_config(model)
    if targets is None:
        targets = quantized_targets(model, ckpt, load_fused_float=True)
    for name, module in targets.items():
        replace_module(model, name, build_layer(name, module, ckpt, text_config, layer_kwargs))
    return list(targets)


def quantized_targets(
    model: nn.Module, ckpt: Checkpoint, *, load_fused_float: bool = False
) -> dict[str, nn.Module]:
    """{name: module} of the linears and experts modules the checkpoint stores quantized."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if is_experts_module(module):
            if _experts_quantized(name, module, ckpt, load_float=load_fused_float):
                out[name] = module
        elif isinstance(module, nn.Linear):
            shards = _linear_shards(name, ckpt)
            kinds = {ckpt.linear_kind(s) for s in shards}
            if shards and kinds == {"quantized"}:
                out[name] = module
            elif len(shards) > 1 and kinds == {"float"} and load_fused_float:
                _load_fused_float(module, shards, ckpt)
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
    name: str, module: nn.Module, ckpt: Checkpoint, text_config: Any, layer_kwargs: dict[str, Any]
) -> nn.Module:
    """The quantdispatch layer for a module the checkpoint stores quantized."""
    if not is_experts_module(module):
        shards = _linear_shards(name, ckpt)
        return QuantLinear.from_checkpoint(
            ckpt.view(*shards), shards if len(shards) > 1 else shards[0], ckpt.quant, **layer_kwargs
        )
    arch = experts_arch(module)
    if arch is None:
        raise unsupported_experts_error(name, module)
    opts = moe_options(module, name, text_config)
    ck_block = ckpt.name_for(name.rpartition(".")[0]) or name.rpartition(".")[0]
    moe = QuantMoE.from_checkpoint(
        ckpt.view(ck_block, recursive=True),
        ck_block,
        ckpt.quant,
        validate_ids=False,
        **opts,
        **layer_kwargs,
    )
    return QuantExperts(moe, arch.name)


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


def _load_fused_float(module: nn.Linear, shards: list[str], ckpt: Checkpoint) -> None:
    dtype = module.weight.dtype
    module.weight = nn.Parameter(
        torch.cat([ckpt.state[f"{s}.weight"] for s in shards]).to(dtype), requires_grad=False
    )
    if module.bias is not None:
        module.bias = nn.Parameter(
            torch.cat([ckpt.state[f"{s}.bias"] for s in shards]).to(dtype), requires_grad=False
        )


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
        _load_float_experts(name, module, ckpt, base)
    # else: stacked float tensors under the model's own names, loaded with the rest
    return False


_FLOAT_NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _load_float_experts(name: str, module: nn.Module, ckpt: Checkpoint, base: str) -> None:
    """Per-expert float linears in the checkpoint -> the module's stacked parameters."""
    e = int(module.num_experts)
    for naming in _FLOAT_NAMINGS:
        if f"{base}.0.{naming[2]}.weight" in ckpt.state:
            gate_n, up_n, down_n = naming
            break
    else:
        raise CheckpointError(
            format_error(
                f"missing tensor '{base}.0.down_proj.weight' (experts of {name!r})",
                "float experts are stored per expert as gate_proj/up_proj/down_proj or w1/w3/w2",
                "pass the complete checkpoint",
            )
        )

    def stack(part: str) -> torch.Tensor:
        keys = [f"{base}.{i}.{part}.weight" for i in range(e)]
        missing = [k for k in keys if k not in ckpt.state]
        if missing:
            raise CheckpointError(
                format_error(
                    f"missing tensor {missing[0]!r} (experts of {name!r})",
                    f"every one of the {e} experts has {gate_n}/{up_n}/{down_n}",
                    "pass the complete checkpoint (all shards)",
                )
            )
        return torch.stack([ckpt.state[k] for k in keys])

    dtype = module.down_proj.dtype
    gate_up = torch.cat([stack(gate_n), stack(up_n)], dim=1)
    module.gate_up_proj = nn.Parameter(gate_up.to(dtype), requires_grad=False)
    module.down_proj = nn.Parameter(stack(down_n).to(dtype), requires_grad=False)


def load_float_tensors(model: nn.Module, ckpt: Checkpoint, device: torch.device) -> None:
    """Load every parameter and persistent buffer still on the meta device from the checkpoint;
    raise on the first one the checkpoint lacks (tied parameters are left to ``tie_weights``)."""
    tied = set(tied_targets(model))
    for mod_name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantMoE)):
            continue
        for pname, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            key = ckpt.tensor_name(full)
            if key is None:
                if full in tied:
                    continue
                raise _missing(full, module)
            t = ckpt.state[key]
            _check_shape(full, key, t, p)
            module._parameters[pname] = nn.Parameter(
                t.to(device=device, dtype=p.dtype), requires_grad=False
            )
        for bname, b in list(module._buffers.items()):
            if b is None or bname in module._non_persistent_buffers_set:
                continue
            full = f"{mod_name}.{bname}" if mod_name else bname
            key = ckpt.tensor_name(full)
            if key is not None:
                t = ckpt.state[key]
                _check_shape(full, key, t, b)
                module._buffers[bname] = t.to(device=device, dtype=b.dtype)
            elif b.device.type == "meta":
                raise _missing(full, module)


def _missing(full: str, module: nn.Module) -> CheckpointError:
    return CheckpointError(
        format_error(
            f"missing tensor {full!r} ({type(module).__name__}): the first tensor of the model "
            "that the checkpoint lacks",
            "every parameter of the model is in the checkpoint (quantized or float) unless the "
            "config ties it to another",
            "check that all shards are present (model.safetensors.index.json lists them) and "
            "that config.json belongs to these weights",
        )
    )


def _check_shape(full: str, key: str, t: torch.Tensor, p: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(p.shape):
        raise CheckpointError(
            format_error(
                f"checkpoint tensor {key!r} has shape {tuple(t.shape)} but the model's {full!r} "
                f"is {tuple(p.shape)}",
                "config.json describes the checkpoint's shapes",
                "use the config.json that came with these weights",
            )
        )


def tied_targets(model: nn.Module) -> dict[str, str]:
    """{tied parameter: its source} as the config says (e.g. lm_head.weight -> embeddings)."""
    getter = getattr(model, "get_expanded_tied_weights_keys", None)
    if getter is not None:
        return dict(getter(all_submodels=True) or {})
    cfg = _text_config(model)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(cfg, "tie_word_embeddings", False) and out_emb is not None:
        names = {id(m): n for n, m in model.named_modules()}
        inp = names.get(id(model.get_input_embeddings()))
        out = names.get(id(out_emb))
        if inp is not None and out is not None:
            return {f"{out}.weight": f"{inp}.weight"}
    return {}


def tie_weights(model: nn.Module, ckpt: Checkpoint | None) -> None:
    """Tie each tied parameter to its source unless the checkpoint stores it separately or the
    module was replaced by a quantized layer."""
    for target, source in tied_targets(model).items():
        mod_name, _, leaf = target.rpartition(".")
        module = model.get_submodule(mod_name) if mod_name else model
        if isinstance(module, (QuantLinear, QuantMoE)):
            continue
        current = module._parameters.get(leaf)
        if current is not None and current.device.type != "meta":
            continue  # stored in the checkpoint: keep it
        src = model.get_parameter(source)
        if src.device.type == "meta":
            raise _missing(source, module)
        setattr(module, leaf, src)

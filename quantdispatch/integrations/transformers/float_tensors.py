"""The float tensors of a checkpoint into a transformers model built on the meta device: every
parameter and persistent buffer still on meta is read from the shards (one tensor at a time,
straight to its dtype and device), float experts stored per expert are stacked into the model's
3-D parameters, a fused model linear is concatenated from its shards, and tied parameters are
tied as the config says."""

from __future__ import annotations

import torch
from torch import nn

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.integrations.transformers.checkpoint import Checkpoint
from quantdispatch.integrations.transformers.common import text_config

__all__ = [
    "load_float_experts",
    "load_float_tensors",
    "load_fused_float",
    "tie_weights",
    "tied_targets",
]


def load_fused_float(module: nn.Linear, shards: list[str], ckpt: Checkpoint) -> None:
    """A fused model linear (q/k/v, gate/up) from its separate float shards."""
    dtype = module.weight.dtype
    parts = [ckpt.state[f"{s}.weight"] for s in shards]
    rows = sum(int(p.shape[0]) for p in parts)
    shape = (rows, *parts[0].shape[1:]) if len({p.shape[1:] for p in parts}) == 1 else None
    key = " + ".join(f"{s}.weight" for s in shards)
    if shape != tuple(module.weight.shape):
        raise CheckpointError(
            format_error(
                f"checkpoint tensors {key} have shapes {[tuple(p.shape) for p in parts]} but "
                f"the model's fused weight is {tuple(module.weight.shape)}",
                "config.json describes the checkpoint's shapes (heads, num_key_value_heads, "
                "intermediate size)",
                "use the config.json that came with these weights",
            )
        )
    module.weight = nn.Parameter(torch.cat(parts).to(dtype), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(
            torch.cat([ckpt.state[f"{s}.bias"] for s in shards]).to(dtype), requires_grad=False
        )


_FLOAT_NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def load_float_experts(name: str, module: nn.Module, ckpt: Checkpoint, base: str) -> None:
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
    cfg = text_config(model)
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

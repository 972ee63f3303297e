"""Read one quantized linear layer's tensors into ONE canonical in-memory weight.

Whatever the producer, the result is an ``Nvfp4Weight`` (global scale as a multiplier),
``Mxfp4Weight`` or ``Fp8Weight``. The tensor names decide the convention; a quant config, when
given, must agree with them. Missing tensors, unexpected tensors, and tensors that contradict
the config are errors that name the tensor, the rule and the fix.

- ModelOpt NVFP4: weight (uint8 [N, K/2]), weight_scale (e4m3 [N, K/16]), weight_scale_2,
  input_scale (W4A4 only).
- compressed-tensors NVFP4: weight_packed, weight_scale (e4m3), weight_global_scale (the
  RECIPROCAL of ModelOpt's), input_global_scale (W4A4 only), weight_shape.
- compressed-tensors MXFP4: weight_packed, weight_scale (uint8 e8m0), weight_shape.
- gpt-oss MXFP4: ``prefix_blocks`` ([N, K/32, 16] uint8), ``prefix_scales`` ([N, K/32]).
- FP8 (ModelOpt, compressed-tensors): weight (e4m3), weight_scale (one value, [N] or blocks),
  input_scale (static activations).
- FP8 DeepSeek: weight (e4m3), weight_scale_inv ([ceil(N/128), ceil(K/128)], a multiplier).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quantdispatch.checkpoints.config import LayerQuant
from quantdispatch.errors import CheckpointError, WeightFormatError, format_error
from quantdispatch.formats import (
    Fp8Weight,
    Mxfp4Weight,
    Nvfp4Weight,
    global_scale_from_compressed_tensors,
    merge_nvfp4_shards,
)
from quantdispatch.request import Scheme

__all__ = ["LoadedLinear", "QuantWeight", "merge_shards", "read_linear"]

QuantWeight = Nvfp4Weight | Mxfp4Weight | Fp8Weight

#: Tensors a linear's prefix may carry that belong to attention, not to the GEMM.
_IGNORED = frozenset({"k_scale", "v_scale", "q_scale", "prob_scale"})

_MODELOPT_NAMES = {
    "packed": "weight",
    "block_scale": "weight_scale",
    "global_scale": "weight_scale_2",
    "input_scale": "input_scale",
}
_CT_NAMES = {
    "packed": "weight_packed",
    "block_scale": "weight_scale",
    "global_scale": "1/weight_global_scale",
    "input_scale": "1/input_global_scale",
}
_CT_MX_NAMES = {"packed": "weight_packed", "block_scale": "weight_scale"}

_ALLOWED = {
    "modelopt-nvfp4": {"weight", "weight_scale", "weight_scale_2", "input_scale", "bias"},
    "ct-nvfp4": {
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
        "weight_shape",
        "bias",
    },
    "ct-mxfp4": {"weight_packed", "weight_scale", "weight_shape", "bias"},
    "fp8": {"weight", "weight_scale", "input_scale", "bias"},
    "fp8-scale-inv": {"weight", "weight_scale_inv", "bias"},
}


@dataclass(frozen=True)
class LoadedLinear:
    """A layer's canonical weight, scheme, bias and where they came from."""

    weight: QuantWeight
    scheme: Scheme
    bias: torch.Tensor | None
    convention: str

    @property
    def format(self) -> str:
        return {Nvfp4Weight: "nvfp4", Mxfp4Weight: "mxfp4", Fp8Weight: "fp8"}[type(self.weight)]


def _fail(what: str, rule: str, fix: str) -> CheckpointError:
    return CheckpointError(format_error(what, rule, fix))


def _children(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """Direct children ``prefix.<name>`` -> full key."""
    out = {}
    dot = prefix + "."
    for k in keys:
        if k.startswith(dot) and "." not in k[len(dot) :]:
            out[k[len(dot) :]] = k
    return out


def _detect(names: set[str], sd: Mapping[str, torch.Tensor], prefix: str) -> str:
    if "weight_packed" in names:
        scale = sd[f"{prefix}.weight_scale"] if "weight_scale" in names else None
        if "weight_global_scale" in names or (
            scale is not None and scale.dtype == torch.float8_e4m3fn
        ):
            return "ct-nvfp4"
        return "ct-mxfp4"
    if "weight" in names:
        w = sd[f"{prefix}.weight"]
        if w.dtype == torch.uint8:
            return "modelopt-nvfp4"
        if w.dtype == torch.float8_e4m3fn:
            return "fp8-scale-inv" if "weight_scale_inv" in names else "fp8"
        raise _fail(
            f"{prefix}.weight is {w.dtype}: this layer is not quantized",
            "QuantLinear loads NVFP4, MXFP4 or FP8 weights",
            "load it as torch.nn.Linear (the config's ignore / exclude_modules lists such layers)",
        )
    raise _fail(
        f"no quantized weight under {prefix!r} (found: {sorted(names) or 'nothing'})",
        "expected weight (ModelOpt / FP8), weight_packed (compressed-tensors) or "
        f"{prefix}_blocks (gpt-oss)",
        "check the prefix (e.g. 'model.layers.0.mlp.down_proj', without a trailing '.weight')",
    )


def _need(sd: Mapping[str, torch.Tensor], prefix: str, name: str, why: str) -> torch.Tensor:
    key = f"{prefix}.{name}"
    if key not in sd:
        raise _fail(f"missing tensor {key!r}", why, "pass the complete state dict of the layer")
    return sd[key]


def _scalar(t: torch.Tensor, key: str) -> torch.Tensor:
    if t.numel() != 1:
        raise _fail(
            f"{key} has shape {tuple(t.shape)}",
            "this per-tensor scale is a single float32 value",
            "pass the layer's own scalar (per-shard scales of a fused layer are merged with "
            "merge_shards)",
        )
    return t.reshape(()).to(torch.float32)


def _check_shape_tensor(
    sd: Mapping[str, torch.Tensor], prefix: str, names: set[str], n: int, k: int
):
    if "weight_shape" in names:
        shape = tuple(int(v) for v in sd[f"{prefix}.weight_shape"].tolist())
        if shape != (n, k):
            raise _fail(
                f"{prefix}.weight_shape says {shape} but the packed tensors give {(n, k)}",
                "weight_shape records the unpacked [N, K] of the packed weight",
                "the checkpoint is inconsistent: re-export it",
            )


def _fp8_scale(
    scale: torch.Tensor, key: str, n: int, k: int, block: tuple[int, int] | None
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(()), None
    if scale.dim() in (1, 2) and scale.shape[0] == n and scale.numel() == n:
        return scale.reshape(n), None
    if scale.dim() == 2:
        candidates = [block] if block else [(128, 128)]
        for bn, bk in candidates:
            if scale.shape == (-(-n // bn), -(-k // bk)):
                return scale, (bn, bk)
    raise _fail(
        f"{key} has shape {tuple(scale.shape)} for a weight of shape {(n, k)}",
        "FP8 weight scales are one value (per tensor), [N] (per channel) or "
        "[ceil(N/bn), ceil(K/bk)] (blocks, 128x128 unless the config says otherwise)",
        "pass the quant config so the block size is known, or check the tensor",
    )


def read_linear(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str,
    quant: LayerQuant | None = None,
    *,
    device: torch.device | str | None = None,
) -> LoadedLinear:
    """Read the quantized linear at ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``).

    ``quant`` (from ``QuantConfig.layer(prefix)``) is optional: without it the format and
    scheme come from the tensors; with it, they must agree.
    """
    prefix = prefix.rstrip(".")
    if prefix.endswith(".weight"):
        prefix = prefix[: -len(".weight")]
    keys = list(state_dict.keys())
    if f"{prefix}_blocks" in state_dict or f"{prefix}_scales" in state_dict:
        loaded = _read_gpt_oss(state_dict, prefix, keys)
    else:
        children = _children(keys, prefix)
        names = set(children) - _IGNORED
        convention = _detect(names, state_dict, prefix)
        unexpected = names - _ALLOWED[convention]
        if unexpected:
            raise _fail(
                f"unexpected tensor(s) {sorted(f'{prefix}.{u}' for u in unexpected)} for a "
                f"{convention} layer",
                f"a {convention} layer has {sorted(_ALLOWED[convention])}",
                "check that the prefix names one layer and that the checkpoint is not a mix of "
                "conventions",
            )
        loaded = _READERS[convention](state_dict, prefix, names, quant)
    if device is not None:
        loaded = LoadedLinear(
            weight=loaded.weight.to(device),
            scheme=loaded.scheme,
            bias=None if loaded.bias is None else loaded.bias.to(device),
            convention=loaded.convention,
        )
    _check_against_config(loaded, quant, prefix)
    return loaded


def _build(cls: type, prefix: str, tensor_names: Mapping[str, str], **fields: Any) -> Any:
    """Construct (and so validate) a canonical weight; name the checkpoint tensors on failure."""
    try:
        return cls(**fields)
    except WeightFormatError as exc:
        where = ", ".join(
            f"{field} = {prefix}{'' if name.startswith('_') else '.'}{name}"
            for field, name in tensor_names.items()
        )
        raise type(exc)(f"in checkpoint layer {prefix!r} ({where}): {exc}") from None


def _bias(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor | None:
    return sd.get(key)


def _read_modelopt_nvfp4(sd, prefix, names, quant) -> LoadedLinear:
    why = "a ModelOpt NVFP4 layer has weight, weight_scale and weight_scale_2"
    packed = _need(sd, prefix, "weight", why)
    bs = _need(sd, prefix, "weight_scale", why)
    gs = _scalar(_need(sd, prefix, "weight_scale_2", why), f"{prefix}.weight_scale_2")
    inp = sd.get(f"{prefix}.input_scale")
    input_scale = None if inp is None else _scalar(inp, f"{prefix}.input_scale")
    weight = _build(
        Nvfp4Weight,
        prefix,
        _MODELOPT_NAMES,
        packed=packed,
        block_scale=bs,
        global_scale=gs,
        input_scale=input_scale,
    )
    scheme = _scheme(quant, input_scale is not None, prefix, "input_scale")
    return LoadedLinear(weight, scheme, _bias(sd, f"{prefix}.bias"), "modelopt-nvfp4")


def _read_ct_nvfp4(sd, prefix, names, quant) -> LoadedLinear:
    why = "a compressed-tensors NVFP4 layer has weight_packed, weight_scale, weight_global_scale"
    packed = _need(sd, prefix, "weight_packed", why)
    bs = _need(sd, prefix, "weight_scale", why)
    gs_ct = _need(sd, prefix, "weight_global_scale", why)
    gs = global_scale_from_compressed_tensors(_scalar(gs_ct, f"{prefix}.weight_global_scale"))
    inp = sd.get(f"{prefix}.input_global_scale")
    input_scale = None
    if inp is not None:
        input_scale = global_scale_from_compressed_tensors(
            _scalar(inp, f"{prefix}.input_global_scale")
        )
    weight = _build(
        Nvfp4Weight,
        prefix,
        _CT_NAMES,
        packed=packed,
        block_scale=bs,
        global_scale=gs.reshape(()),
        input_scale=input_scale,
    )
    _check_shape_tensor(sd, prefix, names, *weight.shape)
    scheme = _scheme(quant, input_scale is not None, prefix, "input_global_scale")
    return LoadedLinear(weight, scheme, _bias(sd, f"{prefix}.bias"), "ct-nvfp4")


def _read_ct_mxfp4(sd, prefix, names, quant) -> LoadedLinear:
    why = "a compressed-tensors MXFP4 layer has weight_packed and weight_scale"
    packed = _need(sd, prefix, "weight_packed", why)
    scale = _need(sd, prefix, "weight_scale", why)
    weight = _build(Mxfp4Weight, prefix, _CT_MX_NAMES, packed=packed, block_scale=scale)
    _check_shape_tensor(sd, prefix, names, *weight.shape)
    return LoadedLinear(weight, Scheme.WEIGHT_ONLY, _bias(sd, f"{prefix}.bias"), "ct-mxfp4")


def _read_fp8(sd, prefix, names, quant) -> LoadedLinear:
    w = _need(sd, prefix, "weight", "an FP8 layer has weight and weight_scale")
    n, k = w.shape if w.dim() == 2 else (0, 0)
    inv = "weight_scale_inv" in names
    name = "weight_scale_inv" if inv else "weight_scale"
    raw_scale = _need(sd, prefix, name, "an FP8 layer has a weight scale")
    block = quant.fp8_block if quant else None
    scale, block = _fp8_scale(raw_scale, f"{prefix}.{name}", n, k, block)
    inp = sd.get(f"{prefix}.input_scale")
    input_scale = None if inp is None else _scalar(inp, f"{prefix}.input_scale")
    weight = _build(
        Fp8Weight,
        prefix,
        {"weight": "weight", "scale": name, "input_scale": "input_scale"},
        weight=w,
        scale=scale,
        block_size=block,
        input_scale=input_scale,
    )
    # FP8 checkpoints are W8A8 unless their config says otherwise (dynamic activation scales
    # leave no input_scale tensor behind).
    scheme = quant.scheme if quant is not None else Scheme.WEIGHT_ACT
    return LoadedLinear(
        weight, scheme, _bias(sd, f"{prefix}.bias"), "fp8-scale-inv" if inv else "fp8"
    )


def _read_gpt_oss(sd, prefix, keys) -> LoadedLinear:
    why = "a gpt-oss MXFP4 tensor comes as {prefix}_blocks and {prefix}_scales"
    if f"{prefix}_blocks" not in sd or f"{prefix}_scales" not in sd:
        missing = [f"{prefix}{s}" for s in ("_blocks", "_scales") if f"{prefix}{s}" not in sd]
        raise _fail(f"missing tensor(s) {missing}", why, "pass both tensors")
    blocks, scales = sd[f"{prefix}_blocks"], sd[f"{prefix}_scales"]
    if blocks.dim() != 3 or blocks.shape[-1] != 16:
        raise _fail(
            f"{prefix}_blocks has shape {tuple(blocks.shape)}",
            "gpt-oss blocks of a linear are [N, K/32, 16] bytes (32 codes per 16 bytes)",
            "for stacked experts use QuantMoE.from_checkpoint",
        )
    n = blocks.shape[0]
    weight = _build(
        Mxfp4Weight,
        prefix,
        {"packed": "_blocks", "block_scale": "_scales"},
        packed=blocks.reshape(n, -1),
        block_scale=scales,
    )
    return LoadedLinear(weight, Scheme.WEIGHT_ONLY, _bias(sd, f"{prefix}_bias"), "gpt-oss")


_READERS = {
    "modelopt-nvfp4": _read_modelopt_nvfp4,
    "ct-nvfp4": _read_ct_nvfp4,
    "ct-mxfp4": _read_ct_mxfp4,
    "fp8": _read_fp8,
    "fp8-scale-inv": _read_fp8,
}


def _scheme(quant: LayerQuant | None, has_input: bool, prefix: str, input_name: str) -> Scheme:
    tensors_say = Scheme.WEIGHT_ACT if has_input else Scheme.WEIGHT_ONLY
    if quant is None or quant.scheme == tensors_say:
        return tensors_say
    if quant.scheme is Scheme.WEIGHT_ACT:
        raise _fail(
            f"missing tensor '{prefix}.{input_name}': the config says W4A4 (weights and "
            "activations) but the layer has no activation scale",
            "a W4A4 checkpoint carries a calibrated activation scale per layer",
            "pass the complete state dict, or a config saying weight-only (W4A16_NVFP4 / no "
            "input_activations) if that is what the checkpoint is",
        )
    raise _fail(
        f"unexpected tensor '{prefix}.{input_name}': the config says weight-only (W4A16) but "
        "the layer carries an activation scale",
        "weight-only checkpoints have no activation scales",
        "check that the config belongs to these tensors",
    )


def _check_against_config(loaded: LoadedLinear, quant: LayerQuant | None, prefix: str) -> None:
    if quant is not None and quant.format != loaded.format:
        raise _fail(
            f"the quant config says {prefix!r} is {quant.format} but its tensors are "
            f"{loaded.format} ({loaded.convention})",
            "the config and the tensors must describe the same format",
            "pass the config that belongs to this checkpoint (or none, to trust the tensors)",
        )


# ---------------------------------------------------------------------------------------------
# Fused layers (q/k/v, gate/up): shards with their own per-tensor scales, merged exactly.


def merge_shards(shards: Sequence[LoadedLinear]) -> LoadedLinear:
    """Concatenate shards along N. NVFP4 per-tensor scales are merged by rescaling the block
    scales (``merge_nvfp4_shards``, bounded e4m3 re-rounding, exact for power-of-two ratios);
    FP8 per-tensor scales that differ become exact per-channel scales."""
    if not shards:
        raise _fail("merge_shards got no shards", "pass at least one", "")
    formats = {s.format for s in shards}
    schemes = {s.scheme for s in shards}
    if len(formats) != 1 or len(schemes) != 1:
        raise _fail(
            f"shards mix formats {sorted(formats)} / schemes {sorted(x.value for x in schemes)}",
            "a fused layer's shards share one format and scheme",
            "check the prefixes",
        )
    fmt = formats.pop()
    bias = _merge_bias(shards)
    if fmt == "nvfp4":
        weight: Any = merge_nvfp4_shards([s.weight for s in shards])
    elif fmt == "mxfp4":
        weight = Mxfp4Weight(
            packed=torch.cat([s.weight.packed for s in shards]),
            block_scale=torch.cat([s.weight.block_scale for s in shards]),
        )
    else:
        weight = _merge_fp8([s.weight for s in shards])
    return LoadedLinear(weight, shards[0].scheme, bias, shards[0].convention)


def _merge_bias(shards: Sequence[LoadedLinear]) -> torch.Tensor | None:
    if all(s.bias is None for s in shards):
        return None
    parts = []
    for s in shards:
        n = s.weight.shape[0]
        parts.append(s.bias if s.bias is not None else torch.zeros(n, dtype=torch.float32))
    return torch.cat([p.to(torch.float32) for p in parts])


def _merge_fp8(ws: Sequence[Fp8Weight]) -> Fp8Weight:
    kinds = {w.scale_kind for w in ws}
    blocks = {w.block_size for w in ws}
    weight = torch.cat([w.weight for w in ws])
    inputs = [w.input_scale for w in ws]
    input_scale = None
    if all(i is not None for i in inputs):
        input_scale = torch.stack([i for i in inputs if i is not None]).amax()
    if kinds == {"block"}:
        ((bn, bk),) = blocks if len(blocks) == 1 else [(0, 0)]
        if len(blocks) != 1 or any(w.shape[0] % bn for w in ws[:-1]):
            raise _fail(
                f"FP8 block-scaled shards with N = {[w.shape[0] for w in ws]} and blocks {blocks}",
                "block-scaled shards can be fused only if every shard but the last fills whole "
                "blocks along N",
                "keep these projections as separate layers",
            )
        return Fp8Weight(
            weight=weight,
            scale=torch.cat([w.scale for w in ws]),
            block_size=(bn, bk),
            input_scale=input_scale,
        )
    if "block" in kinds:
        raise _fail(
            f"FP8 shards mix scale kinds {sorted(kinds)}",
            "block-scaled shards fuse only with block-scaled shards",
            "keep these projections as separate layers",
        )
    # Per-tensor and per-channel scales concatenate exactly as per-channel scales.
    scales = [w.scale.expand(w.shape[0]) if w.scale.dim() == 0 else w.scale for w in ws]
    return Fp8Weight(
        weight=weight, scale=torch.cat(scales), block_size=None, input_scale=input_scale
    )

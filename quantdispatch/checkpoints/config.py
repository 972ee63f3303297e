"""Quantization configs of the producers we read, reduced to one question per module:
"which format and scheme is this layer, or is it left unquantized?"

Producers and where their config lives:

- NVIDIA ModelOpt: legacy ``hf_quant_config.json`` ``{"quantization": {"quant_algo": "NVFP4",
  "group_size": 16, "exclude_modules": [...]}}``, or ``config.json`` ``quantization_config``
  with ``quant_method: modelopt`` and exclusions under ``ignore`` (``*`` wildcards).
  ``quant_algo``: NVFP4 (W4A4), W4A16_NVFP4 / NVFP4_AWQ-free weight-only, FP8, or
  MIXED_PRECISION with a per-layer ``quantized_layers`` table.
- compressed-tensors / llm-compressor: ``quant_method: compressed-tensors`` with a ``format``
  (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``, ``float-quantized``), ``config_groups``
  (targets + weight / input_activations args) and ``ignore`` (names or ``re:`` regexes).
- gpt-oss (transformers ``Mxfp4Config``): ``quant_method: mxfp4``, ``modules_to_not_convert``.
- DeepSeek-style FP8: ``quant_method: fp8`` with ``weight_block_size`` (``weight_scale_inv``).
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.request import Scheme

__all__ = ["LayerQuant", "QuantConfig", "load_quant_config", "parse_quant_config"]


@dataclass(frozen=True)
class LayerQuant:
    """How one layer is quantized."""

    format: str
    scheme: Scheme
    fp8_block: tuple[int, int] | None = None
    """FP8 block size (e.g. (128, 128)) when the config states one."""


@dataclass(frozen=True)
class QuantConfig:
    """A producer's config reduced to per-module answers (see :meth:`layer`)."""

    producer: str
    default: LayerQuant | None
    exclude: tuple[str, ...] = ()
    """ModelOpt-style wildcard patterns, or compressed-tensors names / ``re:`` regexes."""
    per_layer: Mapping[str, LayerQuant] | None = None
    """MIXED_PRECISION: only the listed layers are quantized, each its own way."""
    targets: tuple[tuple[tuple[str, ...], LayerQuant], ...] = ()
    """compressed-tensors config groups: (targets, quant) in order."""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def is_excluded(self, module: str) -> bool:
        for pattern in self.exclude:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif fnmatch.fnmatchcase(module, pattern) or module == pattern:
                return True
        return False

    def layer(self, module: str) -> LayerQuant | None:
        """The quantization of ``module`` (a dotted name), or None if it stays unquantized."""
        if self.is_excluded(module):
            return None
        if self.per_layer is not None:
            for name, quant in self.per_layer.items():
                if fnmatch.fnmatchcase(module, name) or module == name:
                    return quant
            return None
        if self.targets:
            for targets, quant in self.targets:
                for t in targets:
                    if t == "Linear" or t == module:
                        return quant
                    if t.startswith("re:") and re.match(t[3:], module):
                        return quant
            return None
        return self.default


def _fail(what: str, rule: str, fix: str) -> CheckpointError:
    return CheckpointError(format_error(what, rule, fix))


_MODELOPT_ALGOS: dict[str, LayerQuant] = {
    "NVFP4": LayerQuant("nvfp4", Scheme.WEIGHT_ACT),
    "W4A16_NVFP4": LayerQuant("nvfp4", Scheme.WEIGHT_ONLY),
    "NVFP4_W4A16": LayerQuant("nvfp4", Scheme.WEIGHT_ONLY),
    "FP8": LayerQuant("fp8", Scheme.WEIGHT_ACT),
    "FP8_PER_CHANNEL_PER_TOKEN": LayerQuant("fp8", Scheme.WEIGHT_ACT),
}


def _modelopt_algo(algo: object, where: str) -> LayerQuant:
    key = str(algo).upper() if algo is not None else ""
    if key not in _MODELOPT_ALGOS:
        raise _fail(
            f"unknown ModelOpt quant_algo {algo!r} ({where})",
            f"quantdispatch reads {', '.join(_MODELOPT_ALGOS)} and MIXED_PRECISION",
            "check the checkpoint's hf_quant_config.json / quantization_config, or open an issue "
            "for this algorithm",
        )
    return _MODELOPT_ALGOS[key]


def _group_size(section: Mapping[str, Any], expected: int, where: str) -> None:
    gs = section.get("group_size")
    if gs is not None and int(gs) != expected:
        raise _fail(
            f"{where}: group_size={gs}",
            f"NVFP4 uses a group size of exactly {expected}",
            "this checkpoint is not NVFP4; check its quant_algo",
        )


def _parse_modelopt(q: Mapping[str, Any]) -> QuantConfig:
    algo = str(q.get("quant_algo", "")).upper()
    exclude = tuple(q.get("exclude_modules") or q.get("ignore") or ())
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers")
        if not isinstance(layers, Mapping) or not layers:
            raise _fail(
                "ModelOpt MIXED_PRECISION config without a quantized_layers table",
                "mixed checkpoints list each quantized layer with its quant_algo",
                "use the checkpoint's own hf_quant_config.json",
            )
        per_layer: dict[str, LayerQuant] = {}
        for name, spec in layers.items():
            if not isinstance(spec, Mapping):
                raise _fail(
                    f"quantized_layers[{name!r}] is {spec!r}",
                    'each entry is a table like {"quant_algo": "NVFP4", "group_size": 16}',
                    "fix the config",
                )
            quant = _modelopt_algo(spec.get("quant_algo"), f"quantized_layers[{name!r}]")
            if quant.format == "nvfp4":
                _group_size(spec, 16, f"quantized_layers[{name!r}]")
            per_layer[name] = quant
        return QuantConfig("modelopt", None, exclude, per_layer=per_layer, raw=q)
    quant = _modelopt_algo(q.get("quant_algo"), "quant_algo")
    if quant.format == "nvfp4":
        _group_size(q, 16, "quant_algo NVFP4")
    return QuantConfig("modelopt", quant, exclude, raw=q)


def _ct_group_quant(name: str, group: Mapping[str, Any], fmt_hint: str | None) -> LayerQuant:
    w = group.get("weights") or {}
    bits, typ = w.get("num_bits"), w.get("type")
    gsize = w.get("group_size")
    acts = group.get("input_activations")
    scheme = Scheme.WEIGHT_ACT if acts else Scheme.WEIGHT_ONLY
    fmt = group.get("format") or fmt_hint
    if bits == 4 and typ == "float":
        if gsize == 16 or fmt == "nvfp4-pack-quantized":
            return LayerQuant("nvfp4", scheme)
        if gsize == 32 or fmt == "mxfp4-pack-quantized":
            return LayerQuant("mxfp4", Scheme.WEIGHT_ONLY if not acts else scheme)
    if bits == 8 and typ == "float":
        block = None
        if w.get("strategy") == "block":
            bs = w.get("block_structure") or [128, 128]
            block = (int(bs[0]), int(bs[1]))
        return LayerQuant("fp8", scheme, fp8_block=block)
    raise _fail(
        f"compressed-tensors config group {name!r}: weights num_bits={bits} type={typ} "
        f"group_size={gsize} (format {fmt!r})",
        "quantdispatch reads NVFP4 (4-bit float, group 16), MXFP4 (4-bit float, group 32) and "
        "FP8 (8-bit float) weights",
        "load this layer with the engine's own loader",
    )


def _parse_compressed_tensors(q: Mapping[str, Any]) -> QuantConfig:
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _fail(
            "compressed-tensors config without config_groups",
            "config_groups say which modules are quantized and how",
            "use the checkpoint's own config.json",
        )
    fmt = q.get("format")
    targets = []
    for name, group in groups.items():
        quant = _ct_group_quant(name, group, fmt)
        targets.append((tuple(group.get("targets") or ("Linear",)), quant))
    return QuantConfig(
        "compressed-tensors", None, tuple(q.get("ignore") or ()), targets=tuple(targets), raw=q
    )


def parse_quant_config(cfg: Mapping[str, Any]) -> QuantConfig:
    """Parse a ModelOpt ``hf_quant_config.json``, a ``config.json`` or its quantization_config."""
    if not isinstance(cfg, Mapping):
        raise _fail(
            f"quant config is a {type(cfg).__name__}",
            "pass the parsed JSON mapping (hf_quant_config.json, config.json or its "
            "quantization_config)",
            "json.load the file first, or use load_quant_config(path)",
        )
    if "quantization_config" in cfg:
        cfg = cfg["quantization_config"]
    if "quantization" in cfg and isinstance(cfg["quantization"], Mapping):  # legacy ModelOpt
        return _parse_modelopt(cfg["quantization"])
    method = str(cfg.get("quant_method", "")).lower()
    if method == "modelopt":
        return _parse_modelopt(cfg)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    if method == "mxfp4":
        return QuantConfig(
            "gpt-oss",
            LayerQuant("mxfp4", Scheme.WEIGHT_ONLY),
            tuple(cfg.get("modules_to_not_convert") or ()),
            raw=cfg,
        )
    if method == "fp8":
        block = cfg.get("weight_block_size")
        scheme = Scheme.WEIGHT_ACT
        return QuantConfig(
            "fp8",
            LayerQuant("fp8", scheme, fp8_block=(int(block[0]), int(block[1])) if block else None),
            tuple(cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or ()),
            raw=cfg,
        )
    raise _fail(
        f"unknown quantization config (quant_method={cfg.get('quant_method')!r}, "
        f"keys {sorted(cfg)[:8]})",
        "quantdispatch reads ModelOpt (modelopt / hf_quant_config.json), compressed-tensors, "
        "gpt-oss mxfp4 and fp8 configs",
        "pass the checkpoint's config.json, hf_quant_config.json or quantization_config",
    )


def load_quant_config(path: str | Path) -> QuantConfig | None:
    """Read the quant config of a checkpoint folder (or a JSON file); None if unquantized."""
    p = Path(path)
    files = [p] if p.is_file() else [p / "hf_quant_config.json", p / "config.json"]
    for f in files:
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise _fail(
                f"{f} cannot be read as JSON: {exc}", "configs are JSON", "fix the file"
            ) from None
        if f.name == "config.json" and "quantization_config" not in data:
            continue
        return parse_quant_config(data)
    return None

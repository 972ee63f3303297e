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

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantdispatch.checkpoints.config_schema import (
    CompressedTensorsConfig,
    CtGroup,
    Fp8Config,
    ModeloptConfig,
    Mxfp4Config,
    validate,
)
from quantdispatch.checkpoints.patterns import ModulePattern, any_match, compile_patterns
from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.request import Scheme

__all__ = ["LayerQuant", "QuantConfig", "load_quant_config", "parse_quant_config"]

#: Largest config file read (real ones are kilobytes; a mixed-precision table of a big model
#: a few megabytes).
MAX_CONFIG_BYTES = 64 << 20


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
    source: str = field(default="<quantization config>", compare=False, repr=False)
    """The file (or mapping) this config came from, for error messages."""
    _compiled: dict[str, tuple[ModulePattern, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        # every pattern is compiled (and checked) once, here
        c = self._compiled
        c["exclude"] = compile_patterns(self.exclude, f"{self.source}: ignore", CheckpointError)
        if self.per_layer is not None:
            c["per_layer"] = compile_patterns(
                self.per_layer, f"{self.source}: quantized_layers", CheckpointError
            )
        for i, (targets, _) in enumerate(self.targets):
            names = [t for t in targets if t != "Linear"]
            c[f"targets{i}"] = compile_patterns(
                names, f"{self.source}: config_groups targets", CheckpointError
            )

    def excluded_by(self, module: str) -> str | None:
        """The exclusion pattern that matches ``module``, or None."""
        hit = any_match(self._compiled["exclude"], module)
        return None if hit is None else hit.text

    def is_excluded(self, module: str) -> bool:
        return self.excluded_by(module) is not None

    def layer(self, module: str) -> LayerQuant | None:
        """The quantization of ``module`` (a dotted name), or None if it stays unquantized."""
        if self.is_excluded(module):
            return None
        if self.per_layer is not None:
            hit = any_match(self._compiled["per_layer"], module)
            return None if hit is None else self.per_layer[hit.text]
        if self.targets:
            for i, (targets, quant) in enumerate(self.targets):
                if "Linear" in targets or any_match(self._compiled[f"targets{i}"], module):
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


def _modelopt_algo(algo: str | None, where: str) -> LayerQuant:
    key = algo.upper() if algo is not None else ""
    if key not in _MODELOPT_ALGOS:
        raise _fail(
            f"unknown ModelOpt quant_algo {algo!r} ({where})",
            f"quantdispatch reads {', '.join(_MODELOPT_ALGOS)} and MIXED_PRECISION",
            "check the checkpoint's hf_quant_config.json / quantization_config, or open an issue "
            "for this algorithm",
        )
    return _MODELOPT_ALGOS[key]


def _group_size(gs: int | None, expected: int, where: str) -> None:
    if gs is not None and gs != expected:
        raise _fail(
            f"{where}: group_size={gs}",
            f"NVFP4 uses a group size of exactly {expected}",
            "this checkpoint is not NVFP4; check its quant_algo",
        )


def _parse_modelopt(data: object, source: str, section: str) -> QuantConfig:
    q = validate(ModeloptConfig, data, source, section)
    raw = data if isinstance(data, Mapping) else {}
    algo = (q.quant_algo or "").upper()
    exclude = tuple(q.exclude_modules or q.ignore or ())
    if algo == "MIXED_PRECISION":
        if not q.quantized_layers:
            raise _fail(
                f"{source}: ModelOpt MIXED_PRECISION config without a quantized_layers table",
                "mixed checkpoints list each quantized layer with its quant_algo",
                "use the checkpoint's own hf_quant_config.json",
            )
        per_layer: dict[str, LayerQuant] = {}
        for name, spec in q.quantized_layers.items():
            where = f"{source}: quantized_layers[{name!r}]"
            quant = _modelopt_algo(spec.quant_algo, where)
            if quant.format == "nvfp4":
                _group_size(spec.group_size, 16, where)
            per_layer[name] = quant
        return QuantConfig("modelopt", None, exclude, per_layer=per_layer, raw=raw, source=source)
    quant = _modelopt_algo(q.quant_algo, f"{source}: quant_algo")
    if quant.format == "nvfp4":
        _group_size(q.group_size, 16, f"{source}: quant_algo NVFP4")
    return QuantConfig("modelopt", quant, exclude, raw=raw, source=source)


def _ct_group_quant(name: str, group: CtGroup, fmt_hint: str | None, source: str) -> LayerQuant:
    w = group.weights
    bits, typ = (w.num_bits, w.type) if w is not None else (None, None)
    gsize = w.group_size if w is not None else None
    acts = group.input_activations
    scheme = Scheme.WEIGHT_ACT if acts else Scheme.WEIGHT_ONLY
    fmt = group.format or fmt_hint
    if bits == 4 and typ == "float":
        if gsize == 16 or fmt == "nvfp4-pack-quantized":
            return LayerQuant("nvfp4", scheme)
        if gsize == 32 or fmt == "mxfp4-pack-quantized":
            return LayerQuant("mxfp4", Scheme.WEIGHT_ONLY if not acts else scheme)
    if bits == 8 and typ == "float" and w is not None:
        block = None
        if w.strategy == "block":
            bs = w.block_structure or [128, 128]
            block = (bs[0], bs[1])
        return LayerQuant("fp8", scheme, fp8_block=block)
    raise _fail(
        f"{source}: compressed-tensors config group {name!r}: weights num_bits={bits} "
        f"type={typ} group_size={gsize} (format {fmt!r})",
        "quantdispatch reads NVFP4 (4-bit float, group 16), MXFP4 (4-bit float, group 32) and "
        "FP8 (8-bit float) weights",
        "load this layer with the engine's own loader",
    )


def _parse_compressed_tensors(data: object, source: str, section: str) -> QuantConfig:
    if not isinstance(data, Mapping) or not data.get("config_groups"):
        raise _fail(
            f"{source}: compressed-tensors config without config_groups",
            "config_groups say which modules are quantized and how",
            "use the checkpoint's own config.json",
        )
    q = validate(CompressedTensorsConfig, data, source, section)
    targets = []
    for name, group in q.config_groups.items():
        quant = _ct_group_quant(name, group, q.format, source)
        targets.append((tuple(group.targets or ("Linear",)), quant))
    return QuantConfig(
        "compressed-tensors",
        None,
        tuple(q.ignore or ()),
        targets=tuple(targets),
        raw=data,
        source=source,
    )


def parse_quant_config(cfg: Mapping[str, Any], source: str = "<mapping>") -> QuantConfig:
    """Parse a ModelOpt ``hf_quant_config.json``, a ``config.json`` or its quantization_config
    (``source`` names the file in error messages)."""
    section = ""
    if isinstance(cfg, Mapping) and "quantization_config" in cfg:
        cfg, section = cfg["quantization_config"], "quantization_config"
    if not isinstance(cfg, Mapping):
        raise _fail(
            f"{source}: {section or 'the quant config'} is {_kind(cfg)}",
            "a quantization config is a JSON object (hf_quant_config.json, config.json or its "
            "quantization_config)",
            "fix the file, or pass the parsed mapping (load_quant_config(path) reads one)",
        )
    legacy = cfg.get("quantization")
    if legacy is not None:  # legacy ModelOpt hf_quant_config.json
        key = f"{section}.quantization" if section else "quantization"
        if not isinstance(legacy, Mapping):
            raise _fail(
                f"{source}: {key} is {_kind(legacy)}",
                "ModelOpt's hf_quant_config.json has a quantization object",
                "fix the file",
            )
        return _parse_modelopt(legacy, source, key)
    raw_method = cfg.get("quant_method", "")
    if not isinstance(raw_method, str):
        raise _fail(
            f"{source}: {section + '.' if section else ''}quant_method = {raw_method!r}",
            "quant_method is a string",
            "fix the file",
        )
    method = raw_method.lower()
    if method == "modelopt":
        return _parse_modelopt(cfg, source, section)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg, source, section)
    if method == "mxfp4":
        m = validate(Mxfp4Config, cfg, source, section)
        return QuantConfig(
            "gpt-oss",
            LayerQuant("mxfp4", Scheme.WEIGHT_ONLY),
            tuple(m.modules_to_not_convert or ()),
            raw=cfg,
            source=source,
        )
    if method == "fp8":
        f = validate(Fp8Config, cfg, source, section)
        block = f.weight_block_size
        return QuantConfig(
            "fp8",
            LayerQuant("fp8", Scheme.WEIGHT_ACT, fp8_block=(block[0], block[1]) if block else None),
            tuple(f.modules_to_not_convert or f.ignored_layers or ()),
            raw=cfg,
            source=source,
        )
    raise _fail(
        f"{source}: unknown quantization config (quant_method={cfg.get('quant_method')!r}, "
        f"keys {sorted(map(str, cfg))[:8]})",
        "quantdispatch reads ModelOpt (modelopt / hf_quant_config.json), compressed-tensors, "
        "gpt-oss mxfp4 and fp8 configs",
        "pass the checkpoint's config.json, hf_quant_config.json or quantization_config",
    )


def _kind(value: object) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({str(value)[:40]!r})"


def read_json(path: Path, error: type[Exception] = CheckpointError) -> Any:
    """A JSON file of at most MAX_CONFIG_BYTES, as UTF-8; any problem raises ``error`` naming
    the file."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise error(
            format_error(f"{path} cannot be read ({exc.strerror or exc})", "", "check the file")
        ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise error(
            format_error(
                f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB",
                "checkpoint config and index files are small JSON files",
                "check the file",
            )
        )
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(
            format_error(
                f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                "JSON files are UTF-8",
                "fix or re-download the file",
            )
        ) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge integers
        raise error(
            format_error(
                f"{path} is not valid JSON ({exc})",
                "configs are JSON",
                "fix or re-download the file",
            )
        ) from None


def load_quant_config(path: str | Path) -> QuantConfig | None:
    """Read the quant config of a checkpoint folder (or a JSON file); None if unquantized
    (no quant config, or ``quantization_config: null``)."""
    p = Path(path)
    files = [p] if p.is_file() else [p / "hf_quant_config.json", p / "config.json"]
    for f in files:
        if not f.is_file():
            continue
        data = read_json(f)
        if (
            f.name == "config.json"
            and isinstance(data, Mapping)
            and data.get("quantization_config") is None
        ):
            continue
        return parse_quant_config(data, str(f))
    return None

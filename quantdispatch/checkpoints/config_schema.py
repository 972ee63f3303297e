"""Declared schemas of the quantization configs quantdispatch reads (they come from downloads).

Only the keys quantdispatch uses are declared; others pass through (producers add keys over
time). Types are strict: ``group_size: "16"`` or ``ignore: "*lm_head"`` (a string, not a list)
is an error, as the producers' own schemas make it. A problem is one ``CheckpointError`` naming
the file, the key, the rule and the fix (:func:`validate`).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from quantdispatch.errors import CheckpointError, format_error

__all__ = [
    "CompressedTensorsConfig",
    "CtArgs",
    "CtGroup",
    "Fp8Config",
    "ModeloptConfig",
    "ModeloptLayer",
    "Mxfp4Config",
    "validate",
]

PositiveInt = Annotated[StrictInt, Field(gt=0)]
Names = list[StrictStr]
Block = Annotated[list[PositiveInt], Field(min_length=2, max_length=2)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class ModeloptLayer(_Section):
    quant_algo: StrictStr | None = None
    group_size: PositiveInt | None = None


class ModeloptConfig(_Section):
    """ModelOpt: ``hf_quant_config.json``'s ``quantization`` or a ``quant_method: modelopt``
    quantization_config."""

    quant_algo: StrictStr | None = None
    group_size: PositiveInt | None = None
    exclude_modules: Names | None = None
    ignore: Names | None = None
    quantized_layers: dict[str, ModeloptLayer] | None = None


class CtArgs(_Section):
    """compressed-tensors QuantizationArgs (the keys read here)."""

    num_bits: PositiveInt | None = None
    type: StrictStr | None = None
    group_size: PositiveInt | None = None
    strategy: StrictStr | None = None
    block_structure: Block | None = None


class CtGroup(_Section):
    targets: Names | None = None
    weights: CtArgs | None = None
    input_activations: CtArgs | None = None
    format: StrictStr | None = None


class CompressedTensorsConfig(_Section):
    format: StrictStr | None = None
    config_groups: Annotated[dict[str, CtGroup], Field(min_length=1)]
    ignore: Names | None = None


class Mxfp4Config(_Section):
    """gpt-oss / transformers ``Mxfp4Config``."""

    modules_to_not_convert: Names | None = None


class Fp8Config(_Section):
    """DeepSeek-style ``quant_method: fp8``."""

    weight_block_size: Block | None = None
    modules_to_not_convert: Names | None = None
    ignored_layers: Names | None = None


M = TypeVar("M", bound=BaseModel)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate(model: type[M], data: object, source: str, section: str) -> M:
    """``data`` as ``model``; a mismatch raises CheckpointError naming ``source`` (the file),
    the key under ``section`` and the rule."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(p for p in (section, _loc(tuple(err.get("loc", ())))) if p)
        value = err.get("input")
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise CheckpointError(
            format_error(
                f"{source}: {key} = {shown}",
                f"{key} must be {_rule(err)}",
                "fix the checkpoint's config (or re-export it with its producer)",
            )
        ) from None


def _rule(err: dict[str, Any]) -> str:
    kind = str(err.get("type", ""))
    ctx = err.get("ctx") or {}
    if kind == "missing":
        return "present"
    if kind == "greater_than":
        return f"greater than {ctx.get('gt')}"
    if kind in ("too_short", "too_long"):
        return f"a list of {ctx.get('min_length', ctx.get('max_length'))} items"
    if kind.startswith("int"):
        return "an integer"
    if kind.startswith("string"):
        return "a string"
    if kind.startswith("list"):
        return "a list"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "a mapping (JSON object)"
    return str(err.get("msg", "valid")).lower()

"""What a layer asks for: format, op, activation dtype, checkpoint scheme and (optionally) shape."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from quantdispatch.errors import ConfigurationError, format_error

__all__ = ["ACT_DTYPES", "Op", "Request", "Scheme", "dtype_name", "parse_act_dtype"]


class Op(StrEnum):
    LINEAR = "linear"
    MOE = "moe"


class Scheme(StrEnum):
    """Whether the checkpoint quantizes activations too.

    ``weight_act`` (NVFP4 W4A4, FP8 W8A8) checkpoints carry activation scales and were calibrated
    for quantized activations; ``weight_only`` (NVFP4A16 / W4A16, W8A16, gpt-oss MXFP4) keep
    16-bit activations. A weight-only kernel may serve both (it says so); a W4A4/W8A8 kernel
    must not silently serve a weight-only checkpoint.
    """

    WEIGHT_ONLY = "weight_only"
    WEIGHT_ACT = "weight_act"


ACT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in ACT_DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).replace("torch.", "")


def parse_act_dtype(value: torch.dtype | str) -> torch.dtype:
    """Accept torch.bfloat16 / torch.float16 or a name: bf16, bfloat16, fp16, float16, half."""
    if isinstance(value, torch.dtype):
        if value in ACT_DTYPES.values():
            return value
        bad = str(value)
    else:
        aliases = {
            "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16,
            "fp16": torch.float16,
            "float16": torch.float16,
            "half": torch.float16,
        }
        key = str(value).strip().lower().replace("torch.", "")
        if key in aliases:
            return aliases[key]
        bad = repr(value)
    raise ConfigurationError(
        format_error(
            f"activation dtype {bad} is not supported",
            "quantized layers take 16-bit activations: bf16 or fp16",
            "cast the activations with .to(torch.bfloat16) or .to(torch.float16)",
        )
    )


_SCALE_KINDS = ("tensor", "channel", "block")
_WEIGHT_BITS = {"nvfp4": 4, "mxfp4": 4, "fp8": 8}


@dataclass(frozen=True)
class Request:
    """One question for the resolver. Build it with :meth:`make` to get validation."""

    format: str
    op: Op
    act_dtype: torch.dtype
    scheme: Scheme
    n: int | None = None
    k: int | None = None
    experts: int | None = None
    scale_kind: str | None = None
    """FP8 only: ``tensor``, ``channel`` or ``block`` weight scales (None: not known)."""

    @classmethod
    def make(
        cls,
        format: str,
        op: Op | str = Op.LINEAR,
        act_dtype: torch.dtype | str = torch.bfloat16,
        scheme: Scheme | str | None = None,
        *,
        n: int | None = None,
        k: int | None = None,
        experts: int | None = None,
        scale_kind: str | None = None,
    ) -> Request:
        from quantdispatch.formats import get_format

        spec = get_format(format)
        try:
            op_ = Op(str(op.value if isinstance(op, Op) else op).lower())
        except ValueError:
            raise ConfigurationError(
                format_error(
                    f"unknown op {op!r}",
                    f"valid ops: {', '.join(o.value for o in Op)}",
                    "pass one of those",
                )
            ) from None
        if scheme is None:
            scheme_ = Scheme(spec.default_scheme)
        else:
            try:
                scheme_ = Scheme(str(scheme.value if isinstance(scheme, Scheme) else scheme))
            except ValueError:
                raise ConfigurationError(
                    format_error(
                        f"unknown checkpoint scheme {scheme!r}",
                        f"valid schemes: {', '.join(s.value for s in Scheme)}",
                        "use weight_only for W4A16/W8A16 checkpoints, weight_act for W4A4/W8A8",
                    )
                ) from None
        for label, value in (("n", n), ("k", k), ("experts", experts)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigurationError(
                    format_error(
                        f"shape field {label}={value!r} is invalid",
                        "shape fields are positive integers or None",
                        f"pass {label} as a positive int",
                    )
                )
        if scale_kind is not None and scale_kind not in _SCALE_KINDS:
            raise ConfigurationError(
                format_error(
                    f"unknown scale kind {scale_kind!r}",
                    f"valid scale kinds: {', '.join(_SCALE_KINDS)}",
                    "pass one of those (FP8 only) or None",
                )
            )
        return cls(
            format=spec.name,
            op=op_,
            act_dtype=parse_act_dtype(act_dtype),
            scheme=scheme_,
            n=n,
            k=k,
            experts=experts,
            scale_kind=scale_kind,
        )

    @property
    def act_name(self) -> str:
        return dtype_name(self.act_dtype)

    @property
    def scheme_label(self) -> str:
        """``W4A4``, ``W4A16``, ``W8A8``... as checkpoints name it."""
        wbits = _WEIGHT_BITS.get(self.format, "?")
        abits = 16 if self.scheme is Scheme.WEIGHT_ONLY else wbits
        return f"W{wbits}A{abits}"

    def describe(self) -> str:
        shape = ""
        if self.n or self.k:
            shape = f", N={self.n or '?'} K={self.k or '?'}"
        if self.experts:
            shape += f", {self.experts} experts"
        if self.scale_kind:
            shape += f", {self.scale_kind} scales"
        return f"{self.format} {self.op.value} ({self.scheme_label}, {self.act_name}{shape})"

"""The triton backend's prepared metas: a layout's meta plus the weight's FP8 compute mode
(:mod:`.fp8_compute`). Registered with the ops' flat form under codes of their own, so a weight
prepared for FP8 compute crosses the op boundary as one; every other weight keeps its layout's
plain meta (mode off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from quantdispatch.backends.prepared import (
    ACT_DTYPES,
    CheckpointMeta,
    Mma16x64Meta,
    dtype_code,
    register_meta,
)
from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.settings import FP8_COMPUTE_MODES

__all__ = ["Fp8CheckpointMeta", "Fp8Mma16x64Meta", "fp8_compute_of_meta", "with_fp8_compute"]

OFF = FP8_COMPUTE_MODES[0]


class _Fp8Mode:
    """What both metas of a weight prepared for FP8 compute do with their mode."""

    fp8_compute: str

    def __post_init__(self) -> None:
        if self.fp8_compute not in FP8_COMPUTE_MODES:
            raise ConfigurationError(
                format_error(
                    f"{type(self).__name__}(fp8_compute={self.fp8_compute!r})",
                    f"a weight's FP8 compute mode is one of {', '.join(FP8_COMPUTE_MODES)}",
                    "pass the mode the backend prepared the weight for",
                )
            )

    def layer_note(self) -> str:
        return f", fp8_compute={self.fp8_compute}"


@dataclass(frozen=True)
class Fp8CheckpointMeta(_Fp8Mode, CheckpointMeta):
    """The checkpoint layout with FP8 compute: ``fp8_compute`` is ``prefill`` (the FP4 weight
    re-encoded per call) or ``prefill-resident`` (its resident FP8 copy is the last two
    tensors, :data:`.fp8_compute.RESIDENT_NAMES`)."""

    fp8_compute: str = OFF

    def to_ints(self) -> list[int]:
        return [*super().to_ints(), FP8_COMPUTE_MODES.index(self.fp8_compute)]

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> Fp8CheckpointMeta:
        *base, mode = v
        return cls(**_fields(CheckpointMeta.from_ints(base)), fp8_compute=_mode(mode))


@dataclass(frozen=True)
class Fp8Mma16x64Meta(_Fp8Mode, Mma16x64Meta):
    """The mma16x64 layout with FP8 compute (``fp8_compute``: as :class:`Fp8CheckpointMeta`'s)."""

    fp8_compute: str = OFF

    def to_ints(self) -> list[int]:
        return [dtype_code(self.packed_for), FP8_COMPUTE_MODES.index(self.fp8_compute)]

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> Fp8Mma16x64Meta:
        code, mode = v
        return cls(ACT_DTYPES[code], _mode(mode))


def _mode(code: int) -> str:
    if not 0 <= code < len(FP8_COMPUTE_MODES):
        raise IndexError(code)
    return FP8_COMPUTE_MODES[code]


register_meta(Fp8CheckpointMeta, 16)
register_meta(Fp8Mma16x64Meta, 17)


def fp8_compute_of_meta(meta: object) -> str:
    """The FP8 compute mode a prepared weight runs (off unless its meta is one of these)."""
    return meta.fp8_compute if isinstance(meta, (Fp8CheckpointMeta, Fp8Mma16x64Meta)) else OFF


def with_fp8_compute(
    meta: CheckpointMeta | Mma16x64Meta, mode: str
) -> CheckpointMeta | Mma16x64Meta:
    """``meta`` with FP8 compute ``mode`` (its layout's plain meta when ``mode`` is off)."""
    if isinstance(meta, Mma16x64Meta):
        act = meta.packed_for
        return Mma16x64Meta(act) if mode == OFF else Fp8Mma16x64Meta(act, mode)
    fields = _fields(meta)
    return (
        CheckpointMeta(**fields) if mode == OFF else Fp8CheckpointMeta(**fields, fp8_compute=mode)
    )


def _fields(meta: CheckpointMeta) -> dict[str, object]:
    """A checkpoint meta's own fields (without any FP8 compute mode)."""
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(CheckpointMeta)}

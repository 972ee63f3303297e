"""The typed half of the prepare / apply life cycle: weight layouts, their metadata, what
``prepare`` returns and what a MoE backend receives.

A prepared weight names its ``layout`` (:class:`Layout`) and carries a small frozen ``meta``
dataclass of that layout. Only the custom ops (quantdispatch.ops) take flat arguments, because
torch.library needs them: :func:`encode_meta` turns (layout, meta) into a ``list[int]`` for
them and :func:`decode_meta` turns it back before any backend sees it. A backend with modes of
its own subclasses a layout's meta and registers the subclass (:func:`register_meta`) under a
code of its own (the triton backend's FP8 compute: backends/triton/meta.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

import torch

from quantdispatch.errors import ConfigurationError, format_error

__all__ = [
    "CheckpointMeta",
    "CutlassFp4Meta",
    "ExpertStacks",
    "Layout",
    "LayoutMeta",
    "MarlinMeta",
    "Mma16x64Meta",
    "MoeCall",
    "PreparedMoe",
    "PreparedWeight",
    "ScaledMmMeta",
    "decode_meta",
    "encode_meta",
    "named_tensors",
    "register_meta",
]


class Layout(StrEnum):
    """How a prepared weight's tensors are laid out (the regime table's rows name these)."""

    CHECKPOINT = "checkpoint"  # the checkpoint's own tensors (formats.*Weight, stacked)
    MMA16X64 = "mma16x64"  # repacked for the mma kernels: 16-row tiles, 64-column chunks
    SCALED_MM = "scaled_mm"  # what torch._scaled_mm takes
    MARLIN = "marlin"  # Marlin's tile order and scale encoding
    CUTLASS_FP4 = "cutlass_fp4"  # a native FP4 GEMM provider's operands (swizzled scales, alpha)


#: 16-bit activation dtypes as they cross the op boundary.
ACT_DTYPES = (torch.float16, torch.bfloat16)


def dtype_code(dtype: torch.dtype) -> int:
    """A 16-bit activation dtype's code in a meta's flat form."""
    return ACT_DTYPES.index(dtype)


class _Meta:
    """What every layout meta answers besides its fields."""

    def flags(self) -> frozenset[str]:
        """The flags the regime table's rows may ask for (``when``)."""
        return frozenset()

    def layer_note(self) -> str:
        """A clause for the layer's repr (a backend's mode for this weight); empty: none."""
        return ""


@dataclass(frozen=True)
class CheckpointMeta(_Meta):
    """The checkpoint layout. ``block_size``: FP8 block scales' (rows, columns).
    ``fp16_rebased``: MXFP4 block scales rebased for fp16, 2^d in the ``rebase_factor`` tensor
    (formats.mxfp4.rebase_mx_scales_for_fp16). ``emulate_activations``: the reference backend
    quantizes activations as a native W4A4 / W8A8 kernel would."""

    layout: ClassVar[Layout] = Layout.CHECKPOINT
    block_size: tuple[int, int] | None = None
    fp16_rebased: bool = False
    emulate_activations: bool = False

    def flags(self) -> frozenset[str]:
        """The flags the regime table's rows may ask for (``when``)."""
        return frozenset({"fp16_rebased"}) if self.fp16_rebased else frozenset()

    def to_ints(self) -> list[int]:
        bn, bk = self.block_size or (0, 0)
        rebased, emulate = int(self.fp16_rebased), int(self.emulate_activations)
        return [bn, bk, rebased, emulate]

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> CheckpointMeta:
        bn, bk, rebased, emulate = v
        block = (bn, bk) if bn else None
        return cls(block, bool(rebased), bool(emulate))


@dataclass(frozen=True)
class Mma16x64Meta(_Meta):
    """The mma16x64 layout: the codes are placed for ``packed_for`` activations (bf16 or fp16)."""

    layout: ClassVar[Layout] = Layout.MMA16X64
    packed_for: torch.dtype

    def to_ints(self) -> list[int]:
        return [dtype_code(self.packed_for)]

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> Mma16x64Meta:
        (code,) = v
        return cls(ACT_DTYPES[code])


@dataclass(frozen=True)
class ScaledMmMeta(_Meta):
    """The torch._scaled_mm layout (nothing besides the tensors)."""

    layout: ClassVar[Layout] = Layout.SCALED_MM

    def to_ints(self) -> list[int]:
        return []

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> ScaledMmMeta:
        () = v
        return cls()


@dataclass(frozen=True)
class MarlinMeta(_Meta):
    """Marlin: the provider contract's index (backends.marlin_providers.CONTRACTS), the
    activation dtype the scales were encoded for, the true and padded N x K (MoE: N = I, K = H
    of the w13 GEMM) and whether the MoE is gated."""

    layout: ClassVar[Layout] = Layout.MARLIN
    contract: int
    act_dtype: torch.dtype
    n: int
    k: int
    n_pad: int
    k_pad: int
    gated: bool = False

    def to_ints(self) -> list[int]:
        code = dtype_code(self.act_dtype)
        return [self.contract, code, self.n, self.k, self.n_pad, self.k_pad, int(self.gated)]

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> MarlinMeta:
        contract, code, n, k, n_pad, k_pad, gated = v
        return cls(contract, ACT_DTYPES[code], n, k, n_pad, k_pad, bool(gated))


@dataclass(frozen=True)
class CutlassFp4Meta(_Meta):
    """A native FP4 GEMM provider's operands (packed codes, swizzled e4m3 block scales, alpha,
    the activation encode scale); ``binding``: the index of the provider binding they were
    prepared for (backends.fp4_providers.BINDINGS)."""

    layout: ClassVar[Layout] = Layout.CUTLASS_FP4
    binding: int

    def to_ints(self) -> list[int]:
        return [self.binding]

    @classmethod
    def from_ints(cls, v: Sequence[int]) -> CutlassFp4Meta:
        (binding,) = v
        return cls(binding)


LayoutMeta = CheckpointMeta | Mma16x64Meta | ScaledMmMeta | MarlinMeta | CutlassFp4Meta

#: The meta class of each layout (a registered subclass is one too).
_META_OF: dict[Layout, type] = {
    m.layout: m for m in (CheckpointMeta, Mma16x64Meta, ScaledMmMeta, MarlinMeta, CutlassFp4Meta)
}
#: Codes of the meta classes in the flat form (stable: ops' arguments only, never stored).
_CLASS_OF: dict[int, type] = {
    0: CheckpointMeta,
    1: Mma16x64Meta,
    2: ScaledMmMeta,
    3: MarlinMeta,
    4: CutlassFp4Meta,
}
_CODE_OF: dict[type, int] = {cls: code for code, cls in _CLASS_OF.items()}


def register_meta(cls: type, code: int) -> None:
    """Register a backend's subclass of a layout's meta under ``code`` (its flat form is that
    code, then its ``to_ints``), so the ops decode it as that subclass."""
    base = _META_OF[cls.layout]  # type: ignore[attr-defined]
    if not issubclass(cls, base) or _CLASS_OF.get(code, cls) is not cls:
        raise ValueError(f"cannot register {cls.__name__} as meta code {code}")
    _CLASS_OF[code], _CODE_OF[cls] = cls, code


def _check(layout: object, meta: object) -> None:
    want = _META_OF.get(layout)  # type: ignore[call-overload]
    if want is None or not isinstance(meta, want):
        raise ConfigurationError(
            format_error(
                f"layout {layout!r} with meta {meta!r}",
                "a prepared weight's meta is the dataclass of its layout: "
                + ", ".join(f"{k.value}: {v.__name__}" for k, v in _META_OF.items()),
                "build the meta of the layout the tensors are in",
            )
        )


def encode_meta(layout: Layout, meta: LayoutMeta) -> list[int]:
    """(layout, meta) as the ``list[int]`` the custom ops take."""
    _check(layout, meta)
    return [_CODE_OF[type(meta)], *meta.to_ints()]


def decode_meta(values: Sequence[int]) -> tuple[Layout, LayoutMeta]:
    """The (layout, meta) behind :func:`encode_meta`'s list."""
    return _decode(tuple(int(v) for v in values))


@functools.lru_cache(maxsize=256)
def _decode(values: tuple[int, ...]) -> tuple[Layout, LayoutMeta]:
    cls = _CLASS_OF.get(values[0]) if values else None
    if cls is not None:
        try:
            return cls.layout, cls.from_ints(values[1:])  # type: ignore[attr-defined]
        except (ValueError, IndexError, TypeError):
            pass
    raise ConfigurationError(
        format_error(
            f"op meta {list(values)}",
            "the ops' meta is encode_meta(layout, meta): a meta code, then that meta's fields",
            "pass the layer's own meta (QuantLinear / QuantMoE keep it)",
        )
    )


def named_tensors(named: tuple) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """(names, tensors) of a backend's NamedTuple of prepared tensors (its fields are the
    buffer names, in the kernels' order); fields left None are not stored."""
    pairs = [(f, t) for f, t in zip(named._fields, named, strict=True) if t is not None]  # type: ignore[attr-defined]
    return tuple(f for f, _ in pairs), tuple(t for _, t in pairs)


@dataclass(frozen=True)
class PreparedWeight:
    """The tensors a backend's kernel reads, in its own order, in ``layout`` with ``meta``.

    ``names`` label the tensors (they become the layer's buffer names). Nothing here may be a
    dequantized copy of the weight; the one copy allowed is an opt-in lossy one a backend's mode
    keeps (the triton backend's FP8 compute), whose bytes ``extra`` says.
    """

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    layout: Layout = Layout.CHECKPOINT
    meta: LayoutMeta = CheckpointMeta()
    out_features: int = 0
    in_features: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.layout, self.meta)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def meta_args(self) -> list[int]:
        """(layout, meta) in the ops' flat form."""
        return encode_meta(self.layout, self.meta)


@dataclass(frozen=True)
class ExpertStacks:
    """What a MoE layer hands its backend to prepare: the stacked canonical expert tensors
    (quantdispatch.moe; on the layer's device), labelled by ``names``, their checkpoint-layout
    ``meta`` (e.g. the FP8 block size), and whether w13 is gate rows then up rows (``gated``)."""

    w13: Sequence[torch.Tensor]
    w2: Sequence[torch.Tensor]
    names: Sequence[str]
    meta: CheckpointMeta
    gated: bool


@dataclass(frozen=True)
class PreparedMoe:
    """A MoE layer's stacked expert tensors as a backend's kernels read them.

    ``names`` label each stack's tensors (the layer's buffers are ``w13_<name>`` and
    ``w2_<name>``). The canonical stacks (quantdispatch.moe) are what most backends keep; a
    backend may repack them once (same bytes) into another ``layout``."""

    names: tuple[str, ...]
    w13: tuple[torch.Tensor, ...]
    w2: tuple[torch.Tensor, ...]
    layout: Layout = Layout.CHECKPOINT
    meta: LayoutMeta = CheckpointMeta()

    def __post_init__(self) -> None:
        _check(self.layout, self.meta)

    def meta_args(self) -> list[int]:
        return encode_meta(self.layout, self.meta)


@dataclass(frozen=True)
class MoeCall:
    """What a MoE backend receives for one call: activations [M, H], local expert ids and
    their final weights [M, top_k], the two expert stacks in ``layout`` with ``meta``, their
    optional biases, the activation and its parameters, and whether kernels may use
    programmatic dependent launches (``pdl``, the decision's Settings.pdl)."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w13: tuple[torch.Tensor, ...]
    w2: tuple[torch.Tensor, ...]
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    fmt: str
    activation: str
    params: tuple[float, ...]
    layout: Layout
    meta: LayoutMeta
    pdl: bool = True

    def __post_init__(self) -> None:
        _check(self.layout, self.meta)

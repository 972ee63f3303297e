"""The triton backend's prepared tensors by name: which position holds what, for each kind of
prepared linear weight, in one place. Prepare writes them in this order (the names become the
layer's buffer names); the run and bound paths read them through :func:`linear_tensors`.

After the leading tensors of its kind a weight may hold the checkpoint's ``input_scale`` (kept
so the state dict keeps it; no kernel here reads it) and, last, the resident FP8 copy of FP8
compute (:class:`Resident`, read from the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from quantdispatch.backends.base import (
    CheckpointMeta,
    Layout,
    LayoutMeta,
    PreparedWeight,
    op_view,
)

__all__ = [
    "Fp4Tensors",
    "Fp8Tensors",
    "MmaTensors",
    "Resident",
    "linear_tensors",
    "prepared",
]

Tensor = torch.Tensor


class MmaTensors(NamedTuple):
    """An NVFP4 / MXFP4 weight repacked in the mma16x64 layout (same bytes)."""

    mma_words: Tensor
    mma_scales: Tensor
    global_scale: Tensor

    @property
    def nk(self) -> tuple[int, int]:
        from quantdispatch.kernels.mma_layout.layout import CHUNK_K, TILE_N

        return self.mma_words.shape[0] * TILE_N, self.mma_words.shape[1] * CHUNK_K


class Fp4Tensors(NamedTuple):
    """An NVFP4 / MXFP4 weight in the checkpoint layout: codes, block scales as bytes and the
    fp32 scalar the kernels multiply by (NVFP4's global scale, the 2^d of an fp16-rebased
    MXFP4 weight's ``rebase_factor``; None for plain MXFP4)."""

    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor | None

    @property
    def nk(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


class Fp8Tensors(NamedTuple):
    """An FP8 weight in the checkpoint layout: e4m3 bytes and its scale."""

    weight: Tensor
    scale: Tensor

    @property
    def nk(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]


class Resident(NamedTuple):
    """The resident FP8 copy of FP8 compute's ``prefill-resident``: the last two tensors."""

    fp8_weight: Tensor
    fp8_scale: Tensor

    @classmethod
    def from_list(cls, tensors: Sequence[Tensor]) -> Resident:
        return cls(tensors[-2], tensors[-1])


#: The names of each kind's tensors as prepare stores them (buffer names).
NAMES = {
    "mma": MmaTensors._fields,
    "nvfp4": ("packed", "block_scale", "global_scale"),
    "mxfp4": ("packed", "block_scale"),
    "mxfp4_rebased": ("packed", "block_scale_fp16_rebased", "rebase_factor"),
    "fp8": ("weight", "scale"),
}


def linear_tensors(
    tensors: Sequence[Tensor], fmt: str, layout: Layout, meta: LayoutMeta
) -> MmaTensors | Fp4Tensors | Fp8Tensors:
    """The named leading tensors of a prepared linear weight (float8 ones as uint8 views)."""
    if layout is Layout.MMA16X64:
        return MmaTensors(tensors[0], tensors[1], tensors[2])
    if fmt == "fp8":
        return Fp8Tensors(op_view(tensors[0], torch.uint8), tensors[1])
    rebased = fmt == "mxfp4" and isinstance(meta, CheckpointMeta) and meta.fp16_rebased
    global_scale = tensors[2] if fmt == "nvfp4" or rebased else None
    return Fp4Tensors(tensors[0], op_view(tensors[1], torch.uint8), global_scale)


def prepared(
    kind: str,
    leading: Sequence[Tensor],
    meta: LayoutMeta,
    shape: tuple[int, int],
    input_scale: Tensor | None = None,
) -> PreparedWeight:
    """The prepared N x K weight of ``kind`` (:data:`NAMES`) in ``meta``'s layout, with the
    checkpoint's ``input_scale`` after its tensors where it has one."""
    names, tensors = NAMES[kind], tuple(leading)
    assert len(names) == len(tensors), (kind, len(tensors))
    if input_scale is not None:
        names, tensors = (*names, "input_scale"), (*tensors, input_scale)
    n, k = shape
    return PreparedWeight(names, tensors, meta.layout, meta, out_features=n, in_features=k)

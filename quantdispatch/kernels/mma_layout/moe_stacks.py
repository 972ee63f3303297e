"""Expert stacks in the mma16x64 layout: each expert of a stacked checkpoint weight repacked
(:func:`..mma_layout.layout.repack`, same bytes) or unpacked, and all experts of one stack
dequantized to 16-bit for the very-many-tokens regime.

Stacked tensors: ``words`` int32 [E, N/16, K/64, 32, 4], ``scales`` uint8 [E, N/16, K/64, 32, 2]
(N = 2I for w13, gate tiles then up tiles), ``global_scale`` fp32 [E]. MXFP4: scales
[E, N/16, K/64, 16, 2], each expert's scales relative to its own largest (its global scale).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantdispatch.errors import WeightFormatError, format_error
from quantdispatch.kernels.common import checks
from quantdispatch.kernels.mma_layout.dequant import mma_dequant_rows
from quantdispatch.kernels.mma_layout.layout import CHUNK_K, TILE_N, repack, repack_mx, unpack

__all__ = [
    "check_stack",
    "dequant_experts",
    "fail",
    "repack_experts",
    "repack_experts_mx",
    "unpack_experts",
]


def _stack_buffers(packed: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty repacked stacks for packed uint8 [E, N, K/2]: words int32 [E, N/16, K/64, 32, 4]
    and scales uint8 [E, N/16, K/64, pairs, 2] (32 pairs NVFP4, 16 MXFP4)."""
    e, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    lead = (e, n // TILE_N, k // CHUNK_K)
    words = torch.empty((*lead, 32, 4), dtype=torch.int32, device=packed.device)
    return words, torch.empty((*lead, pairs, 2), dtype=torch.uint8, device=packed.device)


def repack_experts(
    packed: torch.Tensor, block_scale: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked checkpoint tensors (packed uint8 [E, N, K/2], E4M3 block scales [E, N, K/16])
    -> (words int32 [E, N/16, K/64, 32, 4], scales uint8 [E, N/16, K/64, 32, 2]), expert by
    expert on the tensors' device (one expert's temporaries at a time). Same bytes."""
    codes = block_scale.view(torch.uint8)
    words, scales = _stack_buffers(packed, 32)
    for i in range(packed.shape[0]):
        words[i], scales[i] = repack(packed[i], codes[i], act_dtype)
    return words, scales


def repack_experts_mx(
    packed: torch.Tensor, e8m0: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked MXFP4 experts (packed uint8 [E, N, K/2], E8M0 bytes [E, N, K/32]) -> (words
    [E, N/16, K/64, 32, 4], scales uint8 [E, N/16, K/64, 16, 2], global scales fp32 [E]),
    expert by expert (:func:`.layout.repack_mx`: each expert's scales relative to its own
    largest). Raises WeightFormatError if any expert's scales span more than the layout holds."""
    codes = e8m0.view(torch.uint8)
    words, scales = _stack_buffers(packed, 16)
    gs = torch.empty((packed.shape[0],), dtype=torch.float32, device=packed.device)
    for i in range(packed.shape[0]):
        words[i], scales[i], gs[i] = repack_mx(packed[i], codes[i], act_dtype)
    return words, scales, gs


def unpack_experts(
    words: torch.Tensor, scales: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_experts`: (packed uint8 [E, N, K/2], E4M3 codes uint8
    [E, N, K/16]); exact except inside zero-scale blocks (their values are 0 either way)."""
    pairs = [unpack(words[i], scales[i], act_dtype) for i in range(words.shape[0])]
    return torch.stack([p for p, _ in pairs]), torch.stack([s for _, s in pairs])


def dequant_experts(
    words: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """All experts of one stacked repacked weight as 16-bit [E, N, K] (natural row and column
    order, each value rounded once)."""
    e, n, k = words.shape[0], words.shape[1] * TILE_N, words.shape[2] * CHUNK_K
    out = checks.empty((e, n, k), dtype, words.device)
    for i in range(e):
        mma_dequant_rows(words[i], scales[i], gs[i], 0, n, out[i])
    return out


def fail(what: str, rule: str, fix: str, exc: type[Exception] = WeightFormatError) -> None:
    raise exc(format_error(f"mma16x64 MoE: {what}", rule, fix))


def check_stack(w: Sequence[torch.Tensor], which: str) -> tuple[int, int, int]:
    """(E, N, K) of one stacked repacked weight, checked."""
    if len(w) != 3:
        fail(f"{which} has {len(w)} tensors", "words, scales and global scales", "")
    words, scales, gs = w
    if words.dtype != torch.int32 or words.dim() != 5 or tuple(words.shape[3:]) != (32, 4):
        fail(
            f"{which} words are {words.dtype} {tuple(words.shape)}",
            "repacked expert words are int32 [E, N/16, K/64, 32, 4]",
            "build them with moe_stacks.repack_experts (QuantMoE does)",
        )
    e, tiles, chunks = words.shape[:3]
    pairs = scales.shape[3] if scales.dim() == 5 else 0
    if (
        scales.dtype != torch.uint8
        or tuple(scales.shape) != (e, tiles, chunks, pairs, 2)
        or (pairs not in (32, 16))
    ):
        fail(
            f"{which} scales are {scales.dtype} {tuple(scales.shape)}",
            f"repacked expert scales are uint8 [{e}, {tiles}, {chunks}, 32, 2] (NVFP4) or "
            f"[{e}, {tiles}, {chunks}, 16, 2] (MXFP4)",
            "pass the scales repack_experts / repack_experts_mx returned with these words",
        )
    if gs.dtype != torch.float32 or tuple(gs.shape) != (e,):
        fail(f"{which} global scales are {gs.dtype} {tuple(gs.shape)}", f"float32 [{e}]", "")
    if not (words.is_contiguous() and scales.is_contiguous()):
        fail(f"{which} is not contiguous", "repacked stacks are contiguous", "call .contiguous()")
    return e, tiles * TILE_N, chunks * CHUNK_K

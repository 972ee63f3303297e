"""Expert stacks in the mma16x64 layout: each expert of a stacked checkpoint weight repacked
(:func:`..mma_layout.layout.repack`, same bytes) or unpacked, and all experts of one stack
dequantized to 16-bit for the very-many-tokens regime.

Stacked tensors: ``words`` int32 [E, N/16, K/64, 32, 4], ``scales`` uint8 [E, N/16, K/64, 32, 2]
(N = 2I for w13, gate tiles then up tiles), ``global_scale`` fp32 [E]. MXFP4: scales
[E, N/16, K/64, 16, 2], each expert's scales relative to its own largest (its global scale).
"""

from __future__ import annotations

import torch

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.mma_layout.dequant import mma_dequant_rows
from quantdispatch.kernels.mma_layout.layout import CHUNK_K, TILE_N, repack, repack_mx, unpack

__all__ = ["dequant_experts", "repack_experts", "repack_experts_mx", "unpack_experts"]


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

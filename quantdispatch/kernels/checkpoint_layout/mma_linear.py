"""NVFP4 linear on tensor cores for small M, straight from the checkpoint layout: the mma.sync
kernel of :mod:`.moe_mma` in its LINEAR mode (rows are tokens, ``y = x W^T * global scale +
bias``), and the torch replay of its decode for tests.

The weight stays as the checkpoint stores it (packed [N, K/2] codes, E4M3 block scales
[N, K/16]); the decode (:data:`..common.decode_tables.CHECKPOINT_TABLES`, PTX in
:mod:`..common.ptx`) is described in :mod:`.moe_mma`.
"""

from __future__ import annotations

import torch
import triton

from quantdispatch.kernels.checkpoint_layout.moe_mma import checkpoint_mma_kernel
from quantdispatch.kernels.common.checks import rows_aligned
from quantdispatch.kernels.common.configs import mma_base_config
from quantdispatch.kernels.common.decode_tables import (
    CHECKPOINT_TABLES,
    SUBNORMAL_U,
    reg_column,
    reg_source,
    scale_consts,
)
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.common.ptx import X_PERM

__all__ = [
    "decode_checkpoint_emulated",
    "linear_config",
    "mma_ckpt_linear",
    "mma_ckpt_supported_shape",
    "x_perm_columns",
]


def decode_checkpoint_emulated(
    packed: torch.Tensor, block_scale_u8: torch.Tensor, act_dtype: torch.dtype
) -> torch.Tensor:
    """The A register values the kernel builds, with its own bit operations, mapped back to
    the weight's columns: float64 [N, K] = ``e2m1 * scale * 2^-8`` (for tests of the decode).

    ``packed`` [N, K/2] uint8, ``block_scale_u8`` [N, K/16] E4M3 codes; N % 16 == 0, K % 64 == 0.
    """
    table = CHECKPOINT_TABLES[act_dtype]
    n, k = packed.shape[0], packed.shape[1] * 2
    mul, add = scale_consts(act_dtype == torch.bfloat16)
    # words[row, c, t, w] = bytes 32c + 8t + 4w .. +3 of the row, little endian
    b = packed.to(torch.int64).reshape(n, k // 64, 4, 2, 4)
    words = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    sb = block_scale_u8.to(torch.int64).reshape(n, k // 64, 4)
    lut = torch.tensor(SUBNORMAL_U, dtype=torch.int64, device=sb.device)
    u = torch.where(sb < 8, lut[torch.clamp(sb, 0, 7)], sb + 16)
    pattern = torch.where(sb == 0, torch.zeros_like(u), u * mul + add) & 0xFFFF
    scale = (pattern.to(torch.int32) & 0xFFFF).to(torch.int16).view(act_dtype).to(torch.float64)

    def rotl(x: torch.Tensor, s: int) -> torch.Tensor:
        return ((x << s) | (x >> (32 - s))) & 0xFFFFFFFF if s else x

    out = torch.zeros(n, k // 64, 4, 16, dtype=torch.float64, device=packed.device)
    for j in range(4):
        for r in (0, 2):  # row g (rows g + 8 decode the same way from their own words)
            word_idx, pair = reg_source(j, r)
            a, m = table.rotations[pair]
            word = words[..., word_idx]
            reg = (rotl(word, a) & table.sign_mask) | (rotl(word, m) & table.mag_mask)
            for half in range(2):
                bits = ((reg >> (16 * half)) & 0xFFFF).to(torch.int32).to(torch.int16)
                v = bits.view(act_dtype).to(torch.float64) * scale
                out[..., reg_column(j, r, half)] = v
    return out.reshape(n, k)


def x_perm_columns() -> list[tuple[int, int]]:
    """Columns (low half, high half) that each permuted B register holds, by replaying the
    prmt selectors of :data:`..common.ptx.X_PERM` on column indices (for tests)."""
    regs = [(2 * q, 2 * q + 1) for q in range(8)]  # halves of X[q]
    cols = []
    for qa, qb, sel in X_PERM:
        halves = regs[qa] + regs[qb]  # byte pairs 0-1, 2-3 of a; 4-5, 6-7 of b
        lo, hi = (sel & 0xF) // 2, ((sel >> 8) & 0xF) // 2
        cols.append((halves[lo], halves[hi]))
    return cols


def mma_ckpt_supported_shape(n: int, k: int) -> bool:
    """Whole 16-row tiles and 64-column chunks."""
    return n > 0 and k > 0 and n % 16 == 0 and k % 64 == 0


def linear_config(tiles: int, chunks: int, m: int) -> tuple[int, int, int, int]:
    """(NT, WT, WK, UNROLL) for a linear call: the repacked kernel's one-step heuristic
    (:func:`..common.configs.mma_base_config`) without its tiles-per-warp R (this kernel has neither
    R nor DEPTH; its configs were not swept again when the repacked kernel got DEPTH 2)."""
    nt, wt, wk, unroll, _ = mma_base_config(tiles, chunks, m)
    return nt, wt, wk, unroll


def mma_ckpt_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ W.T * global_scale (+ bias)`` for an NVFP4 weight in the checkpoint layout
    (packed [N, K/2] uint8, E4M3 codes [N, K/16] uint8); x [M, K] fp16/bf16, out [M, N].

    Meant for small M (the backend routes larger M elsewhere). ``config`` = (NT, WT, WK,
    UNROLL) overrides the heuristic (tuning); WT must divide N/16."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if not mma_ckpt_supported_shape(n, k) or not rows_aligned(packed):
        raise ValueError(
            f"weight {n}x{k} (strides {packed.stride()}) is not whole 16x64 tiles with 16-byte "
            "aligned rows; use fp4_linear"
        )
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(0) % 8 or x.data_ptr() % 16 or x.stride(1) != 1:  # 16-byte loads of x rows
        x = x.clone(memory_format=torch.contiguous_format)
    tiles, chunks = n // 16, k // 64
    nt, wt, wk, unroll = config or linear_config(tiles, chunks, m)
    if tiles % wt:
        raise ValueError(f"WT={wt} does not divide the {tiles} tiles")
    grid = (triton.cdiv(m, 8 * nt), tiles // wt)
    launch(checkpoint_mma_kernel, grid,
        x, x, x, x, x, global_scale,
        packed, block_scale_u8, global_scale, bias if bias is not None else global_scale, out,
        m, 1, 1, 0,
        x.stride(0), 0, packed.stride(0), 0, block_scale_u8.stride(0), 0, out.stride(0),
        0.0, 0.0,
        CHUNKS=chunks, GATE_UP=False, ACT=0, HAS_BIAS=bias is not None, DIRECT=False,
        LINEAR=True, NT=nt, WT=wt, WK=wk, UNROLL=unroll, BF16=x.dtype == torch.bfloat16,
        REPACKED=False, num_warps=wt * wk, num_stages=1,
    )  # fmt: skip
    return out

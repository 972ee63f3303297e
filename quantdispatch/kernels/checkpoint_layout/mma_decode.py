"""The decode of the checkpoint-layout mma.sync kernels (:mod:`..common.moe_mma`) replayed in
torch, for tests: the A register values the kernel builds from the checkpoint's bytes, and the
columns its permuted activation registers hold.

The weight stays as the checkpoint stores it (packed [N, K/2] codes, E4M3 block scales
[N, K/16]); the decode (:data:`..common.decode_tables.CHECKPOINT_TABLES`, PTX in
:mod:`..common.ptx`) is described in :mod:`..common.moe_mma`.
"""

from __future__ import annotations

import torch

from quantdispatch.kernels.common.decode_tables import (
    CHECKPOINT_TABLES,
    SUBNORMAL_U,
    reg_column,
    reg_source,
    scale_consts,
)
from quantdispatch.kernels.common.ptx import X_PERM

__all__ = ["decode_checkpoint_emulated", "x_perm_columns"]


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

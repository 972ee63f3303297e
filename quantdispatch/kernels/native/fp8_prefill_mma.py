"""FP8 prefill re-encoder reading the mma16x64 layout (what the triton backend holds for NVFP4 /
MXFP4 on SM 8.0+): the same codes and scales as :func:`.fp8_prefill_quant.reencode_fp4_triton`
on the checkpoint bytes, read straight from the layout's words, so per-call FP8 prefill costs
the same on either layout (no 16-bit detour).

Layout (:mod:`quantdispatch.kernels.mma_layout.layout`): ``words[T, c, 4g + t, j]`` holds the 8
codes of rows 16T + g + 8rr (rr = 0, 1) at columns 64c + 16t + 4j + cc (cc = 0..3), at the bit
positions of the act dtype's decode table; ``scales`` hold u codes ((E + 9) << 3 | m for the
scale 2^E (1 + m/8); a zero NVFP4 block has its codes dropped instead). MXFP4 u codes
are relative to the weight's largest scale and the layout's global scale restores it, so the
unit values here are e2m1 x u-scale and ``mult`` is the layout's global scale in both formats.

A program sees its tiles' words as a 2-D [8 * tiles, 16 * chunks] grid (row g of each tile,
column 16c + 4t + j): row-rr output row 16T + 8rr + g, and the four cc codes of a word are
four consecutive output bytes, stored as one 32-bit word at column 16c + 4t + j of the int32
view of q. No triton-free parts; the layout facts come from the decode tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.decode_tables import DECODE_TABLES, REG_COL, REG_ROW
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.native.fp8_prefill_quant import (
    block_exponent,
    e2m1_magnitude,
    e4m3_pair,
    hw_rounding,
    pow2,
)

__all__ = ["reencode_mma_triton"]


def _positions(act_dtype: torch.dtype) -> list[int]:
    """(sign bit, lowest magnitude bit) of the code for output byte cc of row rr, in the order
    (rr, cc) = (0,0) (0,1) (0,2) (0,3) (1,0) ... (1,3)."""
    table = DECODE_TABLES[act_dtype]
    out = []
    for rr in range(2):
        for cc in range(4):
            r = next(r for r in range(4) if REG_ROW[r] == rr and REG_COL[r] == cc - cc % 2)
            sign, mag = table.positions(r, cc % 2)
            assert mag[0] == mag[2] + 2 and mag[1] == mag[2] + 1, "magnitude bits not adjacent"
            out += [sign, mag[2]]
    return out


@triton.jit
def _unit(w, S: tl.constexpr, M: tl.constexpr):
    """(sign 0/1, magnitude code 0..7) of the code at sign bit S / magnitude bits M..M+2."""
    return (w >> S) & 1, (w >> M) & 7


@triton.jit
def _load(w_ptr, s_ptr, tiles, tile0, n_tiles, kc, CHUNKS, MX: tl.constexpr, TT: tl.constexpr):
    """Words [8 TT, 32] of the 128-column chunk pair kc, and the scale values of both row
    halves (fp32, exact; u = 0 is 2^-9, as in the layout's own decode: zero NVFP4 blocks and
    all-zero MXFP4 blocks have zero codes instead)."""
    rr_idx = tl.arange(0, 8 * TT)
    cols = tl.arange(0, 32)
    t_ = tiles[:, None]
    c = kc * 2 + cols[None, :] // 16
    tj = cols[None, :] % 16
    g = (rr_idx % 8)[:, None]
    ok = t_ < n_tiles
    base = ((tile0 + t_).to(tl.int64) * CHUNKS + c) * 128
    w = tl.load(w_ptr + base + g * 16 + tj, mask=ok, other=0)
    if MX:
        sbase = ((tile0 + t_).to(tl.int64) * CHUNKS + c) * 32 + (2 * g + tj // 8) * 2
    else:
        sbase = ((tile0 + t_).to(tl.int64) * CHUNKS + c) * 64 + (4 * g + tj // 4) * 2
    u0 = tl.load(s_ptr + sbase, mask=ok, other=0).to(tl.int32)
    u1 = tl.load(s_ptr + sbase + 1, mask=ok, other=0).to(tl.int32)
    v0 = ((((u0 >> 3) + 118) << 23) | ((u0 & 7) << 20)).to(tl.float32, bitcast=True)
    v1 = ((((u1 >> 3) + 118) << 23) | ((u1 & 7) << 20)).to(tl.float32, bitcast=True)
    return w, v0, v1


@triton.jit
def _half_max(w, sv, S0: tl.constexpr, M0: tl.constexpr, S1: tl.constexpr, M1: tl.constexpr,
              S2: tl.constexpr, M2: tl.constexpr, S3: tl.constexpr,
              M3: tl.constexpr):  # fmt: skip
    """Per row of one half: the largest |unit value| over the chunk pair [8 TT]."""
    m = tl.maximum(tl.maximum((w >> M0) & 7, (w >> M1) & 7), tl.maximum((w >> M2) & 7,
                                                                        (w >> M3) & 7))  # fmt: skip
    return tl.max(e2m1_magnitude(m) * sv, axis=1)


@triton.jit
def _value(w, gm, S: tl.constexpr, M: tl.constexpr):
    """The signed unit value times ``gm`` (>= 0). The sign goes in as a bit, not by negation:
    some Triton versions (3.7 among them) lower ``-v`` to ``0 - v``, which gives +0 for a -0
    code, so the byte written (0x80 by the rule) would depend on the Triton version."""
    sign, mag = _unit(w, S, M)
    v = (e2m1_magnitude(mag) * gm).to(tl.int32, bitcast=True)
    return (v | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _half_store(q32_ptr, w, sv, e_rows, orow, ok, kc, stride_q32,
                S0: tl.constexpr, M0: tl.constexpr, S1: tl.constexpr, M1: tl.constexpr,
                S2: tl.constexpr, M2: tl.constexpr, S3: tl.constexpr,
                M3: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    gm = sv * pow2(-e_rows)[:, None]
    word = e4m3_pair(_value(w, gm, S0, M0), _value(w, gm, S1, M1), HW)
    word = word | (e4m3_pair(_value(w, gm, S2, M2), _value(w, gm, S3, M3), HW) << 16)
    cols = tl.arange(0, 32)
    tl.store(q32_ptr + orow.to(tl.int64)[:, None] * stride_q32 + kc * 32 + cols[None, :], word,
             mask=ok[:, None])  # fmt: skip


@triton.jit
def _mma_to_fp8_kernel(w_ptr, s_ptr, gs_ptr, q32_ptr, qs_ptr, tile0, n_tiles, CHUNKS, pairs,
                       stride_q32, stride_qs_r, stride_qs_k, MX: tl.constexpr,
                       SHARE_ROWS: tl.constexpr, ONE_CHUNK: tl.constexpr,
                       TT: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr, A1: tl.constexpr,
                       B1: tl.constexpr, A2: tl.constexpr, B2: tl.constexpr, A3: tl.constexpr,
                       B3: tl.constexpr, C0: tl.constexpr, D0: tl.constexpr, C1: tl.constexpr,
                       D1: tl.constexpr, C2: tl.constexpr, D2: tl.constexpr, C3: tl.constexpr,
                       D3: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    # A/B: sign / magnitude positions of row half 0's four bytes; C/D: row half 1's
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    r_idx = tl.arange(0, 8 * TT)
    tiles = pid_r * TT + r_idx // 8  # tile of each grid row, relative to tile0
    ok = tiles < n_tiles
    row0 = tiles * 16 + r_idx % 8  # output row of half 0 (half 1: + 8)
    if ONE_CHUNK:
        w, sv0, sv1 = _load(w_ptr, s_ptr, tiles, tile0, n_tiles, kb, CHUNKS, MX, TT)
        a0 = _half_max(w, sv0, A0, B0, A1, B1, A2, B2, A3, B3)
        a1 = _half_max(w, sv1, C0, D0, C1, D1, C2, D2, C3, D3)
    else:
        a0 = tl.zeros((8 * TT,), dtype=tl.float32)
        a1 = tl.zeros((8 * TT,), dtype=tl.float32)
        for p in range(pairs):
            w, sv0, sv1 = _load(w_ptr, s_ptr, tiles, tile0, n_tiles, kb * pairs + p, CHUNKS,
                                MX, TT)  # fmt: skip
            a0 = tl.maximum(a0, _half_max(w, sv0, A0, B0, A1, B1, A2, B2, A3, B3))
            a1 = tl.maximum(a1, _half_max(w, sv1, C0, D0, C1, D1, C2, D2, C3, D3))
    gs = tl.load(gs_ptr)
    if SHARE_ROWS:
        bmax = tl.maximum(tl.max(a0, axis=0), tl.max(a1, axis=0))
        e = block_exponent(bmax)
        scale = tl.where(bmax == 0.0, 0.0, pow2(e) * gs)  # an all-zero block: scale 0
        tl.store(qs_ptr + pid_r * stride_qs_r + kb * stride_qs_k, scale)
        e0 = tl.zeros((8 * TT,), dtype=tl.int32) + e
        e1 = e0
    else:
        e0 = block_exponent(a0)
        e1 = block_exponent(a1)
        tl.store(qs_ptr + row0.to(tl.int64) * stride_qs_r + kb * stride_qs_k,
                 tl.where(a0 == 0.0, 0.0, pow2(e0) * gs), mask=ok)  # fmt: skip
        tl.store(qs_ptr + (row0 + 8).to(tl.int64) * stride_qs_r + kb * stride_qs_k,
                 tl.where(a1 == 0.0, 0.0, pow2(e1) * gs), mask=ok)  # fmt: skip
    if ONE_CHUNK:
        _half_store(q32_ptr, w, sv0, e0, row0, ok, kb, stride_q32, A0, B0, A1, B1, A2, B2,
                    A3, B3, HW)  # fmt: skip
        _half_store(q32_ptr, w, sv1, e1, row0 + 8, ok, kb, stride_q32, C0, D0, C1, D1, C2,
                    D2, C3, D3, HW)  # fmt: skip
    else:
        for p in range(pairs):
            kc = kb * pairs + p
            w, sv0, sv1 = _load(w_ptr, s_ptr, tiles, tile0, n_tiles, kc, CHUNKS, MX, TT)
            _half_store(q32_ptr, w, sv0, e0, row0, ok, kc, stride_q32, A0, B0, A1, B1, A2,
                        B2, A3, B3, HW)  # fmt: skip
            _half_store(q32_ptr, w, sv1, e1, row0 + 8, ok, kc, stride_q32, C0, D0, C1, D1,
                        C2, D2, C3, D3, HW)  # fmt: skip


def reencode_mma_triton(
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    row_a: int,
    row_b: int,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    act_dtype: torch.dtype,
    block_rows: int,
    block_cols: int,
    rows_per_program: int = 32,
    num_warps: int | None = None,
) -> None:
    """Rows ``row_a .. row_b`` (multiples of 16; of 128 for 128-row blocks unless row_b is the
    end) of an mma16x64 weight into ``q`` (uint8 / e4m3 [row_b - row_a, K]) and ``scale`` (fp32
    natural [row blocks, K / block_cols], any strides), as the checkpoint-layout re-encoder
    would write them (zero-scale NVFP4 blocks: +0 where the checkpoint had -0 codes).
    ``act_dtype`` is the dtype the layout was packed for; ``global_scale`` the layout's.
    ``rows_per_program`` (1-row blocks) and ``num_warps``: the program shape, for tuning."""
    chunks = words.shape[1]
    n_tiles = (row_b - row_a) // 16
    if n_tiles == 0:
        return
    share = block_rows > 1
    tt = block_rows // 16 if share else rows_per_program // 16
    pos = _positions(act_dtype)
    names = ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3",
             "C0", "D0", "C1", "D1", "C2", "D2", "C3", "D3"]  # fmt: skip
    q32 = q.view(torch.uint8).view(torch.int32)
    grid = (triton.cdiv(n_tiles, tt), (chunks * 64) // block_cols)
    launch(_mma_to_fp8_kernel, grid,
        words, scales, global_scale, q32, scale, row_a // 16, n_tiles, chunks, block_cols // 128,
        q32.stride(0), scale.stride(0), scale.stride(1), MX=scales.shape[2] == 16,
        SHARE_ROWS=share, ONE_CHUNK=block_cols == 128, TT=tt, HW=hw_rounding(q.device),
        num_warps=num_warps or (8 if tt >= 4 else 4), **dict(zip(names, pos, strict=True)),
    )  # fmt: skip

"""NVFP4 on tensor cores for small M, straight from the checkpoint layout: linear and MoE.

Why: with few rows per weight (decode, small batches, few tokens per expert) a GEMM streams the
weight once, and the tl.dot kernels of :mod:`.fp4_linear` / :mod:`.fused_moe` decode too
slowly to stream at the bandwidth limit (see :mod:`.fp4_mma`). This module runs the
``mma.sync`` + PTX-decode design of :mod:`.fp4_mma` on the tensors *as the checkpoint stores
them* (packed [N, K/2] codes, E4M3 block scales [N, K/16], stacked per expert for MoE), so the
same weight also feeds the tl.dot and dequantize kernels that are faster once many rows share
it: nothing is repacked, no byte is added, state dicts stay the checkpoint's.

Per lane ``l = 4g + t`` of a warp, one 64-column K chunk of a 16-row tile is two 8-byte loads
(rows g and g+8, codes of columns ``16t .. 16t+15``) and two scale bytes (group ``4c + t``).
A 32-bit word holds the codes of 8 consecutive columns, low nibble first; nibbles ``i`` and
``i + 4`` sit exactly 16 bits apart, so one pair of rotations (sign, magnitude) moves both into
the two halves of a 16-bit pair at once (:data:`CHECKPOINT_TABLES`: 15 integer ops per word,
against 11 for the repacked layout). That pairs columns ``(i, i + 4)`` in one register, so MMA
step ``j`` of a lane takes the lane's columns ``o + {0, 4}`` (A register 0/1) and ``o + {1, 5}``
(register 2/3) with ``o = 8 (j // 2) + 2 (j % 2)``; the activations are permuted the same way
in registers (``prmt``, two per step) after the usual two 16-byte loads. Block scales become
the 16-bit multiplier with the integer multiply-add of :mod:`.fp4_mma` (E4M3 normal codes
``b`` give ``u = b + 16``, subnormals come from an 8-entry byte table, a zero scale gives 0).

Where it runs: :func:`.fused_moe.fused_moe` takes it for NVFP4 experts in the checkpoint
layout with few tokens per expert. ``QuantMoE`` on an SM 8.0+ GPU repacks the experts of the
layers this kernel serves (:mod:`.fp4_mma_moe`) and runs the same kernel in its REPACKED mode:
on the H200 the repacked decode is 30-45% faster per weight (linear gate_up M=1 22 vs 32 us,
benchmarks/results/mma-sweep-h200-*-ckpt.log; MoE Mixtral M=1 69 vs 97 us,
moe-h200-2026-11-30.md), since this decode costs more instructions (15 vs 11 per word,
activation permutes, byte-wise scale loads) and the kernel is issue bound. The checkpoint mode
stays for direct callers of ``fused_moe`` and as the benchmarks' comparison column; LINEAR mode
for ``benchmarks/mma_sweep.py --ckpt``; all tested.

One kernel, three modes: LINEAR (rows are tokens, ``y = x W^T * global scale + bias``);
MoE gate/up (gate tile and up tile of one warp share the activation fragments, the activation
is fused); MoE down (routing weight applied, one row per (token, slot) pair). :mod:`.fused_moe`
supplies the MoE alignment and the final reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.checkpoint_layout.moe import _activation
from quantdispatch.kernels.mma_layout.layout import (
    DecodeTable,
    _base_config,
    _decode_chunk,
    _load_w,
    _load_x,
    _mma_step,
)

__all__ = [
    "CHECKPOINT_TABLES",
    "X_PERM",
    "MmaMoeConfig",
    "decode_checkpoint_emulated",
    "mma_ckpt_linear",
    "mma_ckpt_supported_shape",
    "mma_moe_config",
    "mma_moe_supported",
    "rows_aligned",
    "x_perm_columns",
]

# rotations[i] = (sign, magnitude) left-rotations for the nibble pair (i, i + 4) of a word
CHECKPOINT_TABLES: dict[torch.dtype, DecodeTable] = {
    torch.bfloat16: DecodeTable(
        sign_bit=15, mag_top=8, rotations=((12, 6), (8, 2), (4, 30), (0, 26))
    ),
    torch.float16: DecodeTable(
        sign_bit=15, mag_top=11, rotations=((12, 9), (8, 5), (4, 1), (0, 29))
    ),
}

# u code of an E4M3 subnormal mantissa (value mm * 2^-9): as in fp4_mma (u = ((E + 9) << 3) | m)
_SUBNORMAL_U = (0, 0, 8, 12, 16, 18, 20, 22)
_LUT_LO = _SUBNORMAL_U[0] | _SUBNORMAL_U[1] << 8 | _SUBNORMAL_U[2] << 16 | _SUBNORMAL_U[3] << 24
_LUT_HI = _SUBNORMAL_U[4] | _SUBNORMAL_U[5] << 8 | _SUBNORMAL_U[6] << 16 | _SUBNORMAL_U[7] << 24


def _reg_source(j: int, r: int) -> tuple[int, int]:
    """(word, nibble pair) of A register r of MMA step j: words 0, 1 are row g, 2, 3 row g+8."""
    return j // 2 + 2 * (r % 2), 2 * (j % 2) + r // 2


def _column(j: int, r: int, half: int) -> int:
    """Column (0..15, within the lane's 16) of the value in ``half`` of register r of step j."""
    _, pair = _reg_source(j, r)
    return 8 * (j // 2) + pair + 4 * half


def _scale_consts(bf16: bool) -> tuple[int, int]:
    """(multiplier, addend) turning a u code into the 16-bit pair scale * 2^118 (bf16) or
    scale * 2^6 (fp16) with one integer multiply-add (see fp4_mma)."""
    if bf16:
        return 0x00100010, (236 << 7) | (236 << 23)
    return 0x00800080, (12 << 10) | (12 << 26)


def decode_checkpoint_emulated(
    packed: torch.Tensor, block_scale_u8: torch.Tensor, act_dtype: torch.dtype
) -> torch.Tensor:
    """The A register values the kernel builds, with its own bit operations, mapped back to
    the weight's columns: float64 [N, K] = ``e2m1 * scale * 2^-8`` (for tests of the decode).

    ``packed`` [N, K/2] uint8, ``block_scale_u8`` [N, K/16] E4M3 codes; N % 16 == 0, K % 64 == 0.
    """
    table = CHECKPOINT_TABLES[act_dtype]
    n, k = packed.shape[0], packed.shape[1] * 2
    mul, add = _scale_consts(act_dtype == torch.bfloat16)
    # words[row, c, t, w] = bytes 32c + 8t + 4w .. +3 of the row, little endian
    b = packed.to(torch.int64).reshape(n, k // 64, 4, 2, 4)
    words = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    sb = block_scale_u8.to(torch.int64).reshape(n, k // 64, 4)
    lut = torch.tensor(_SUBNORMAL_U, dtype=torch.int64, device=sb.device)
    u = torch.where(sb < 8, lut[torch.clamp(sb, 0, 7)], sb + 16)
    pattern = torch.where(sb == 0, torch.zeros_like(u), u * mul + add) & 0xFFFF
    scale = (pattern.to(torch.int32) & 0xFFFF).to(torch.int16).view(act_dtype).to(torch.float64)

    def rotl(x: torch.Tensor, s: int) -> torch.Tensor:
        return ((x << s) | (x >> (32 - s))) & 0xFFFFFFFF if s else x

    out = torch.zeros(n, k // 64, 4, 16, dtype=torch.float64, device=packed.device)
    for j in range(4):
        for r in (0, 2):  # row g (rows g + 8 decode the same way from their own words)
            word_idx, pair = _reg_source(j, r)
            a, m = table.rotations[pair]
            word = words[..., word_idx]
            reg = (rotl(word, a) & table.sign_mask) | (rotl(word, m) & table.mag_mask)
            for half in range(2):
                bits = ((reg >> (16 * half)) & 0xFFFF).to(torch.int32).to(torch.int16)
                v = bits.view(act_dtype).to(torch.float64) * scale
                out[..., _column(j, r, half)] = v
    return out.reshape(n, k)


# --------------------------------------------------------------------------------------------
# PTX (one Triton element per thread; see fp4_mma)


def _decode_reg_ptx(table: DecodeTable, pair: int, word: str, out: str, tmp: str) -> list[str]:
    """One A register (before scaling) from the nibble pair ``pair`` of ``word``."""
    a, b = table.rotations[pair]
    lines = []
    src_m = word
    if b:
        lines.append(f"shf.l.wrap.b32 {tmp}m, {word}, {word}, {b};")
        src_m = f"{tmp}m"
    src_s = word
    if a:
        lines.append(f"shf.l.wrap.b32 {tmp}s, {word}, {word}, {a};")
        src_s = f"{tmp}s"
    lines.append(f"and.b32 {tmp}m, {src_m}, {table.mag_mask};")
    # (src_s & SIGN) | tmp_m
    lines.append(f"lop3.b32 {out}, {src_s}, {tmp}m, {table.sign_mask}, 0xEC;")
    return lines


def _decode_ckpt_asm(bf16: bool) -> str:
    """One chunk of one lane: words $16..$19 (row g: $16, $17; row g+8: $18, $19) and the two
    raw E4M3 scale bytes in $20 (row g bits 0..7, row g+8 bits 8..15) -> the 16 scaled A
    registers $0..$15 (step j, register r at 4j + r)."""
    table = CHECKPOINT_TABLES[torch.bfloat16 if bf16 else torch.float16]
    mul, add = _scale_consts(bf16)
    fma = "fma.rn.bf16x2" if bf16 else "fma.rn.f16x2"
    body = [
        "{",
        ".reg .b32 %ts, %tm, %b, %u, %us, %lo, %hi, %sg0, %sg1, %neg0;",
        ".reg .pred %p, %pz;",
        "mov.b32 %neg0, 0x80008000;",
        f"mov.b32 %lo, {_LUT_LO};",
        f"mov.b32 %hi, {_LUT_HI};",
    ]
    for row, shift in ((0, 0), (1, 8)):
        body += [
            f"bfe.u32 %b, $20, {shift}, 8;",
            "add.u32 %u, %b, 16;",
            "prmt.b32 %us, %lo, %hi, %b;",
            "and.b32 %us, %us, 255;",
            "setp.lt.u32 %p, %b, 8;",
            "selp.b32 %u, %us, %u, %p;",
            f"mad.lo.u32 %sg{row}, %u, {mul}, {add};",
            "setp.eq.u32 %pz, %b, 0;",
            f"selp.b32 %sg{row}, 0, %sg{row}, %pz;",
        ]
    for j in range(4):
        for r in range(4):
            word, pair = _reg_source(j, r)
            out = f"${4 * j + r}"
            body += _decode_reg_ptx(table, pair, f"${16 + word}", out, "%t")
            body.append(f"{fma} {out}, {out}, %sg{r % 2}, %neg0;")
    body.append("}")
    return "\n".join(body)


_DECODE_CKPT_BF16 = tl.constexpr(_decode_ckpt_asm(True))
_DECODE_CKPT_F16 = tl.constexpr(_decode_ckpt_asm(False))

# x permutation: step j's B fragments (b0, b1) from the lane's 8 loaded registers X0..X7
# (X[q] holds columns 2q, 2q + 1): (source a, source b, prmt selector) per output register.
# 0x5410 takes the low halves of a and b, 0x7632 the high halves.
X_PERM: tuple[tuple[int, int, int], ...] = tuple(
    (q, q + 2, sel) for q in (0, 1, 4, 5) for sel in (0x5410, 0x7632)
)


def x_perm_columns() -> list[tuple[int, int]]:
    """Columns (low half, high half) that each permuted B register holds, by replaying the
    prmt selectors of :data:`X_PERM` on column indices (for tests)."""
    regs = [(2 * q, 2 * q + 1) for q in range(8)]  # halves of X[q]
    cols = []
    for qa, qb, sel in X_PERM:
        halves = regs[qa] + regs[qb]  # byte pairs 0-1, 2-3 of a; 4-5, 6-7 of b
        lo, hi = (sel & 0xF) // 2, ((sel >> 8) & 0xF) // 2
        cols.append((halves[lo], halves[hi]))
    return cols


_X_PERM_ASM = tl.constexpr(
    "\n".join(
        f"prmt.b32 ${i}, ${8 + qa}, ${8 + qb}, {sel:#06x};"
        for i, (qa, qb, sel) in enumerate(X_PERM)
    )
)

# Codes bypass L1 (each 8-byte load uses its whole 32-byte sector once); scale bytes go through
# L1: a chunk reads 1 byte of each row's sector and the next 7 chunks read the rest.
_LOAD_CKPT_ALL = tl.constexpr(
    "{ .reg .u32 %s0, %s1;\n"
    "ld.global.nc.L1::no_allocate.v2.b32 {$0, $1}, [$6];\n"
    "ld.global.nc.L1::no_allocate.v2.b32 {$2, $3}, [$7];\n"
    "ld.global.nc.u8 %s0, [$8];\n"
    "ld.global.nc.u8 %s1, [$9];\n"
    "bfi.b32 $4, %s1, %s0, 8, 8; }"
)
_LOAD_CKPT = tl.constexpr(
    "{ .reg .u32 %s0, %s1; .reg .pred p; setp.ne.b32 p, $5, 0;\n"
    "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n"
    "mov.b32 %s0, 0; mov.b32 %s1, 0;\n"
    "@p ld.global.nc.L1::no_allocate.v2.b32 {$0, $1}, [$6];\n"
    "@p ld.global.nc.L1::no_allocate.v2.b32 {$2, $3}, [$7];\n"
    "@p ld.global.nc.u8 %s0, [$8];\n"
    "@p ld.global.nc.u8 %s1, [$9];\n"
    "bfi.b32 $4, %s1, %s0, 8, 8; }"
)


@triton.jit
def _load_ckpt(w_ptrs, s_ptrs, stride_wn, stride_sn, ok, ALL: tl.constexpr):
    """A lane's codes (rows g, g+8: 2 x 8 bytes) and its two scale bytes for one chunk."""
    return tl.inline_asm_elementwise(
        _LOAD_CKPT_ALL if ALL else _LOAD_CKPT,
        "=r,=r,=r,=r,=r,r,l,l,l,l",
        [ok.to(tl.int32), w_ptrs, w_ptrs + 8 * stride_wn, s_ptrs, s_ptrs + 8 * stride_sn],
        dtype=(tl.int32,) * 5,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _decode_ckpt(q0, q1, q2, q3, s, BF16: tl.constexpr):
    return tl.inline_asm_elementwise(
        _DECODE_CKPT_BF16 if BF16 else _DECODE_CKPT_F16,
        "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r",
        [q0, q1, q2, q3, s],
        dtype=(tl.int32,) * 16,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _x_perm(x0, x1, x2, x3, x4, x5, x6, x7):
    return tl.inline_asm_elementwise(
        _X_PERM_ASM,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r",
        [x0, x1, x2, x3, x4, x5, x6, x7],
        dtype=(tl.int32,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _load_chunk(w_ptrs, s_ptrs, stride_wn, stride_sn, ok, ALL: tl.constexpr,
                REPACKED: tl.constexpr):  # fmt: skip
    """A lane's 5 registers of one chunk: 4 code words and the two rows' scale codes."""
    if REPACKED:
        return _load_w(w_ptrs, s_ptrs, ok, ALL)
    else:
        return _load_ckpt(w_ptrs, s_ptrs, stride_wn, stride_sn, ok, ALL)


@triton.jit
def _chunk_mma(acc0, acc1, acc2, acc3, q, b, BF16: tl.constexpr, REPACKED: tl.constexpr):
    """Decode one chunk (q: the 5 loaded registers) and run its 4 MMA steps."""
    if REPACKED:
        a = _decode_chunk(q[0], q[1], q[2], q[3], q[4], BF16)
    else:
        a = _decode_ckpt(q[0], q[1], q[2], q[3], q[4], BF16)
    acc0, acc1, acc2, acc3 = _mma_step(acc0, acc1, acc2, acc3, a, 0, b[0], b[1], BF16)
    acc0, acc1, acc2, acc3 = _mma_step(acc0, acc1, acc2, acc3, a, 1, b[2], b[3], BF16)
    acc0, acc1, acc2, acc3 = _mma_step(acc0, acc1, acc2, acc3, a, 2, b[4], b[5], BF16)
    acc0, acc1, acc2, acc3 = _mma_step(acc0, acc1, acc2, acc3, a, 3, b[6], b[7], BF16)
    return acc0, acc1, acc2, acc3


@triton.jit
def _k_reduce(acc, NT: tl.constexpr, WK: tl.constexpr, WT: tl.constexpr):
    """[U, NT, WK * WT * 32] partial sums -> [NT, WT * 32] (chunks in flight, K-split warps)."""
    return tl.sum(tl.reshape(tl.sum(acc, axis=0), (NT, WK, WT * 32)), axis=1)


@triton.jit
def _out_rows(b, sorted_ptr, slot, T, BM: tl.constexpr, DIRECT: tl.constexpr,
              LINEAR: tl.constexpr):  # fmt: skip
    """(row or pair, in use) of output token columns ``slot`` of block b."""
    if LINEAR:
        pair = b * BM + slot
        ok = pair < T
    elif DIRECT:
        pair = b + slot * 0
        ok = slot == 0
    else:
        pair = tl.load(sorted_ptr + b * BM + slot)
        ok = pair < T
    return pair, ok


@triton.jit
def _store_gate_up(a_ptr, bias_ptr, e64, stride_be, up_off, g, u, n, b, slot, ok, stride_am,
                   factor, alpha, limit, BM: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr):  # fmt: skip
    g = g * factor
    u = u * factor
    if HAS_BIAS:
        g += tl.load(bias_ptr + e64 * stride_be + n)
        u += tl.load(bias_ptr + e64 * stride_be + up_off + n)
    h = _activation(g, u, alpha, limit, ACT)
    row = b + slot * 0 if DIRECT else b * BM + slot
    tl.store(a_ptr + row.to(tl.int64) * stride_am + n, h.to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_down(y_ptr, bias_ptr, tw_ptr, e64, stride_be, acc, n, pair, ok, stride_ym, factor,
                HAS_BIAS: tl.constexpr, LINEAR: tl.constexpr):  # fmt: skip
    y = acc * factor
    if HAS_BIAS:
        y += tl.load(bias_ptr + e64 * stride_be + n)
    p64 = tl.where(ok, pair, 0).to(tl.int64)
    if not LINEAR:  # the routing weight of the pair
        y = y * tl.load(tw_ptr + p64, mask=ok, other=0.0)
    tl.store(y_ptr + p64 * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _mma_ckpt_kernel(
    x_ptr, ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, tw_ptr,
    w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr,
    T, E, top_k, up_off,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    alpha, limit,
    CHUNKS: tl.constexpr, GATE_UP: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DIRECT: tl.constexpr, LINEAR: tl.constexpr, NT: tl.constexpr, WT: tl.constexpr,
    WK: tl.constexpr, UNROLL: tl.constexpr, BF16: tl.constexpr, REPACKED: tl.constexpr,
    SPC: tl.constexpr = 32,
):  # fmt: skip
    """One program = one block (LINEAR: 8 * NT consecutive rows of x, T = M; DIRECT: one
    (token, slot) pair; else 8 * NT expert-sorted pairs) x WT 16-row tiles, with WT * WK warps
    (warp (wt, wk): tile wt, chunks wk, wk + WK, ...). LINEAR is expert 0 of a "stack" of one.

    GATE_UP: x rows are tokens, each warp runs gate tile and up tile (rows + up_off) on the
    same activation fragments, and the activation is fused: out = A [rows, up_off] in sorted
    (or pair) order. Otherwise (down): x rows are A's, out = Y [pairs, N] with the routing
    weight applied. Shapes as in fp4_mma: per lane [32W], per chunk [U, 32W], per token tile
    [U, NT, 32W].

    REPACKED: the weights are in the mma16x64 layout of :mod:`.fp4_mma` (words [E, N/16, K/64,
    32, 4] int32, scales [E, N/16, K/64, 32, 2] viewed as int16; strides in those elements):
    one 16-byte load per chunk, the 11-op decode, and the activations in their natural order
    (the layout's K permutation keeps each lane's B fragments contiguous)."""
    WARPS: tl.constexpr = WT * WK
    BM: tl.constexpr = 8 * NT
    b = tl.program_id(0)
    if LINEAR:
        e = b * 0
        skip = False
    elif DIRECT:
        e = tl.load(ids_ptr + b).to(tl.int32)
        skip = (e < 0) | (e >= E)
    else:
        skip = b >= tl.load(nvalid_ptr)
        e = tl.load(bexp_ptr + b)
    if skip:
        return
    e64 = e.to(tl.int64)
    idx = tl.arange(0, 32 * WARPS)
    lane = idx % 32
    warp = idx // 32
    tile = tl.program_id(1) * WT + warp % WT
    wk = warp // WT
    g = lane // 4
    t = lane % 4
    # this lane's B-fragment token rows (pads and DIRECT's unused columns read a valid row;
    # their output columns are never stored)
    slot = 8 * tl.arange(0, NT)[:, None] + g[None, :]  # [NT, 32W]
    if LINEAR:
        xr = tl.minimum(b * BM + slot, T - 1)
    elif DIRECT:
        xr = (b // top_k if GATE_UP else b) + slot * 0
    else:
        pair = tl.load(sorted_ptr + b * BM + slot)
        xr = tl.where(pair < T, pair // top_k, 0) if GATE_UP else b * BM + slot
    x_row = (x_ptr + xr.to(tl.int64) * stride_xm + (16 * t)[None, :])[None, :, :]
    # elements per chunk: repacked 128 words of the tile and 32 scale pairs; checkpoint 32 code
    # bytes and 4 scale bytes of each row
    W_STEP: tl.constexpr = 128 if REPACKED else 32
    S_STEP: tl.constexpr = SPC if REPACKED else 4  # SPC 16: MXFP4, lane pairs share a pair
    if REPACKED:
        tile64 = tile.to(tl.int64) * CHUNKS
        w_base = (w_ptr + e64 * stride_we + tile64 * W_STEP + 4 * lane)[None, :]
        s_lane = lane if SPC == 32 else lane // 2
        s_base = (s_ptr + e64 * stride_se + tile64 * S_STEP + s_lane)[None, :]
        up_w = (up_off // 16) * CHUNKS * W_STEP
        up_s = (up_off // 16) * CHUNKS * S_STEP
    else:
        row = (tile * 16 + g).to(tl.int64)
        w_base = (w_ptr + e64 * stride_we + row * stride_wn + 8 * t)[None, :]  # [1, 32W]
        s_base = (s_ptr + e64 * stride_se + row * stride_sn + t)[None, :]
        up_w = up_off * stride_wn
        up_s = up_off * stride_sn
    chunk0 = tl.arange(0, UNROLL)[:, None] * WK + wk[None, :]  # [U, 32W]
    STEP: tl.constexpr = WK * UNROLL
    EVEN: tl.constexpr = CHUNKS % STEP == 0
    acc0 = tl.zeros((UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc1 = tl.zeros((UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc2 = tl.zeros((UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc3 = tl.zeros((UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    u0 = tl.zeros((UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    u1 = tl.zeros((UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    u2 = tl.zeros((UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    u3 = tl.zeros((UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    ok0 = chunk0 < CHUNKS
    q = _load_chunk(w_base + chunk0 * W_STEP, s_base + chunk0 * S_STEP, stride_wn, stride_sn,
                    ok0, EVEN, REPACKED)  # fmt: skip
    if GATE_UP:
        qu = _load_chunk(
            w_base + up_w + chunk0 * W_STEP, s_base + up_s + chunk0 * S_STEP, stride_wn,
            stride_sn, ok0, EVEN, REPACKED,
        )  # fmt: skip
    for c0 in range(0, CHUNKS, STEP):
        c = c0 + chunk0
        nxt = tl.minimum(c + STEP, CHUNKS - 1) if EVEN else c + STEP
        okn = nxt < CHUNKS
        qn = _load_chunk(w_base + nxt * W_STEP, s_base + nxt * S_STEP, stride_wn, stride_sn,
                         okn, EVEN, REPACKED)  # fmt: skip
        if GATE_UP:
            qun = _load_chunk(
                w_base + up_w + nxt * W_STEP, s_base + up_s + nxt * S_STEP, stride_wn,
                stride_sn, okn, EVEN, REPACKED,
            )  # fmt: skip
        ok = (c < CHUNKS)[:, None, :]
        xs = _load_x(x_row + (c * 64)[:, None, :], ok, EVEN)
        bf = xs if REPACKED else _x_perm(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7])
        acc0, acc1, acc2, acc3 = _chunk_mma(acc0, acc1, acc2, acc3, q, bf, BF16, REPACKED)
        if GATE_UP:
            u0, u1, u2, u3 = _chunk_mma(u0, u1, u2, u3, qu, bf, BF16, REPACKED)
            qu = qun
        q = qn
    r0 = _k_reduce(acc0, NT, WK, WT)
    r1 = _k_reduce(acc1, NT, WK, WT)
    r2 = _k_reduce(acc2, NT, WK, WT)
    r3 = _k_reduce(acc3, NT, WK, WT)
    lt = tl.arange(0, WT * 32)[None, :]
    l32 = lt % 32
    slot_o = 8 * tl.arange(0, NT)[:, None] + 2 * (l32 % 4)  # [NT, WT * 32]
    n_lo = (tl.program_id(1) * WT + lt // 32) * 16 + l32 // 4
    factor = tl.load(gs_ptr + e64) * 256.0
    pa, oka = _out_rows(b, sorted_ptr, slot_o, T, BM, DIRECT, LINEAR)
    pb, okb = _out_rows(b, sorted_ptr, slot_o + 1, T, BM, DIRECT, LINEAR)
    if GATE_UP:
        v0 = _k_reduce(u0, NT, WK, WT)
        v1 = _k_reduce(u1, NT, WK, WT)
        v2 = _k_reduce(u2, NT, WK, WT)
        v3 = _k_reduce(u3, NT, WK, WT)
        _store_gate_up(out_ptr, bias_ptr, e64, stride_be, up_off, r0, v0, n_lo, b, slot_o, oka,
                       stride_om, factor, alpha, limit, BM, ACT, HAS_BIAS, DIRECT)  # fmt: skip
        _store_gate_up(out_ptr, bias_ptr, e64, stride_be, up_off, r1, v1, n_lo, b, slot_o + 1,
                       okb, stride_om, factor, alpha, limit, BM, ACT, HAS_BIAS, DIRECT)  # fmt: skip
        _store_gate_up(out_ptr, bias_ptr, e64, stride_be, up_off, r2, v2, n_lo + 8, b, slot_o,
                       oka, stride_om, factor, alpha, limit, BM, ACT, HAS_BIAS, DIRECT)  # fmt: skip
        _store_gate_up(out_ptr, bias_ptr, e64, stride_be, up_off, r3, v3, n_lo + 8, b,
                       slot_o + 1, okb, stride_om, factor, alpha, limit, BM, ACT, HAS_BIAS,
                       DIRECT)  # fmt: skip
    else:
        _store_down(out_ptr, bias_ptr, tw_ptr, e64, stride_be, r0, n_lo, pa, oka, stride_om,
                    factor, HAS_BIAS, LINEAR)  # fmt: skip
        _store_down(out_ptr, bias_ptr, tw_ptr, e64, stride_be, r1, n_lo, pb, okb, stride_om,
                    factor, HAS_BIAS, LINEAR)  # fmt: skip
        _store_down(out_ptr, bias_ptr, tw_ptr, e64, stride_be, r2, n_lo + 8, pa, oka, stride_om,
                    factor, HAS_BIAS, LINEAR)  # fmt: skip
        _store_down(out_ptr, bias_ptr, tw_ptr, e64, stride_be, r3, n_lo + 8, pb, okb, stride_om,
                    factor, HAS_BIAS, LINEAR)  # fmt: skip


# --------------------------------------------------------------------------------------------
# host side


def mma_ckpt_supported_shape(n: int, k: int) -> bool:
    """Whole 16-row tiles and 64-column chunks."""
    return n > 0 and k > 0 and n % 16 == 0 and k % 64 == 0


def rows_aligned(t: torch.Tensor) -> bool:
    """8-byte code loads per row: rows 16-byte aligned (data pointer and row strides)."""
    return t.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in t.stride()[:-1])


def linear_config(tiles: int, chunks: int, m: int) -> tuple[int, int, int, int]:
    """(NT, WT, WK, UNROLL) for a linear call: the repacked kernel's one-step heuristic
    (:func:`.fp4_mma._base_config`) without its tiles-per-warp R (this kernel has neither R
    nor DEPTH; its configs were not swept again when the repacked kernel got DEPTH 2)."""
    nt, wt, wk, unroll, _ = _base_config(tiles, chunks, m)
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
    _mma_ckpt_kernel[grid](
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


@dataclass(frozen=True)
class MmaGemmConfig:
    """Warps of one program: WT tiles side by side, WK-way K split, UNROLL chunks in flight."""

    wt: int = 1
    wk: int = 4
    unroll: int = 2


@dataclass(frozen=True)
class MmaMoeConfig:
    """``direct``: one block per (token, slot) pair (NT = 1); else ``nt`` token tiles of 8
    expert-sorted pairs per block."""

    nt: int
    gemm1: MmaGemmConfig
    gemm2: MmaGemmConfig
    direct: bool = False

    @property
    def block_m(self) -> int:
        return 8 * self.nt


def mma_moe_supported(
    inter: int, hidden: int, gated: bool, capability: tuple[int, int] | None
) -> bool:
    """SM 8.0+ and every GEMM in whole 16-row tiles and 64-column chunks."""
    return (
        gated
        and capability is not None
        and capability >= (8, 0)
        and inter % 64 == 0
        and hidden % 64 == 0
    )


def _gemm_config(blocks: int, tiles: int, chunks: int) -> MmaGemmConfig:
    """K split 4 ways while (block, tile) pairs are few (<= 8192: the GPU needs more warps),
    else 2 ways, but never below 16 chunks per warp (short loops pay their prologue and the
    cross-warp reduction); two chunks in flight. From the H200 sweep
    (benchmarks/results/moe-sweep-h200-*.json: Qwen3, Mixtral, DeepSeek-V3 at M = 1 and 16)."""
    wk = 4 if blocks * tiles <= 8192 else 2
    while wk > 1 and chunks < 16 * wk:
        wk //= 2
    return MmaGemmConfig(1, wk, 2 if chunks >= 4 * wk else 1)


#: Repacked experts, single pairs: warps (programs x K split) a GEMM should reach at least.
MIN_WARPS_REPACKED = 1536


def _gemm_config_repacked(blocks: int, tiles: int, chunks: int, gate_up: bool) -> MmaGemmConfig:
    """The checkpoint layout's choice, adjusted for the repacked kernels on single pairs (its
    decode is cheaper, so small experts need more warps, not longer loops). From the H200
    sweep (benchmarks/results/moe-sweep-h200-*.json, Qwen3-30B-A3B; us per layer): at M=1
    (8 pairs) a 4-way K split for gate/up and 2 for down, 15.6 vs 19.2 (too few warps: raise
    the split until MIN_WARPS_REPACKED); at M=4 (32 pairs) no split for gate/up, 34.5 vs 38.2
    (enough programs; two tiles per warp already hold many registers). Long weights (Mixtral,
    DeepSeek-V3) keep the first rule (they have the programs)."""
    cfg = _gemm_config(blocks, tiles, chunks)
    wk = cfg.wk
    while wk < 4 and blocks * tiles * wk < MIN_WARPS_REPACKED and chunks >= 8 * wk:
        wk *= 2
    if gate_up and blocks * tiles >= MIN_WARPS_REPACKED and chunks <= 32:
        wk = 1
    return MmaGemmConfig(1, wk, 2 if chunks >= 4 * wk else 1)


def _even_split(cfg: MmaGemmConfig, chunks: int) -> MmaGemmConfig:
    """No K split whose step (WK x UNROLL chunks) leaves a ragged last step: its warps then run
    the predicated loop (Nsight Compute: 12-19% more instructions at 45 chunks, same occupancy
    and issue rate; results/ncu-ksplit-h200-2026-11-30/). From the H200 (session 15,
    ksplit-probe-h200-2026-11-30.log; us per layer, 8-pair blocks, both GEMMs K split 2 x 2
    against no split): 45 chunks (gpt-oss, H = I = 2880) 128 experts top-4 M=16 244 vs 214,
    32 experts M=4 84.5 vs 80.8; 46 chunks 241 vs 225 and 77.5 vs 73.5; where the split is even
    it is kept (44 chunks 204 vs 201, 64 chunks 404 vs 396, DeepSeek-V3 M=16 701 vs 770)."""
    if cfg.wk > 1 and chunks % (cfg.wk * cfg.unroll):
        return MmaGemmConfig(cfg.wt, 1, 2 if chunks >= 4 else 1)
    return cfg


#: 8-pair blocks on repacked experts: a GEMM with at most this many (block, tile) programs (the
#: blocks counted as the experts that uniform routing is expected to touch) and at least
#: FEW_PROGRAMS_MIN_CHUNKS chunks of K splits K 4 ways with one chunk in flight per warp.
FEW_PROGRAMS = 6144
FEW_PROGRAMS_MIN_CHUNKS = 40


def expected_experts(pairs: int, experts: int) -> float:
    """Experts that ``pairs`` (token, slot) pairs touch on average under uniform routing:
    E (1 - (1 - 1/E)^pairs) (real routers are skewed: they touch fewer)."""
    return experts * (1.0 - (1.0 - 1.0 / experts) ** pairs)


def _few_programs_split(cfg: MmaGemmConfig, programs: float, chunks: int) -> MmaGemmConfig:
    """A 4-way K split with one chunk in flight where a GEMM has few programs and a long K,
    in place of a smaller split (the 16-chunks-a-warp floor of :func:`_gemm_config`, or a
    ragged split :func:`_even_split` dropped). From the H200 (session 16,
    ksplit-probe-h200-2026-11-30-few*.log; us per layer, 4 x 1 on both GEMMs against the pick,
    no split): gpt-oss-20b (45 chunks, ~1900..5700 programs) M=3 57.3 vs 61.4, M=4 68.3 vs 78.4,
    M=8 98.4 vs 108.8, M=16 135.2 vs 143.7; gpt-oss-120b M=9 (~5650) ties, M=16 (~9200) loses
    (222.8 vs 212.4 for gate/up alone)."""
    if cfg.wk < 4 and programs <= FEW_PROGRAMS and chunks >= FEW_PROGRAMS_MIN_CHUNKS:
        return MmaGemmConfig(cfg.wt, 4, 1)
    return cfg


def mma_moe_config(
    pairs: int,
    experts: int,
    inter: int,
    hidden: int,
    *,
    direct: bool,
    nt: int = 1,
    repacked: bool = False,
) -> MmaMoeConfig:
    """Config for ``pairs`` (token, slot) pairs: ``direct`` one block per pair, else blocks of
    8 * nt expert-sorted pairs (at most min(pairs, experts) of them hold tokens). ``repacked``:
    for the mma16x64 experts of :mod:`.fp4_mma_moe` (single pairs tuned apart)."""
    blocks = pairs if direct else min(pairs, experts)
    if repacked and direct:
        g1 = _gemm_config_repacked(blocks, inter // 16, hidden // 64, True)
        g2 = _gemm_config_repacked(blocks, hidden // 16, inter // 64, False)
    elif repacked:
        g1 = _even_split(_gemm_config(blocks, inter // 16, hidden // 64), hidden // 64)
        g2 = _even_split(_gemm_config(blocks, hidden // 16, inter // 64), inter // 64)
        touched = expected_experts(pairs, experts)
        g1 = _few_programs_split(g1, touched * (inter // 16), hidden // 64)
        g2 = _few_programs_split(g2, touched * (hidden // 16), inter // 64)
    else:
        g1 = _gemm_config(blocks, inter // 16, hidden // 64)
        g2 = _gemm_config(blocks, hidden // 16, inter // 64)
    return MmaMoeConfig(1 if direct else nt, g1, g2, direct)


def _launch(cfg: MmaGemmConfig, blocks: int, tiles: int, **kw: object) -> None:
    if tiles % cfg.wt:
        raise ValueError(f"WT={cfg.wt} does not divide the {tiles} tiles")
    grid = (blocks, tiles // cfg.wt)
    _mma_ckpt_kernel[grid](
        **kw, WT=cfg.wt, WK=cfg.wk, UNROLL=cfg.unroll, num_warps=cfg.wt * cfg.wk, num_stages=1
    )


def mma_moe_gemms(
    x: torch.Tensor,
    ids: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_blocks: torch.Tensor,
    tw: torch.Tensor,
    n_blocks: int,
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    a: torch.Tensor,
    y: torch.Tensor,
    *,
    top_k: int,
    act_code: int,
    alpha: float,
    limit: float,
    cfg: MmaMoeConfig,
) -> None:
    """Gate/up into ``a`` then down into ``y`` (one row per pair); see the module docstring.

    ``w13`` / ``w2`` = (packed uint8 [E, N, K/2], E4M3 codes uint8 [E, N, K/16], global scales
    fp32 [E]), or in the mma16x64 layout (int32 words [E, N/16, K/64, 32, 4], uint8 scales
    [E, N/16, K/64, 32, 2], global scales; :mod:`.fp4_mma_moe`); checked by the caller, shapes by
    :func:`mma_moe_supported`."""
    c13, s13, g13 = w13
    c2, s2, g2 = w2
    repacked = c13.dtype == torch.int32
    if repacked:  # strides in words and in scale pairs (int16)
        s13, s2 = s13.view(torch.int16), s2.view(torch.int16)
        e, n13, hidden = c13.shape[0], c13.shape[1] * 16, c13.shape[2] * 64
        rows13 = rows2 = sn13 = sn2 = 0
    else:
        e, n13, hidden = c13.shape[0], c13.shape[1], c13.shape[2] * 2
        rows13, rows2, sn13, sn2 = c13.stride(1), c2.stride(1), s13.stride(1), s2.stride(1)
    inter = n13 // 2
    pairs = ids.numel()
    bf16 = x.dtype == torch.bfloat16
    common = dict(
        ids_ptr=ids, sorted_ptr=sorted_ids, bexp_ptr=block_expert, nvalid_ptr=num_blocks,
        tw_ptr=tw, T=pairs, E=e, top_k=top_k, alpha=float(alpha), limit=float(limit),
        ACT=act_code, DIRECT=cfg.direct, LINEAR=False, NT=cfg.nt, BF16=bf16, REPACKED=repacked,
        SPC=s13.shape[3] if repacked else 32,
    )  # fmt: skip
    _launch(
        cfg.gemm1, n_blocks, inter // 16,
        x_ptr=x, w_ptr=c13, s_ptr=s13, gs_ptr=g13, bias_ptr=b13 if b13 is not None else g13,
        out_ptr=a, up_off=inter, stride_xm=x.stride(0), stride_we=c13.stride(0),
        stride_wn=rows13, stride_se=s13.stride(0), stride_sn=sn13,
        stride_be=b13.stride(0) if b13 is not None else 0, stride_om=a.stride(0),
        CHUNKS=hidden // 64, GATE_UP=True, HAS_BIAS=b13 is not None, **common,
    )  # fmt: skip
    _launch(
        cfg.gemm2, n_blocks, hidden // 16,
        x_ptr=a, w_ptr=c2, s_ptr=s2, gs_ptr=g2, bias_ptr=b2 if b2 is not None else g2,
        out_ptr=y, up_off=0, stride_xm=a.stride(0), stride_we=c2.stride(0),
        stride_wn=rows2, stride_se=s2.stride(0), stride_sn=sn2,
        stride_be=b2.stride(0) if b2 is not None else 0, stride_om=y.stride(0),
        CHUNKS=inter // 64, GATE_UP=False, HAS_BIAS=b2 is not None, **common,
    )  # fmt: skip

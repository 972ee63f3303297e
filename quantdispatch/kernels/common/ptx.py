"""Inline PTX that the mma.sync kernels of both FP4 layouts share: ``mma.sync`` m16n8k16, the
vectorised weight and activation loads, and the decode builders that turn 32-bit words of E2M1
codes into the 16-bit A registers (one Triton element per thread: each asm block is one lane's
work).

Two decodes: the mma16x64 layout's (:data:`.decode_tables.DECODE_TABLES`, 11 integer ops per
word) and the checkpoint layout's (:data:`.decode_tables.CHECKPOINT_TABLES`, 15 per word, plus a
``prmt`` permutation of the activations). Both turn a block scale into the 16-bit multiplier
with one integer multiply-add. :func:`load_chunk` and :func:`chunk_mma` pick one per launch
(``REPACKED``), so one kernel serves either layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.decode_tables import (
    CHECKPOINT_TABLES,
    DECODE_TABLES,
    REG_ROW,
    SUBNORMAL_U,
    DecodeTable,
    reg_source,
    scale_consts,
)

__all__ = [
    "X_PERM",
    "chunk_mma",
    "decode_chunk",
    "decode_ptx",
    "k_reduce",
    "load_chunk",
    "load_w",
    "load_x",
    "mma_step",
    "mma_step_tiles",
    "x_perm",
]


# --------------------------------------------------------------------------------------------
# the mma16x64 layout's decode


def _bits(mask: int) -> list[int]:
    return [p for p in range(32) if mask >> p & 1]


def _shift_ptx(dst: str, word: str, n: int, mask: int, fma_shifts: bool) -> str:
    """``rotl(word, n)`` as seen through ``mask``. With ``fma_shifts``, a plain left shift when
    no masked bit comes from the wrapped-around top (ptxas then issues it on the FMA pipe as
    IMAD.SHL, leaving the integer ALU pipe, which the decode keeps busiest, for the rest), else
    a rotate."""
    if fma_shifts and all(p >= n for p in _bits(mask)):
        return f"shl.b32 {dst}, {word}, {n};"
    return f"shf.l.wrap.b32 {dst}, {word}, {word}, {n};"


def decode_ptx(table: DecodeTable, word: str, outs: list[str], *, fma_shifts: bool = False) -> str:
    """PTX turning the 32-bit ``word`` into the four A registers ``outs`` (before scaling).

    ``fma_shifts``: non-wrapping shifts as ``shl`` (IMAD.SHL on the FMA pipe): faster in the
    mma.sync GEMV, whose integer ALU pipe is the busiest, but slower in the wgmma GEMM, where each
    step waits for its decode and IMAD.SHL's longer latency shows (docs/design/mma-layout.md)."""
    lines = []
    both = table.sign_mask | table.mag_mask
    for r, out in enumerate(outs):
        a, b = table.rotations[r]
        src_s = word if a == 0 else f"%rs{r}"
        src_m = word if b == 0 else f"%rm{r}"
        if a and a != b:
            lines.append(_shift_ptx(f"%rs{r}", word, a, table.sign_mask, fma_shifts))
        if b:
            mask = both if a == b else table.mag_mask
            lines.append(_shift_ptx(f"%rm{r}", word, b, mask, fma_shifts))
        if a == b:
            lines.append(f"and.b32 {out}, {src_m}, {table.sign_mask | table.mag_mask};")
        else:
            lines.append(f"and.b32 %rm{r}, {src_m}, {table.mag_mask};")
            # (src_s & SIGN) | rm : lut (a & c) | b with a=src_s, b=rm, c=SIGN -> 0xEC
            lines.append(f"lop3.b32 {out}, {src_s}, %rm{r}, {table.sign_mask}, 0xEC;")
    return "\n".join(lines)


def _decode_asm(bf16: bool) -> str:
    """One chunk of one lane: 4 words + 2 scale codes -> 16 scaled A registers.

    Operands: $0..$15 the A registers (step j, register r at 4j + r), $16..$19 the words,
    $20 the two scale codes (row g in bits 0..7, row g+8 in bits 8..15)."""
    table = DECODE_TABLES[torch.bfloat16 if bf16 else torch.float16]
    mul = 0x00100010 if bf16 else 0x00800080
    add = ((236 << 7) | (236 << 23)) if bf16 else ((12 << 10) | (12 << 26))
    fma = "fma.rn.bf16x2" if bf16 else "fma.rn.f16x2"
    body = [
        "{",
        ".reg .b32 %rs<4>, %rm<4>, %su, %sg, %sg8, %neg0;",
        "mov.b32 %neg0, 0x80008000;",
        "and.b32 %su, $20, 255;",
        f"mad.lo.u32 %sg, %su, {mul}, {add};",
        "shr.u32 %su, $20, 8;",
        "and.b32 %su, %su, 255;",
        f"mad.lo.u32 %sg8, %su, {mul}, {add};",
    ]
    for j in range(4):
        regs = [f"${4 * j + r}" for r in range(4)]
        body.append(decode_ptx(table, f"${16 + j}", regs, fma_shifts=True))
        for r in range(4):
            s = "%sg" if REG_ROW[r] == 0 else "%sg8"
            body.append(f"{fma} {regs[r]}, {regs[r]}, {s}, %neg0;")
    body.append("}")
    return "\n".join(body)


_MMA_PTX = (
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
)
_DECODE_BF16 = tl.constexpr(_decode_asm(True))
_DECODE_F16 = tl.constexpr(_decode_asm(False))
_MMA_BF16 = tl.constexpr(_MMA_PTX)
_MMA_F16 = tl.constexpr(_MMA_PTX.replace("bf16", "f16"))
_MMA_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")


_LOAD_W_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $5, 0;\n"
    "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; mov.b32 $4, 0;\n"
    "@p ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$6];\n"
    "@p ld.global.nc.L1::no_allocate.u16 $4, [$7]; }"
)
_LOAD_W_ASM_ALL = tl.constexpr(
    "ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$6];\n"
    "ld.global.nc.L1::no_allocate.u16 $4, [$7];"
)
_LOAD_X_ASM_ALL = tl.constexpr(
    "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$9];\nld.global.nc.v4.b32 {$4, $5, $6, $7}, [$9+16];"
)
_LOAD_X_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $8, 0;\n"
    "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n"
    "mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;\n"
    "@p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$9];\n"
    "@p ld.global.nc.v4.b32 {$4, $5, $6, $7}, [$9+16]; }"
)


@triton.jit
def load_w(w_ptrs, s_ptrs, ok, ALL: tl.constexpr):
    """A lane's 16 bytes of codes and its 2 scale codes for one chunk (zeros where not ok;
    ALL: every chunk exists, no predicate)."""
    return tl.inline_asm_elementwise(
        _LOAD_W_ASM_ALL if ALL else _LOAD_W_ASM,
        "=r,=r,=r,=r,=r,r,l,l",
        [ok.to(tl.int32), w_ptrs, s_ptrs],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def load_x(x_ptrs, ok, ALL: tl.constexpr):
    """A lane's B fragments for one chunk: 32 contiguous bytes of one activation row."""
    return tl.inline_asm_elementwise(
        _LOAD_X_ASM_ALL if ALL else _LOAD_X_ASM,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,l",
        [ok.to(tl.int32), x_ptrs],
        dtype=(tl.int32,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def decode_chunk(q0, q1, q2, q3, u, BF16: tl.constexpr, CKPT: tl.constexpr = False):
    """A chunk's 4 code words and scale register -> 16 registers of 16-bit pairs (the A
    fragments); CKPT: the checkpoint layout's registers (:func:`_load_ckpt`)."""
    return tl.inline_asm_elementwise(
        (_DECODE_CKPT_BF16 if BF16 else _DECODE_CKPT_F16)
        if CKPT
        else (_DECODE_BF16 if BF16 else _DECODE_F16),
        "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r",
        [q0, q1, q2, q3, u],
        dtype=(tl.int32,) * 16,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _mma(acc0, acc1, acc2, acc3, a0, a1, a2, a3, b0, b1, BF16: tl.constexpr):
    return tl.inline_asm_elementwise(
        _MMA_BF16 if BF16 else _MMA_F16,
        _MMA_CONSTRAINTS,
        [a0, a1, a2, a3, b0, b1, acc0, acc1, acc2, acc3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def mma_step(acc0, acc1, acc2, acc3, a, J: tl.constexpr, b0, b1, BF16: tl.constexpr):
    """MMA step J of a chunk: A registers 4J..4J+3 (one per thread, broadcast over the token
    tiles), B fragments (b0, b1) per token tile."""
    return _mma(
        acc0,
        acc1,
        acc2,
        acc3,
        a[4 * J][:, None, :],
        a[4 * J + 1][:, None, :],
        a[4 * J + 2][:, None, :],
        a[4 * J + 3][:, None, :],
        b0,
        b1,
        BF16,
    )


@triton.jit
def mma_step_tiles(acc0, acc1, acc2, acc3, a, J: tl.constexpr, b0, b1, BF16: tl.constexpr):
    """MMA step J for R tiles at once: A registers [R, U, 32W] (broadcast over the token tiles),
    B fragments [U, NT, 32W] (broadcast over the R tiles: loaded once, used R times)."""
    return _mma(
        acc0,
        acc1,
        acc2,
        acc3,
        a[4 * J][:, :, None, :],
        a[4 * J + 1][:, :, None, :],
        a[4 * J + 2][:, :, None, :],
        a[4 * J + 3][:, :, None, :],
        b0[None, :, :, :],
        b1[None, :, :, :],
        BF16,
    )


# --------------------------------------------------------------------------------------------
# the checkpoint layout's decode


_LUT_LO = SUBNORMAL_U[0] | SUBNORMAL_U[1] << 8 | SUBNORMAL_U[2] << 16 | SUBNORMAL_U[3] << 24
_LUT_HI = SUBNORMAL_U[4] | SUBNORMAL_U[5] << 8 | SUBNORMAL_U[6] << 16 | SUBNORMAL_U[7] << 24


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
    mul, add = scale_consts(bf16)
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
            word, pair = reg_source(j, r)
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
def x_perm(x0, x1, x2, x3, x4, x5, x6, x7):
    return tl.inline_asm_elementwise(
        _X_PERM_ASM,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r",
        [x0, x1, x2, x3, x4, x5, x6, x7],
        dtype=(tl.int32,) * 8,
        is_pure=True,
        pack=1,
    )


# --------------------------------------------------------------------------------------------
# one chunk of either layout


@triton.jit
def load_chunk(w_ptrs, s_ptrs, stride_wn, stride_sn, ok, ALL: tl.constexpr,
                REPACKED: tl.constexpr):  # fmt: skip
    """A lane's 5 registers of one chunk: 4 code words and the two rows' scale codes."""
    if REPACKED:
        return load_w(w_ptrs, s_ptrs, ok, ALL)
    else:
        return _load_ckpt(w_ptrs, s_ptrs, stride_wn, stride_sn, ok, ALL)


@triton.jit
def chunk_mma(acc0, acc1, acc2, acc3, q, b, BF16: tl.constexpr, REPACKED: tl.constexpr):
    """Decode one chunk (q: the 5 loaded registers) and run its 4 MMA steps."""
    if REPACKED:
        a = decode_chunk(q[0], q[1], q[2], q[3], q[4], BF16)
    else:
        a = decode_chunk(q[0], q[1], q[2], q[3], q[4], BF16, True)
    acc0, acc1, acc2, acc3 = mma_step(acc0, acc1, acc2, acc3, a, 0, b[0], b[1], BF16)
    acc0, acc1, acc2, acc3 = mma_step(acc0, acc1, acc2, acc3, a, 1, b[2], b[3], BF16)
    acc0, acc1, acc2, acc3 = mma_step(acc0, acc1, acc2, acc3, a, 2, b[4], b[5], BF16)
    acc0, acc1, acc2, acc3 = mma_step(acc0, acc1, acc2, acc3, a, 3, b[6], b[7], BF16)
    return acc0, acc1, acc2, acc3


@triton.jit
def k_reduce(acc, NT: tl.constexpr, WK: tl.constexpr, WT: tl.constexpr):
    """[U, NT, WK * WT * 32] partial sums -> [NT, WT * 32] (chunks in flight, K-split warps)."""
    return tl.sum(tl.reshape(tl.sum(acc, axis=0), (NT, WK, WT * 32)), axis=1)

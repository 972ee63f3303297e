"""A weight tile of the mma16x64 layout decoded in registers as the wgmma *A* operand (the GEMM
and the MoE grouped GEMM share it).

The words of one lane decode to registers whose (row, column) are fixed by the layout
(:mod:`.layout`: register r of word (T, c, g, t, j) holds row 16T + 8(r % 2) + g, columns
64c + 16t + 4j + 2(r // 2) + {0, 1}). Taken in the MMA's own K order within each chunk of 64
(kappa = 16j + 8(r // 2) + 2t + h), these registers already are the wgmma A fragments of a
16-row slab, so the decoded tile reaches the MMA without a shared-memory round trip; the
activations are permuted to that K order once per call (:func:`.activation_order.kappa_order`),
the output keeps its natural order.

``DOT_F32`` (the CPU interpreter, which runs no PTX) decodes the same bits with Triton integer
ops into fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.decode_tables import DECODE_TABLES, REG_ROW
from quantdispatch.kernels.common.ptx import decode_ptx

__all__ = ["weight_tile"]


def _decode_word_asm(bf16: bool, lane_pairs: bool = False) -> str:
    """One word + its two scale codes -> the 4 scaled 16-bit pairs (A registers r = 0..3).

    Used with ``pack=2`` on a tensor whose last dimension (the pair's half h) holds the same word
    twice: operands $0..$3 the pairs, $4 / $5 the word, $6 / $7 the scale codes (row g in bits
    0..7, row g + 8 in bits 8..15). Whole 32-bit pairs keep each A register one PTX value
    (no 16-bit unpack and repack).

    ``lane_pairs`` (MXFP4): $6 holds both scale pairs of the lane's row group, and the lane
    takes pair ``(laneid & 3) // 2``: the words' layout puts the layout's lane ``4g + t`` on
    PTX lane ``4g + t`` (the decoded registers are the wgmma A fragments as they stand), and
    selecting here keeps any lane-dependent tensor out of Triton's layout choice (one made
    the A operand go through shared memory)."""
    table = DECODE_TABLES[torch.bfloat16 if bf16 else torch.float16]
    mul = 0x00100010 if bf16 else 0x00800080
    add = ((236 << 7) | (236 << 23)) if bf16 else ((12 << 10) | (12 << 26))
    fma = "fma.rn.bf16x2" if bf16 else "fma.rn.f16x2"
    regs = [f"${r}" for r in range(4)]
    select = ["mov.b32 %uu, $6;"]
    if lane_pairs:  # shift right by 16 on lanes 4g + 2, 4g + 3
        select = ["mov.u32 %uu, %laneid;", "and.b32 %uu, %uu, 2;", "shl.b32 %uu, %uu, 3;"]
        select.append("shr.b32 %uu, $6, %uu;")
    body = [
        "{",
        ".reg .b32 %dqs<4>, %dqm<4>, %su, %sg, %sg8, %neg0, %uu;",
        "mov.b32 %neg0, 0x80008000;",
        *select,
        "and.b32 %su, %uu, 255;",
        f"mad.lo.u32 %sg, %su, {mul}, {add};",
        "bfe.u32 %su, %uu, 8, 8;",
        f"mad.lo.u32 %sg8, %su, {mul}, {add};",
        # LLVM names 16-bit operands %rs<n>: rename the decode's scratch registers
        decode_ptx(table, "$4", regs).replace("%rs", "%dqs").replace("%rm", "%dqm"),
    ]
    for r in range(4):
        s = "%sg" if REG_ROW[r] == 0 else "%sg8"
        body.append(f"{fma} {regs[r]}, {regs[r]}, {s}, %neg0;")
    body.append("}")
    return "\n".join(body)


_DECODE_WORD_BF16 = tl.constexpr(_decode_word_asm(True))
_DECODE_WORD_F16 = tl.constexpr(_decode_word_asm(False))
_DECODE_WORD_MX_BF16 = tl.constexpr(_decode_word_asm(True, lane_pairs=True))
_DECODE_WORD_MX_F16 = tl.constexpr(_decode_word_asm(False, lane_pairs=True))
_DECODE_WORD_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r,r,r,r")


# the interpreter path repeats the decode with Triton integer ops: the masks from the tables, the
# rotations written out in _decode_word_f32 (DECODE_TABLES' values; the repack places codes by
# the tables, so a mismatch fails every CPU test of this kernel)
_SIGN_BF16 = tl.constexpr(DECODE_TABLES[torch.bfloat16].sign_mask)
_MAG_BF16 = tl.constexpr(DECODE_TABLES[torch.bfloat16].mag_mask)
_SIGN_F16 = tl.constexpr(DECODE_TABLES[torch.float16].sign_mask)
_MAG_F16 = tl.constexpr(DECODE_TABLES[torch.float16].mag_mask)


@triton.jit
def _rotl(q, n: tl.constexpr):
    if n == 0:
        return q
    else:
        return (q << n) | (q >> (32 - n))


@triton.jit
def _bits16_to_f32(bits, BF16: tl.constexpr):
    """Low 16 bits of a uint32 tensor, read as bf16 / fp16, to fp32 (exact)."""
    if BF16:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_register_f32(q, a: tl.constexpr, b: tl.constexpr, scale, BF16: tl.constexpr):
    if BF16:
        reg = (_rotl(q, a) & _SIGN_BF16) | (_rotl(q, b) & _MAG_BF16)
    else:
        reg = (_rotl(q, a) & _SIGN_F16) | (_rotl(q, b) & _MAG_F16)
    return _bits16_to_f32(reg & 0xFFFF, BF16) * scale, _bits16_to_f32(reg >> 16, BF16) * scale


@triton.jit
def _decode_word_f32(word, u, BF16: tl.constexpr):
    """The interpreter's decode: the PTX's bit operations in Triton ops, products in fp32."""
    q = word.to(tl.uint32, bitcast=True)
    uu = u.to(tl.uint32)
    # a scale byte -> the 16-bit value that multiplies the codes (mantissa shift, exponent bias),
    # and each register's (sign, magnitude) rotations, per activation dtype
    S_MUL: tl.constexpr = 16 if BF16 else 128
    S_BIAS: tl.constexpr = (236 << 7) if BF16 else (12 << 10)
    s_g = _bits16_to_f32((uu & 255) * S_MUL + S_BIAS, BF16)
    s_g8 = _bits16_to_f32(((uu >> 8) & 255) * S_MUL + S_BIAS, BF16)
    v0, v1 = _decode_register_f32(q, 0, 1 if BF16 else 4, s_g, BF16)
    v2, v3 = _decode_register_f32(q, 15, 10 if BF16 else 7, s_g8, BF16)
    v4, v5 = _decode_register_f32(q, 4 if BF16 else 1, 4 if BF16 else 1, s_g, BF16)
    v6, v7 = _decode_register_f32(q, 14, 14, s_g8, BF16)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _decode_word(word, u, BF16: tl.constexpr, DOT_F32: tl.constexpr, MX: tl.constexpr = False):
    """Words (and scale code pairs) [...] -> the 4 A registers r as [..., 2] (half h last).
    MX: ``u`` holds both pairs of the row group; the PTX takes the lane's (DOT_F32: weight_tile
    took it already)."""
    if DOT_F32:
        v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word_f32(word, u, BF16)
        return tl.join(v0, v1), tl.join(v2, v3), tl.join(v4, v5), tl.join(v6, v7)
    else:
        if MX:
            asm: tl.constexpr = _DECODE_WORD_MX_BF16 if BF16 else _DECODE_WORD_MX_F16
        else:
            asm: tl.constexpr = _DECODE_WORD_BF16 if BF16 else _DECODE_WORD_F16
        return tl.inline_asm_elementwise(
            asm,
            _DECODE_WORD_CONSTRAINTS,
            [tl.join(word, word), tl.join(u, u)],
            dtype=(tl.bfloat16 if BF16 else tl.float16,) * 4,
            is_pure=True,
            pack=2,
        )


@triton.jit
def weight_tile(
    w_ptrs,
    s_ptrs,
    ok,
    CK: tl.constexpr,
    BF16: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN: tl.constexpr,
    MX: tl.constexpr = False,
):
    """[BT, CK, 8, 4, 4] word pointers and [BT, CK, 8, 4, 1] scale pointers ([BT, CK, 8, 1, 1]
    int32 for MXFP4: both pairs of a row group, each read by two lanes) -> the [16 BT, 64 CK]
    weight block, columns in the MMA's K order (chunks not ``ok`` read as 0)."""
    if EVEN:
        words = tl.load(w_ptrs)
        u = tl.load(s_ptrs).to(tl.int32)
    else:
        words = tl.load(w_ptrs, mask=ok, other=0)
        u = tl.load(s_ptrs, mask=ok, other=0).to(tl.int32)
    if not MX:  # int16 pairs, sign-extended
        u = u & 0xFFFF
    u = tl.broadcast_to(u, words.shape)
    if MX and DOT_F32:  # [.., g, 1, 1] int32: pair 0 for lanes q = 0, 1, pair 1 for q = 2, 3
        q = tl.arange(0, 4)[None, None, None, :, None]
        u = (u >> (q // 2 * 16)) & 0xFFFF
    a0, a1, a2, a3 = _decode_word(words, u, BF16, DOT_F32, MX)
    # register r = rr + 2 cc holds rows g + 8 rr, columns 16 t + 4 j + 2 cc + {0, 1} (h); in
    # the MMA's K order (kappa = 16 j + 8 cc + 2 t + h within a chunk) these registers are
    # already the A fragments of a 16-row slab, so the change to the dot operand layout is a
    # renaming of registers (no shared memory round trip; checked in the SASS)
    pair0 = tl.join(a0, a2)  # row g: [..., h, cc]
    pair8 = tl.join(a1, a3)  # row g + 8
    full = tl.join(pair0, pair8)  # [BT, CK, g, t, j, h, cc, rr]
    full = tl.permute(full, (0, 7, 2, 1, 4, 6, 3, 5))  # [BT, rr, g, CK, j, cc, t, h]
    return tl.reshape(full, (words.shape[0] * 16, 64 * CK))

"""NVFP4 GEMM for mid M on the ``mma16x64`` layout, through ``tl.dot`` (wgmma on Hopper).

Why this exists: the GEMV-style kernel of :mod:`.fp4_mma` issues one ``mma.sync`` per 8 tokens
per decoded fragment and re-reads the activations per weight tile, so from ~32 tokens on it is
latency and L1 bound (benchmarks/NOTES.md, Nsight Compute), and dequantizing whole slabs for
cuBLAS moves 4.5x the weight bytes. Here each program decodes a [BLOCK_N, 64 * CHUNKS] weight
tile once per K step, with the same PTX bit tricks as the GEMV kernel (11 integer ops and 4
16-bit FMAs per 8 codes), and hands it to ``tl.dot`` as the *A* operand of ``out^T = W x^T``
("swap AB"): the weight rows fill the 64-row MMA dimension, the tokens (up to 256) the N
dimension, so the decode cost is shared by every token of the tile.

The words of one lane decode to registers whose (row, column) are fixed by the layout
(:mod:`.fp4_mma`: register r of word (T, c, g, t, j) holds row 16T + 8(r % 2) + g, columns
64c + 16t + 4j + 2(r // 2) + {0, 1}). Taken in the MMA's own K order within each chunk of 64
(kappa = 16j + 8(r // 2) + 2t + h), these registers already are the wgmma A fragments of a
16-row slab, so the decoded tile reaches the MMA without a shared-memory round trip; the
activations are permuted to that K order once per call (:func:`kappa_order`), the output keeps
its natural order.

Numerics as in :mod:`.fp4_mma`: 16-bit operands ``e2m1 * scale * 2^-8`` (exact), fp32
accumulation, ``2^8 * global_scale`` and the bias on the fp32 sums. ``DOT_F32`` (the CPU
interpreter, which runs no PTX) decodes the same bits with Triton integer ops into fp32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cache

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.pdl import gdc_launch_dependents, gdc_wait, pdl_capable
from quantdispatch.kernels.common.wgmma_guard import rs_wgmma_hazard, settle
from quantdispatch.kernels.mma_layout.layout import (
    _REG_ROW,
    CHUNK_K,
    DECODE_TABLES,
    TILE_N,
    _decode_ptx,
    _scale_pairs,
)

__all__ = [
    "GemmTile",
    "has_host_descriptors",
    "kappa_order",
    "kappa_order_torch",
    "kappa_order_triton",
    "mma_gemm",
    "mma_gemm_config",
    "mma_gemm_supported",
    "parse_tile",
    "tma_capable",
]


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
        _decode_ptx(table, "$4", regs).replace("%rs", "%dqs").replace("%rm", "%dqm"),
    ]
    for r in range(4):
        s = "%sg" if _REG_ROW[r] == 0 else "%sg8"
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
    if BF16:
        s_g = _bits16_to_f32((uu & 255) * 16 + (236 << 7), BF16)
        s_g8 = _bits16_to_f32(((uu >> 8) & 255) * 16 + (236 << 7), BF16)
        v0, v1 = _decode_register_f32(q, 0, 1, s_g, BF16)
        v2, v3 = _decode_register_f32(q, 15, 10, s_g8, BF16)
        v4, v5 = _decode_register_f32(q, 4, 4, s_g, BF16)
        v6, v7 = _decode_register_f32(q, 14, 14, s_g8, BF16)
    else:
        s_g = _bits16_to_f32((uu & 255) * 128 + (12 << 10), BF16)
        s_g8 = _bits16_to_f32(((uu >> 8) & 255) * 128 + (12 << 10), BF16)
        v0, v1 = _decode_register_f32(q, 0, 4, s_g, BF16)
        v2, v3 = _decode_register_f32(q, 15, 7, s_g8, BF16)
        v4, v5 = _decode_register_f32(q, 1, 1, s_g, BF16)
        v6, v7 = _decode_register_f32(q, 14, 14, s_g8, BF16)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _decode_word(word, u, BF16: tl.constexpr, DOT_F32: tl.constexpr, MX: tl.constexpr = False):
    """Words (and scale code pairs) [...] -> the 4 A registers r as [..., 2] (half h last).
    MX: ``u`` holds both pairs of the row group; the PTX takes the lane's (DOT_F32: _weight_tile
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
def _weight_tile(
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


@triton.jit(do_not_specialize=["M"])
def _mma_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    bias_ptr,
    out_ptr,
    M,
    stride_om,
    CHUNKS: tl.constexpr,
    PER_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CK: tl.constexpr,
    SPLIT: tl.constexpr,
    BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    X_TMA: tl.constexpr,
    SETTLE: tl.constexpr,
    PDL: tl.constexpr,
    SPC: tl.constexpr = 32,
):
    """One [BLOCK_N weight rows, BLOCK_M tokens] tile of out^T over one of SPLIT K ranges of
    PER_SPLIT chunks (a multiple of CK, so no step crosses into the next range).

    X_TMA: ``x_ptr`` is a host-made tensor descriptor of x ([BLOCK_M, BK] boxes) and the
    activation tiles arrive by TMA (rows past M and columns past K read as zeros), instead of
    per-thread cp.async with 64-bit address arithmetic (on the H200 the warps of the pointer
    version waited on those address registers: benchmarks/NOTES.md, session 8).

    x is [M, K] contiguous with its columns already in the MMA's K order (:func:`kappa_order`).
    M tiles of one weight tile run back to back (program id order), so the weight tile is read
    from HBM once and from L2 after. With SPLIT > 1, ``out_ptr`` is an fp32 [SPLIT, M, N]
    workspace of unscaled partial sums (summed by :func:`_split_sum_kernel`).
    SETTLE: read the accumulator in every step (:func:`.wgmma_hazard.settle`), so the next
    step's decode never writes A registers of wgmmas in flight (Triton < 3.7 pipelining bug).
    (Measured on the H200, session 4: TMA for the weight words and scales too was slower, as
    ptxas then serialized the wgmma chain of the split register-operand dot; see NOTES.)"""
    if PDL:  # launched as a dependent of the permutation kernel: wait for it
        gdc_wait()
    num_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_n = pid // num_m
    pid_m = pid % num_m
    split = tl.program_id(1)
    BT: tl.constexpr = BLOCK_N // 16
    BK: tl.constexpr = 64 * CK
    EVEN: tl.constexpr = CHUNKS % CK == 0
    K: tl.constexpr = CHUNKS * 64
    c_lo = split * PER_SPLIT
    c_hi = tl.minimum(c_lo + PER_SPLIT, CHUNKS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k = tl.arange(0, BK)
    if not X_TMA:
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + c_lo * 64 + k[None, :]
    t = tl.arange(0, BT)[:, None, None, None, None]
    c = tl.arange(0, CK)[None, :, None, None, None]
    g = tl.arange(0, 8)[None, None, :, None, None]
    q = tl.arange(0, 4)[None, None, None, :, None]  # t of the layout: the lane in its quad
    j = tl.arange(0, 4)[None, None, None, None, :]
    base = (pid_n * BT + t).to(tl.int64) * CHUNKS + c_lo + c
    w_ptrs = w_ptr + base * 128 + g * 16 + q * 4 + j
    if SPC == 32:
        s_ptrs = s_ptr + base * 32 + g * 4 + q
    else:  # MXFP4: both pairs of row group g as one int32 (4 bytes: Triton's cp.async minimum)
        s_ptrs = s_ptr.to(tl.pointer_type(tl.int32)) + base * (SPC // 2) + g
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for c0 in range(c_lo, c_hi, CK):
        w = _weight_tile(w_ptrs, s_ptrs, c0 + c < CHUNKS, CK, BF16, DOT_F32, EVEN, SPC == 16)
        if X_TMA:
            x = x_ptr.load([pid_m * BLOCK_M, c0 * 64])
        elif EVEN:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_ok[:, None] & (c0 * 64 + k < K)[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(w, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
            if SETTLE:
                acc = settle(acc)  # the next decode must not overwrite A in flight
        w_ptrs += CK * 128
        s_ptrs += CK * SPC if SPC == 32 else CK * (SPC // 2)
        if not X_TMA:
            x_ptrs += BK
    if PDL:  # only now: split-sum programs that start early would take the GEMM's SM slots
        gdc_launch_dependents()
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT > 1:
        out = out_ptr + (split * M + offs_m.to(tl.int64))[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc, mask=m_ok[None, :])
    else:
        y = acc * (tl.load(gs_ptr) * 256.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n).to(tl.float32)[:, None]
        out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])


@triton.jit
def _split_sum_kernel(
    ws_ptr,
    gs_ptr,
    bias_ptr,
    out_ptr,
    MN,
    N,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = (sum of the SPLIT partial sums) * 2^8 * global scale (+ bias), in split order
    (deterministic). PDL: launched as a dependent of the GEMM; waits for it first."""
    if PDL:
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
    y = acc * (tl.load(gs_ptr) * 256.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def kappa_order_torch(x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The reference of :func:`kappa_order` (one generic torch copy; the CPU path)."""
    m, k = x.shape
    out = x.reshape(m, k // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k)
    return out if rows is None or rows == m else torch.nn.functional.pad(out, (0, 0, 0, rows - m))


@triton.jit
def _kappa_kernel(x_ptr, out_ptr, M, M_OUT, stride_xm, W: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_W: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """x viewed as 32-bit pairs [M, W] -> the same pairs in the MMA's K order, in an [M_OUT, W]
    output whose rows past M are zeros. Within each
    chunk (32 pairs), destination pair d = 8 j + 4 cc + t comes from pair 8 t + 2 j + cc; a
    warp reads and writes whole 128-byte chunk rows (the gather stays inside one line).
    PDL: let the GEMM launch once every program is past its store (it waits for this kernel
    before it reads anything). Released at the top instead, down M=32 took 33 us instead of
    22 on the H200 (not profiled; likely the GEMM's programs were placed while these still
    held SMs, onto fewer SMs)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    within = d % 32
    src = d - within + 8 * (within % 4) + 2 * (within // 8) + (within // 4) % 2
    in_w = (d < W)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    v = tl.load(x_ptr + r64 * stride_xm + src[None, :], mask=(rows < M)[:, None] & in_w, other=0)
    tl.store(out_ptr + r64 * W + d[None, :], v, mask=(rows < M_OUT)[:, None] & in_w)
    if PDL:
        gdc_launch_dependents()


def kappa_order(
    x: torch.Tensor, *, release_next: bool = False, rows: int | None = None
) -> torch.Tensor:
    """x [M, K] -> a contiguous copy whose columns follow the MMA's K order within each chunk of
    64: column 16 j + 8 cc + 2 t + h holds x's column 16 t + 4 j + 2 cc + h. ``rows`` (>= M):
    the copy has that many rows, those past M zero (whole TMA boxes, see :func:`mma_gemm`).

    On a GPU one Triton pass over 32-bit pairs (:func:`kappa_order_triton`): torch's generic
    copy of the 6-D permuted view ran at ~1.2 TB/s (H200, gemm-sweep-h200-2026-11-30-m16-
    kappa.log: 12.3 us for down's activations at M = 256, a fifth of that GEMM call)."""
    if x.device.type != "cuda" or x.shape[0] == 0:
        return kappa_order_torch(x, rows)
    return kappa_order_triton(x, release_next=release_next, rows=rows)


def kappa_order_triton(
    x: torch.Tensor, *, release_next: bool = False, rows: int | None = None
) -> torch.Tensor:
    """:func:`kappa_order` by :func:`_kappa_kernel` (any device Triton runs on; the CPU tests
    run it in the interpreter). x [M, K] 16-bit, K a multiple of 64. ``release_next``: the
    next launch is a programmatic dependent one that waits for this kernel (SM 9.0+)."""
    m, k = x.shape
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"kappa_order_triton: rows={rows} is fewer than x's {m} rows")
    if x.element_size() != 2 or k % CHUNK_K:
        raise ValueError(
            f"kappa_order_triton: x is {x.dtype} [{m}, {k}]; it permutes 16-bit activations "
            f"whose K is a multiple of {CHUNK_K} (pad K, or use kappa_order_torch)"
        )
    if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.contiguous()
    w = k // 2
    pairs = x.view(torch.int32)  # [M, K/2], row stride x.stride(0) / 2
    out = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    block_m, block_w = 16, 128
    grid = (triton.cdiv(rows, block_m), triton.cdiv(w, block_w))
    _kappa_kernel[grid](pairs, out.view(torch.int32), m, rows, pairs.stride(0), W=w,
                        BLOCK_M=block_m, BLOCK_W=block_w, PDL=release_next,
                        num_warps=4)  # fmt: skip
    return out


@dataclass(frozen=True)
class GemmTile:
    """Weight rows and tokens per program, K chunks (of 64) per step, warps, pipeline stages,
    K ranges (each summed in fp32 by a second pass when > 1), a cap on registers per thread
    (ptxas ``.maxnreg``; None: the compiler's choice), which decides how many programs share an
    SM, and whether the activation tiles come by TMA (SM 9.0+)."""

    block_n: int
    block_m: int
    chunks: int
    warps: int
    stages: int
    split: int = 1
    maxnreg: int | None = None
    tma: bool = False

    def label(self) -> str:
        text = f"{self.block_n}x{self.block_m}x{64 * self.chunks}w{self.warps}s{self.stages}"
        text += f"k{self.split}" if self.split > 1 else ""
        text += f"r{self.maxnreg}" if self.maxnreg else ""
        return text + ("t" if self.tma else "")


def parse_tile(text: str) -> GemmTile:
    """``GemmTile`` from its label, e.g. ``128x128x128w8s3``, ``64x64x128w4s4k4``,
    ``128x128x128w8s2r128``, ``128x128x128w8s3t`` (benchmarks and profiles name tiles this
    way)."""
    pattern = r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:k(\d+))?(?:r(\d+))?(t?)"
    found = re.fullmatch(pattern, text.strip())
    if found is None or int(found.group(3)) % CHUNK_K:
        raise ValueError(
            f"tile {text!r}: expected BNxBMxBKwWsS[kSPLIT][rMAXNREG][t] with BK a multiple of "
            f"{CHUNK_K}, e.g. 128x128x128w8s3"
        )
    bn, bm, bk, warps, stages = map(int, found.groups()[:5])
    split = int(found.group(6) or 1)
    maxnreg = int(found.group(7)) if found.group(7) else None
    return GemmTile(bn, bm, bk // CHUNK_K, warps, stages, split, maxnreg, found.group(8) == "t")


#: Whether TMA tiles read activations padded to whole BLOCK_M rows (benchmarks switch it off
#: to compare; see :func:`mma_gemm`).
PAD_TMA_ROWS = True

#: Weights from this many rows are wide enough to fill the H200 without a K split.
WIDE_N = 16384
#: Weights from this K on are long (down projections): fewer weight tiles, more K to split.
LONG_K = 8192


def mma_gemm_supported(n: int, k: int) -> bool:
    """Shapes the kernel takes: whole 64-row weight tiles (one warpgroup's wgmma rows) of the
    mma16x64 layout."""
    return n > 0 and k > 0 and n % 64 == 0 and k % CHUNK_K == 0


@cache
def has_host_descriptors() -> bool:
    """Whether the installed Triton makes TMA descriptors on the host (triton.tools.
    tensor_descriptor, Triton 3.3+)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def tma_capable(device: torch.device) -> bool:
    """Whether tiles with ``tma`` can run on ``device``: a CUDA GPU of SM 9.0+ and a Triton with
    host tensor descriptors."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return has_host_descriptors()


#: Which weights a tile row applies to, from the weight's width and depth (checked in row order).
_SHAPE_RULES = {
    "any": lambda n, wide, long_k: True,
    "wide": lambda n, wide, long_k: wide,
    "long": lambda n, wide, long_k: long_k,
    "tall": lambda n, wide, long_k: n >= 6144,  # qkv-sized and up
    "tall_short": lambda n, wide, long_k: n >= 6144 and not long_k,
    "long_or_narrow": lambda n, wide, long_k: long_k or n < 6144,
}

#: Pointer-load tiles, (largest M, weights, tile) rows, the first match wins: the pipelined
#: winners of the H200 sweeps (gemm-sweep-h200-*.log; devices or Tritons without TMA; settled
#: too on SM 9.x, where they were not re-swept).
_POINTER_TILES = (
    (32, "wide", GemmTile(128, 32, 2, 4, 4, 2)),
    (32, "any", GemmTile(64, 32, 2, 4, 4, 4)),
    (64, "wide", GemmTile(128, 64, 2, 4, 4, 1)),
    (64, "tall_short", GemmTile(128, 64, 2, 8, 3, 2)),
    (64, "any", GemmTile(64, 64, 2, 4, 4, 4)),
    (128, "wide", GemmTile(128, 128, 2, 8, 3, 1)),
    (128, "long", GemmTile(128, 64, 2, 8, 3, 2)),
    (128, "tall", GemmTile(128, 128, 2, 8, 3, 2)),
    (128, "any", GemmTile(64, 64, 2, 4, 4, 1)),
    (256, "long_or_narrow", GemmTile(128, 128, 2, 8, 3, 2)),
    (None, "any", GemmTile(128, 128, 2, 8, 3, 1)),
)

#: TMA tiles, same rows: the winners with the accumulator settled each K step (what SM 9.x
#: runs, gemm-sweep-h200-2026-11-30-settled.log). Settled, a warpgroup's decode no longer
#: overlaps its own wgmmas, so smaller programs that let more warpgroups share an SM won: e.g.
#: 64x128 tiles of one warpgroup at M 65..256 (gate_up M=128 61 vs 70 us for the pipelined
#: winner 128x128w8s2, qkv M=256 33 vs 47; M=512: gate_up 249 vs 278, down 127 vs 153 for
#: 128x128w8s3). At M 65..128 a K split lets the 64x128 tile decode each weight once and still
#: fill the SMs (gemm-sweep-h200-2026-11-30-ksplit3 / -m65-256 logs, two or three sweeps): qkv
#: k2 21.4 vs 24.7 for 64x64 unsplit, down k4 34.5 vs 41.4, o k4 16.5 vs 17.5. At M 129..256
#: 64x128 too, with a 2-way K split for long or narrow weights (gemm-sweep-h200-2026-11-30-
#: pad.log, M = 160 / 192 / 224: o 22.2-22.8 vs 26.9 unsplit, down 58.0-59.9 vs 79.4-83.5;
#: qkv and gate_up stay unsplit, 31.3-31.8 vs 36.5-37.9 and 117-123 vs 132-141). Sweeps before
#: session 14 let the last token tile's TMA boxes run past row M, which cost up to 2x (gate_up
#: M=160 231 vs 117 us; M=72 118 vs 59) and had made 64-token tiles win at M 129..192; the
#: activations are now padded to whole token tiles (:func:`mma_gemm`).
_TMA_TILES = tuple(
    (top, rule, replace(tile, tma=True))
    for top, rule, tile in (
        (32, "wide", GemmTile(64, 32, 2, 4, 3, 4)),
        (32, "any", GemmTile(64, 32, 2, 4, 4, 4)),
        (64, "wide", GemmTile(128, 64, 2, 8, 3, 1)),
        (64, "tall_short", GemmTile(64, 64, 2, 4, 4, 2)),
        (64, "any", GemmTile(64, 64, 2, 4, 4, 4)),
        (128, "wide", GemmTile(64, 128, 2, 4, 3, 1)),
        (128, "tall_short", GemmTile(64, 128, 2, 4, 3, 2)),
        (128, "any", GemmTile(64, 128, 2, 4, 3, 4)),
        (256, "long_or_narrow", GemmTile(64, 128, 2, 4, 3, 2)),
        (None, "any", GemmTile(64, 128, 2, 4, 3, 1)),
    )
)


def mma_gemm_config(n: int, k: int, m: int, *, tma: bool = False) -> GemmTile:
    """The tile for an [M, K] x [N, K]^T call: the fastest measured per M bucket on the
    H200 (:data:`_POINTER_TILES`, :data:`_TMA_TILES`; Llama-3.1-8B shapes), generalized by the
    weight's width (WIDE_N) and depth (LONG_K): narrow weights split K to fill the GPU.

    ``tma`` (the device is :func:`tma_capable`): the activation tiles come by TMA, which beat
    the pointer loads in every winning tile of the session-8 sweep (gemm-sweep-h200-2026-11-30-
    tma.log; gate_up M=128 63 vs 78 us, qkv M=256 36 vs 42, pipelined) and frees registers."""
    wide, long_k = n >= WIDE_N, k >= LONG_K
    tile = next(
        tile
        for top, rule, tile in (_TMA_TILES if tma else _POINTER_TILES)
        if (top is None or m <= top) and _SHAPE_RULES[rule](n, wide, long_k)
    )
    if n % tile.block_n:  # N a multiple of 64 only: one warpgroup, 64 rows per program
        tile = GemmTile(64, tile.block_m, tile.chunks, 4, 4, tile.split, tile.maxnreg, tile.tma)
    return tile


def _x_descriptor(xk: torch.Tensor, tile: GemmTile) -> object:
    """A TMA descriptor of the K-ordered activations in [BLOCK_M, BK] boxes (made on the host,
    passed by value: nothing is allocated on the device, so CUDA graphs capture it)."""
    if xk.device.type != "cuda" or torch.cuda.get_device_capability(xk.device) < (9, 0):
        raise ValueError(
            f"tile {tile.label()} loads the activations by TMA, which needs an SM 9.0+ GPU "
            f"(got {xk.device}); use a tile without the 't' suffix"
        )
    if not has_host_descriptors():  # Triton < 3.3
        raise ValueError(
            f"tile {tile.label()} needs Triton's host tensor descriptors (triton>=3.3, found "
            f"{triton.__version__}); use a tile without the 't' suffix"
        )
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(xk, [tile.block_m, CHUNK_K * tile.chunks])


def mma_gemm(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: GemmTile | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a weight in the mma16x64 layout (x [M, K] in the 16-bit dtype the
    layout was packed for); out [M, N]."""
    tiles, chunks = words.shape[0], words.shape[1]
    n, k = tiles * TILE_N, chunks * CHUNK_K
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] bf16/fp16, got {x.dtype} {tuple(x.shape)}")
    tile = tile or mma_gemm_config(n, k, m, tma=tma_capable(x.device))
    if n % tile.block_n or tile.block_n % 16:
        raise ValueError(f"BLOCK_N={tile.block_n} does not divide N={n} in 16-row tiles")
    # on SM 9.0+ the permutation, the GEMM and the split sum form a programmatic-dependent
    # chain: each launch starts while the one before finishes and waits for it before it reads
    pdl = pdl_capable(x.device)
    # TMA boxes that run past the activations' last row were slow on the H200 (gate_up M=160:
    # 227 us for 64x128 tiles, M=256 129); the copy into the K order is made whole tiles high
    rows = triton.cdiv(m, tile.block_m) * tile.block_m if tile.tma and PAD_TMA_ROWS else m
    xk = kappa_order(x, release_next=pdl, rows=rows)
    ck = tile.chunks
    x_arg: object = xk
    if tile.tma:
        x_arg = _x_descriptor(xk, tile)
    per_split = triton.cdiv(triton.cdiv(chunks, max(1, tile.split)), ck) * ck
    split = triton.cdiv(chunks, per_split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tile.block_m) * (n // tile.block_n), split)
    _mma_gemm_kernel[grid](
        x_arg,
        words,
        scales.view(torch.int16),
        global_scale,
        bias if bias is not None else global_scale,
        target,
        m,
        n,
        CHUNKS=chunks,
        PER_SPLIT=per_split,
        BLOCK_N=tile.block_n,
        BLOCK_M=tile.block_m,
        CK=ck,
        SPLIT=split,
        BF16=x.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None,
        DOT_F32=x.device.type != "cuda",
        X_TMA=tile.tma,
        SETTLE=rs_wgmma_hazard(x.device),  # the decoded weight is wgmma's A
        PDL=pdl,
        SPC=_scale_pairs(scales),
        num_warps=tile.warps,
        num_stages=tile.stages,
        maxnreg=tile.maxnreg,
        **({"launch_pdl": True} if pdl else {}),
    )
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](
            target,
            global_scale,
            bias if bias is not None else global_scale,
            out,
            m * n,
            n,
            SPLIT=split,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            PDL=pdl,
            num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
    return out

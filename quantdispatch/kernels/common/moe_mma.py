"""NVFP4 on tensor cores for small M, on the checkpoint layout or the mma16x64 one: linear, MoE.

Why: with few rows per weight (decode, small batches, few tokens per expert) a GEMM streams the
weight once, and the tl.dot kernels of :mod:`..checkpoint_layout.linear` /
:mod:`..checkpoint_layout.moe_gemm` decode too slowly to stream at the bandwidth limit (see
:mod:`..mma_layout.gemv`). This module runs the ``mma.sync`` + PTX-decode design of
:mod:`..mma_layout.gemv` on the tensors *as the checkpoint stores them* (packed [N, K/2] codes,
E4M3 block scales [N, K/16], stacked per expert for MoE), so the same weight also feeds the
tl.dot and dequantize kernels that are faster once many rows share it: nothing is repacked, no
byte is added, state dicts stay the checkpoint's.

Per lane ``l = 4g + t`` of a warp, one 64-column K chunk of a 16-row tile is two 8-byte loads
(rows g and g+8, codes of columns ``16t .. 16t+15``) and two scale bytes (group ``4c + t``).
A 32-bit word holds the codes of 8 consecutive columns, low nibble first; nibbles ``i`` and
``i + 4`` sit exactly 16 bits apart, so one pair of rotations (sign, magnitude) moves both into
the two halves of a 16-bit pair at once (:data:`.decode_tables.CHECKPOINT_TABLES`: 15 integer
ops per word, against 11 for the repacked layout). That pairs columns ``(i, i + 4)`` in one
register, so MMA step ``j`` of a lane takes the lane's columns ``o + {0, 4}`` (A register 0/1)
and ``o + {1, 5}`` (register 2/3) with ``o = 8 (j // 2) + 2 (j % 2)``; the activations are
permuted the same way in registers (``prmt``, two per step) after the usual two 16-byte loads.
Block scales become the 16-bit multiplier with the integer multiply-add of
:mod:`..mma_layout.layout` (E4M3 normal codes ``b`` give ``u = b + 16``, subnormals come from
an 8-entry byte table, a zero scale gives 0).

Where it runs: :func:`..checkpoint_layout.moe.fused_moe` takes it for NVFP4 experts in the
checkpoint layout with few tokens per expert. ``QuantMoE`` on an SM 8.0+ GPU repacks the experts
of the layers this kernel serves (:mod:`..mma_layout.moe_stacks`) and runs the same kernel in
its REPACKED mode (:func:`..mma_layout.moe_gemm.mma_layout_moe`): the repacked decode is faster
per weight (docs/design/moe.md), since this decode costs more instructions (15 vs 11 per word,
activation permutes, byte-wise scale loads) and the kernel is issue bound. The PTX of both
decodes is in :mod:`.ptx`; its torch replay for tests in :mod:`..checkpoint_layout.mma_decode`.
The checkpoint mode stays for direct callers of ``fused_moe`` and as the benchmarks' comparison
column (both MoE modes tested). The package never launches the LINEAR mode: only the probes do
(``benchmarks/probes/ckpt_mma_linear.py``; ``mma_sweep.py --ckpt`` checks it against float64
before timing it).

One kernel, three modes: LINEAR (rows are tokens, ``y = x W^T * global scale + bias``);
MoE gate/up (gate tile and up tile of one warp share the activation fragments, the activation
is fused); MoE down (routing weight applied, one row per (token, slot) pair).
:class:`MmaExperts` is the MoE experts stage of both layouts; the align and reduce stages
around it are :mod:`.moe_stages`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.activation import apply_activation
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.common.moe_plan import MmaGemmConfig, MmaMoeConfig
from quantdispatch.kernels.common.moe_stages import ExpertWeights, MoeExperts, MoeInputs, MoeWork
from quantdispatch.kernels.common.ptx import chunk_mma, k_reduce, load_chunk, load_x, x_perm

__all__ = ["MmaExperts", "checkpoint_mma_kernel"]


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
    h = apply_activation(g, u, alpha, limit, ACT)
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


@triton.jit
def _load_weights(w_base, s_base, up_w, up_s, chunk, stride_wn, stride_sn, W_STEP: tl.constexpr,
                  S_STEP: tl.constexpr, CHUNKS: tl.constexpr, EVEN: tl.constexpr,
                  REPACKED: tl.constexpr, GATE_UP: tl.constexpr):  # fmt: skip
    """A lane's registers of chunk ``chunk`` (zeros past CHUNKS): the weight's, and GATE_UP's up
    rows (``up_w`` / ``up_s`` further; without GATE_UP the same registers twice)."""
    ok = chunk < CHUNKS
    q = load_chunk(w_base + chunk * W_STEP, s_base + chunk * S_STEP, stride_wn, stride_sn, ok,
                   EVEN, REPACKED)  # fmt: skip
    if GATE_UP:
        qu = load_chunk(w_base + up_w + chunk * W_STEP, s_base + up_s + chunk * S_STEP, stride_wn,
                        stride_sn, ok, EVEN, REPACKED)  # fmt: skip
    else:
        qu = q
    return q, qu


@triton.jit(do_not_specialize=["T"])
def checkpoint_mma_kernel(
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
    weight applied. Shapes as in the GEMV kernel: per lane [32W], per chunk [U, 32W], per token tile
    [U, NT, 32W].

    REPACKED: the weights are in the mma16x64 layout of :mod:`..mma_layout.layout` (words [E, N/16,
    K/64, 32, 4] int32, scales [E, N/16, K/64, 32, 2] viewed as int16; strides in those elements):
    one 16-byte load per chunk, the 11-op decode, and the activations in their natural order (the
    layout's K permutation keeps each lane's B fragments contiguous)."""
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
    q, qu = _load_weights(w_base, s_base, up_w, up_s, chunk0, stride_wn, stride_sn, W_STEP,
                          S_STEP, CHUNKS, EVEN, REPACKED, GATE_UP)  # fmt: skip
    for c0 in range(0, CHUNKS, STEP):
        c = c0 + chunk0
        nxt = tl.minimum(c + STEP, CHUNKS - 1) if EVEN else c + STEP
        qn, qun = _load_weights(w_base, s_base, up_w, up_s, nxt, stride_wn, stride_sn, W_STEP,
                                S_STEP, CHUNKS, EVEN, REPACKED, GATE_UP)  # fmt: skip
        ok = (c < CHUNKS)[:, None, :]
        xs = load_x(x_row + (c * 64)[:, None, :], ok, EVEN)
        bf = xs if REPACKED else x_perm(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7])
        acc0, acc1, acc2, acc3 = chunk_mma(acc0, acc1, acc2, acc3, q, bf, BF16, REPACKED)
        if GATE_UP:
            u0, u1, u2, u3 = chunk_mma(u0, u1, u2, u3, qu, bf, BF16, REPACKED)
            qu = qun
        q = qn
    r0 = k_reduce(acc0, NT, WK, WT)
    r1 = k_reduce(acc1, NT, WK, WT)
    r2 = k_reduce(acc2, NT, WK, WT)
    r3 = k_reduce(acc3, NT, WK, WT)
    lt = tl.arange(0, WT * 32)[None, :]
    l32 = lt % 32
    slot_o = 8 * tl.arange(0, NT)[:, None] + 2 * (l32 % 4)  # [NT, WT * 32]
    n_lo = (tl.program_id(1) * WT + lt // 32) * 16 + l32 // 4
    factor = tl.load(gs_ptr + e64) * 256.0
    pa, oka = _out_rows(b, sorted_ptr, slot_o, T, BM, DIRECT, LINEAR)
    pb, okb = _out_rows(b, sorted_ptr, slot_o + 1, T, BM, DIRECT, LINEAR)
    if GATE_UP:
        v0 = k_reduce(u0, NT, WK, WT)
        v1 = k_reduce(u1, NT, WK, WT)
        v2 = k_reduce(u2, NT, WK, WT)
        v3 = k_reduce(u3, NT, WK, WT)
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


def _launch(cfg: MmaGemmConfig, blocks: int, tiles: int, **kw: object) -> None:
    if tiles % cfg.wt:
        raise ValueError(f"WT={cfg.wt} does not divide the {tiles} tiles")
    grid = (blocks, tiles // cfg.wt)
    launch(checkpoint_mma_kernel, grid,
        **kw, WT=cfg.wt, WK=cfg.wk, UNROLL=cfg.unroll, num_warps=cfg.wt * cfg.wk, num_stages=1
    )


class MmaExperts(MoeExperts):
    """The mma.sync gate/up and down kernels as the experts stage, for both layouts: the stacks
    = (packed uint8 [E, N, K/2], E4M3 codes uint8 [E, N, K/16], global scales fp32 [E]),
    or in the mma16x64 layout (int32 words [E, N/16, K/64, 32, 4], uint8 scales [E, N/16,
    K/64, 32 or 16, 2], global scales; :mod:`..mma_layout.moe_stacks`), checked by the caller,
    shapes by :func:`.moe_plan.mma_moe_supported`. ``inter`` (I) is passed, not read off w13:
    the two layouts shape their code tensors differently."""

    def __init__(self, weights: ExpertWeights, cfg: MmaMoeConfig, inter: int) -> None:
        (c13, s13, g13), (c2, s2, g2), b13, b2 = weights
        repacked = c13.dtype == torch.int32
        if repacked:  # strides in words and in scale pairs (int16)
            s13, s2 = s13.view(torch.int16), s2.view(torch.int16)
            hidden = c13.shape[2] * 64
            rows13 = rows2 = sn13 = sn2 = 0
        else:
            hidden = c13.shape[2] * 2
            rows13, rows2, sn13, sn2 = c13.stride(1), c2.stride(1), s13.stride(1), s2.stride(1)
        self.cfg, self.inter, self.block_m, self.direct = cfg, inter, cfg.block_m, cfg.direct
        self._common = dict(E=c13.shape[0], DIRECT=cfg.direct, LINEAR=False, NT=cfg.nt,
                            REPACKED=repacked, SPC=s13.shape[3] if repacked else 32)  # fmt: skip
        self._gemm1 = dict(
            w_ptr=c13, s_ptr=s13, gs_ptr=g13, bias_ptr=b13 if b13 is not None else g13,
            up_off=inter, stride_we=c13.stride(0), stride_wn=rows13, stride_se=s13.stride(0),
            stride_sn=sn13, stride_be=b13.stride(0) if b13 is not None else 0,
            CHUNKS=hidden // 64, GATE_UP=True, HAS_BIAS=b13 is not None,
        )  # fmt: skip
        self._gemm2 = dict(
            w_ptr=c2, s_ptr=s2, gs_ptr=g2, bias_ptr=b2 if b2 is not None else g2, up_off=0,
            stride_we=c2.stride(0), stride_wn=rows2, stride_se=s2.stride(0), stride_sn=sn2,
            stride_be=b2.stride(0) if b2 is not None else 0, CHUNKS=inter // 64,
            GATE_UP=False, HAS_BIAS=b2 is not None,
        )  # fmt: skip
        self._hidden = hidden

    def apply(self, inp: MoeInputs, work: MoeWork) -> None:
        """Gate/up into ``a`` then down into ``y`` (one row per pair)."""
        blocks, a, y = work.buffers()
        x, act = inp.x, inp.act
        if x.stride(0) % 8 or x.data_ptr() % 16:  # 16-byte activation loads
            x = x.clone(memory_format=torch.contiguous_format)
        common = dict(
            self._common, ids_ptr=inp.ids, sorted_ptr=blocks.sorted_ids,
            bexp_ptr=blocks.block_expert, nvalid_ptr=blocks.num_blocks, tw_ptr=inp.tw,
            T=inp.pairs, top_k=inp.top_k, alpha=float(act.alpha), limit=float(act.limit),
            ACT=act.code, BF16=x.dtype == torch.bfloat16,
        )  # fmt: skip
        _launch(self.cfg.gemm1, blocks.n_blocks, self.inter // 16, x_ptr=x, out_ptr=a,
                stride_xm=x.stride(0), stride_om=a.stride(0), **self._gemm1, **common)  # fmt: skip
        _launch(self.cfg.gemm2, blocks.n_blocks, self._hidden // 16, x_ptr=a, out_ptr=y,
                stride_xm=a.stride(0), stride_om=y.stride(0), **self._gemm2, **common)  # fmt: skip

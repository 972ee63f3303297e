"""Fused MoE in Triton on packed expert weights (NVFP4, MXFP4, FP8), weight-only.

``out[t] = sum_j topk_weights[t, j] * down_e(act(gate_up_e(x[t])))`` with ``e = topk_ids[t, j]``,
for the stacked canonical expert tensors of :mod:`quantdispatch.moe` (gate rows then up rows in
w13). Four steps, every shape static given (M, top_k, E), no host synchronization, so one call
is CUDA-graph capturable and opaque to torch.compile (it runs behind a custom op):

1. **Align** (sorted path): the M * top_k (token, slot) pairs are grouped by expert and each
   expert's group is padded to a multiple of ``block_m``, written into a worst-case-sized
   buffer (``max_blocks * block_m`` entries, pads hold the sentinel T), with one expert id per
   block and the number of used blocks in a one-element device tensor. One Triton program does
   it when all pairs fit one chunk (a one-hot [chunk, E] matrix: counts are its column sums,
   the rank of a pair inside its expert its column prefix sum); bigger inputs take three
   launches (per-chunk counts, one program turning them into offsets, per-chunk scatter).
   Ids outside [0, E) (experts another rank holds, -1) get no slot at all.
   **Direct** path (few pairs per expert, M=1 decode): no alignment; each pair is its own
   block, its expert read straight from ``topk_ids`` (one launch fewer). (A variant that also
   fused steps 3 and 4, one program per (token, N tile) walking the token's slots, has only
   H / BN programs at M=1; with it the whole Qwen3 M=1 call took 65 us on the H200, 8.5x the
   floor, so the down GEMM keeps one program per (pair, N tile).)
2. **Gate/up GEMM** per (block, N tile): rows of x gathered by token, the packed weights of
   the block's expert decoded in registers (integer-op decoders of :mod:`.decode`), two fp32
   accumulators (gate and up tiles), per-expert global scale / FP8 scale and bias in fp32,
   the activation fused, the intermediate stored in x.dtype in sorted order.
3. **Down GEMM** per (block, N tile) on that intermediate; fp32 epilogue applies scale, bias
   and the pair's routing weight and writes one row per (token, slot) pair.
4. **Reduce**: out[t] = the fp32 sum of its valid slots' rows (deterministic: no atomics),
   cast to x.dtype. Slots with ids outside [0, E) are skipped, so their rows are never read.

Which kernels run is :func:`moe_config`'s choice from the static sizes: NVFP4 with few tokens
per expert on SM 8.0+ runs steps 2-3 as the ``mma.sync`` kernels of :mod:`.fp4_mma_ckpt`
(8-pair blocks or single pairs); very many tokens per expert on SM 9.0+ dequantize each GEMM's
experts and run ``torch._grouped_mm`` (:func:`_run_dequant`); everything else takes the tl.dot
kernels below. (``QuantMoE`` on an SM 8.0+ GPU repacks NVFP4 experts of gated layers and runs
:mod:`.fp4_mma_moe` instead, which reuses the alignment, the activations and step 4 from here.)

Tiles: few tokens per expert take 16-row blocks, narrow N tiles (enough programs to cover
the GPU) and long K steps; many tokens per expert take 64/128-row blocks. K and N need not be
multiples of the tiles (masked K tail, clamped N rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from quantdispatch.errors import InputError, WeightFormatError, format_error
from quantdispatch.kernels.common.decode import (
    e2m1_pair_to_16bit,
    e2m1_pair_to_f32,
    e4m3_to_f32,
    e4m3_to_f32_scaled_finite,
    e8m0_to_f32_scaled,
)
from quantdispatch.moe_math import get_activation

if TYPE_CHECKING:
    from quantdispatch.kernels.checkpoint_layout.moe_mma import MmaMoeConfig

__all__ = [
    "DequantMoeConfig",
    "MoeConfig",
    "MoeGemmConfig",
    "fused_moe",
    "moe_align",
    "moe_config",
]

_FMT = {"nvfp4": 0, "mxfp4": 1, "fp8": 2}
_GROUP = {"nvfp4": 16, "mxfp4": 32, "fp8": 1}


# ---------------------------------------------------------------------------------------------
# Step 1: alignment


@triton.jit
def _onehot(ids_ptr, start, T, E, CH: tl.constexpr, E_PAD: tl.constexpr):
    """Pairs [start, start+CH): their flat indices, validity and one-hot [CH, E_PAD] (int32)."""
    offs = start + tl.arange(0, CH)
    ids = tl.load(ids_ptr + offs, mask=offs < T, other=-1).to(tl.int32)
    valid = (ids >= 0) & (ids < E) & (offs < T)
    eidx = tl.arange(0, E_PAD)
    oh = ((ids[:, None] == eidx[None, :]) & valid[:, None]).to(tl.int32)
    return offs, valid, oh


@triton.jit
def _scatter(sorted_ptr, offs, valid, oh, base):
    """sorted[base[e] + rank] = pair for each valid pair of expert e (rank in this chunk)."""
    cums = tl.cumsum(oh, axis=0)
    dest = tl.sum(oh * (base[None, :] + cums - 1), axis=1)
    tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=valid)


@triton.jit
def _finish(counts, sorted_ptr, bexp_ptr, nvalid_ptr, T, max_blocks,
            BM: tl.constexpr, E_PAD: tl.constexpr, CHB: tl.constexpr):  # fmt: skip
    """From per-expert counts: pads, block -> expert, used blocks; returns each expert's start."""
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    pstart = pend - padded
    j = tl.arange(0, BM)
    pos = (pstart + counts)[:, None] + j[None, :]
    sentinel = tl.zeros((E_PAD, BM), dtype=tl.int32) + T
    tl.store(sorted_ptr + pos, sentinel, mask=pos < pend[:, None])
    tl.store(nvalid_ptr, tl.sum(padded, axis=0) // BM)
    for b0 in range(0, max_blocks, CHB):
        bb = b0 + tl.arange(0, CHB)
        owner = tl.sum((pend[None, :] <= (bb * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(bexp_ptr + bb, owner, mask=bb < max_blocks)
    return pstart


@triton.jit
def _align_single_kernel(ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, T, E, max_blocks,
                         BM: tl.constexpr, CH: tl.constexpr, E_PAD: tl.constexpr,
                         CHB: tl.constexpr):  # fmt: skip
    """All pairs in one chunk: count, offsets and scatter in one program."""
    offs, valid, oh = _onehot(ids_ptr, 0, T, E, CH, E_PAD)
    counts = tl.sum(oh, axis=0)
    pstart = _finish(counts, sorted_ptr, bexp_ptr, nvalid_ptr, T, max_blocks, BM, E_PAD, CHB)
    _scatter(sorted_ptr, offs, valid, oh, pstart)


@triton.jit
def _align_count_kernel(ids_ptr, part_ptr, T, E, CH: tl.constexpr, E_PAD: tl.constexpr):
    """Per-chunk expert counts into part[chunk, E_PAD] (no atomics, no memset)."""
    pid = tl.program_id(0)
    _, _, oh = _onehot(ids_ptr, pid * CH, T, E, CH, E_PAD)
    tl.store(part_ptr + pid * E_PAD + tl.arange(0, E_PAD), tl.sum(oh, axis=0))


@triton.jit
def _align_offsets_kernel(part_ptr, base_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, T, n_chunks,
                          max_blocks, BM: tl.constexpr, E_PAD: tl.constexpr,
                          CHB: tl.constexpr):  # fmt: skip
    """One program: totals, pads and block owners, then base[c] = where chunk c's pairs start.

    Reads ``part`` and writes ``base`` (never in place: replicated lanes of other warps could
    read an element after it was overwritten)."""
    eidx = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c in range(0, n_chunks):
        counts += tl.load(part_ptr + c * E_PAD + eidx)
    pstart = _finish(counts, sorted_ptr, bexp_ptr, nvalid_ptr, T, max_blocks, BM, E_PAD, CHB)
    running = pstart
    for c in range(0, n_chunks):
        tl.store(base_ptr + c * E_PAD + eidx, running)
        running += tl.load(part_ptr + c * E_PAD + eidx)


@triton.jit
def _align_scatter_kernel(ids_ptr, base_ptr, sorted_ptr, T, E,
                          CH: tl.constexpr, E_PAD: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs, valid, oh = _onehot(ids_ptr, pid * CH, T, E, CH, E_PAD)
    base = tl.load(base_ptr + pid * E_PAD + tl.arange(0, E_PAD))
    _scatter(sorted_ptr, offs, valid, oh, base)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a call allocates comes from here (tests swap in poisoned buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def max_blocks_for(pairs: int, experts: int, block_m: int) -> int:
    """Worst-case number of blocks: sum_e ceil(c_e / BM) <= min(T, min(E, T) + T // BM)."""
    return max(1, min(pairs, min(experts, pairs) + pairs // block_m))


def _chunk(pairs: int, e_pad: int) -> int:
    """Pairs per alignment chunk: the one-hot tile stays <= 16K elements."""
    cap = max(16, 16384 // e_pad)
    return max(16, min(triton.next_power_of_2(max(pairs, 1)), cap))


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert, each group padded to a multiple of ``block_m``.

    Returns ``sorted_ids`` int32 [max_blocks * block_m] (flat pair indices t * top_k + j,
    pads = M * top_k), ``block_expert`` int32 [max_blocks] and ``num_blocks`` int32 [1] (blocks
    in use; entries past it are garbage). Shapes depend only on (M, top_k, E, block_m).
    """
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    pairs = ids.numel()
    max_blocks = max_blocks_for(pairs, num_experts, block_m)
    dev = ids.device
    sorted_ids = empty((max_blocks * block_m,), torch.int32, dev)
    block_expert = empty((max_blocks,), torch.int32, dev)
    num_blocks = empty((1,), torch.int32, dev)
    e_pad = triton.next_power_of_2(max(num_experts, 2))
    ch = _chunk(pairs, e_pad)
    chb = max(16, min(triton.next_power_of_2(max_blocks), max(16, 16384 // e_pad)))
    n_chunks = triton.cdiv(pairs, ch)
    if n_chunks <= 1:
        _align_single_kernel[(1,)](
            ids, sorted_ids, block_expert, num_blocks, pairs, num_experts, max_blocks,
            BM=block_m, CH=ch, E_PAD=e_pad, CHB=chb, num_warps=4,
        )  # fmt: skip
    else:
        part = empty((2, n_chunks, e_pad), torch.int32, dev)  # counts, then bases
        _align_count_kernel[(n_chunks,)](ids, part[0], pairs, num_experts, CH=ch, E_PAD=e_pad)
        _align_offsets_kernel[(1,)](
            part[0], part[1], sorted_ids, block_expert, num_blocks, pairs, n_chunks, max_blocks,
            BM=block_m, E_PAD=e_pad, CHB=chb, num_warps=4,
        )  # fmt: skip
        _align_scatter_kernel[(n_chunks,)](
            ids, part[1], sorted_ids, pairs, num_experts, CH=ch, E_PAD=e_pad
        )
    return sorted_ids, block_expert, num_blocks


# ---------------------------------------------------------------------------------------------
# Steps 2-3: grouped GEMMs on packed weights


@triton.jit
def _load_w(w_ptrs, s_ptrs, rem, FMT: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, EVEN_K: tl.constexpr, DEQ16: tl.constexpr,
            BF16: tl.constexpr):  # fmt: skip
    """One [BN, BK] weight tile, every value exact.

    NVFP4 on a GPU (DEQ16): codes and block scales decoded straight to x's 16-bit type
    (integer ops and bitcasts, :func:`.decode.e2m1_pair_to_16bit`), one 16-bit multiply per
    weight giving e2m1 * scale * 2^-8 (<= 6 significant bits: no rounding); the kernels undo
    the 2^-8 in the fp32 epilogue (:func:`_fp4_fold`). Otherwise (MXFP4, NVFP4 on the
    interpreter, whose 16-bit subnormals are unreliable): fp32 e2m1 * scale. FP8: the fp32
    e4m3 value.
    """
    if FMT == 2:
        offs_k = tl.arange(0, BK)
        b = tl.load(w_ptrs) if EVEN_K else tl.load(w_ptrs, mask=offs_k[None, :] < rem, other=0)
        w = e4m3_to_f32(b)
    else:
        offs_kh = tl.arange(0, BK // 2)
        offs_g = tl.arange(0, BK // GROUP)
        if EVEN_K:
            p = tl.load(w_ptrs)
            sb = tl.load(s_ptrs)
        else:
            p = tl.load(w_ptrs, mask=offs_kh[None, :] < rem // 2, other=0)
            sb = tl.load(s_ptrs, mask=offs_g[None, :] < rem // GROUP, other=0)
        if DEQ16:
            lo, hi = e2m1_pair_to_16bit(p, BF16)  # bf16: e2m1 * 2^-126, fp16: e2m1 * 2^-14
            if BF16:  # e4m3 * 2^-8 * 2^126
                s = (e4m3_to_f32_scaled_finite(sb) * 8.507059173023462e37).to(tl.bfloat16)
            else:  # e4m3 * 2^-8 * 2^14
                s = (e4m3_to_f32_scaled_finite(sb) * 16384.0).to(tl.float16)
        else:
            lo, hi = e2m1_pair_to_f32(p)  # e2m1 * 2^-14
            if FMT == 1:
                s = e8m0_to_f32_scaled(sb, 14)  # 2^(s-127) * 2^14
            else:
                s = e4m3_to_f32_scaled_finite(sb) * 4194304.0  # e4m3 * 2^-8 * 2^22
        w = tl.reshape(tl.join(lo, hi), (BN, BK // GROUP, GROUP)) * s[:, :, None]
        w = tl.reshape(w, (BN, BK))
    return w


@triton.jit
def _fp4_fold(gs_ptr, e64, DEQ16: tl.constexpr):
    """NVFP4 epilogue factor: the expert's global scale (x 2^8 after a 16-bit decode)."""
    g = tl.load(gs_ptr + e64)
    if DEQ16:
        g = g * 256.0
    return g


@triton.jit
def _mma(x, w, acc, DOT_F32: tl.constexpr):
    """acc += x @ w.T; fp32 inputs on the interpreter (its 16-bit dot is not exact)."""
    if DOT_F32:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    return acc


@triton.jit
def _w_ptrs(w_base, s_base, rows, stride_wn, stride_sn, FMT: tl.constexpr, GROUP: tl.constexpr,
            BK: tl.constexpr):  # fmt: skip
    """Pointers to the first K step of ``rows`` (weights, and fp4 block scales)."""
    if FMT == 2:
        w_ptrs = w_base + rows[:, None] * stride_wn + tl.arange(0, BK)[None, :]
        s_ptrs = s_base + rows * 0
    else:
        w_ptrs = w_base + rows[:, None] * stride_wn + tl.arange(0, BK // 2)[None, :]
        s_ptrs = s_base + rows[:, None] * stride_sn + tl.arange(0, BK // GROUP)[None, :]
    return w_ptrs, s_ptrs


@triton.jit
def _block_rows(b, ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, T, E, BM: tl.constexpr,
                DIRECT: tl.constexpr):  # fmt: skip
    """(skip, expert, pair index per row, row in use, intermediate row) of block ``b``."""
    offs_r = tl.arange(0, BM)
    if DIRECT:
        e = tl.load(ids_ptr + b).to(tl.int32)
        skip = (e < 0) | (e >= E)
        pair = b + offs_r * 0
        row_ok = offs_r == 0
        a_row = pair
    else:
        skip = b >= tl.load(nvalid_ptr)
        e = tl.load(bexp_ptr + b)  # b < max_blocks: in bounds, garbage when skipped
        pair = tl.load(sorted_ptr + b * BM + offs_r)
        row_ok = pair < T
        a_row = b * BM + offs_r
    return skip, e, pair, row_ok, a_row


@triton.jit
def _activation(g, u, alpha, limit, ACT: tl.constexpr):
    """moe_math activations in fp32 (codes: 0 silu, 1 gelu_tanh, 2 swiglu_oai, 3 relu2, 4 silu)."""
    if ACT == 0:
        h = g * tl.sigmoid(g) * u
    elif ACT == 1:  # 0.5 * (1 + tanh(z)) = sigmoid(2z)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        h = g * tl.sigmoid(2.0 * inner) * u
    elif ACT == 2:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        h = gc * tl.sigmoid(alpha * gc) * (uc + 1.0)
    elif ACT == 3:
        r = tl.maximum(g, 0.0)
        h = r * r
    else:
        h = g * tl.sigmoid(g)
    return h


@triton.jit(do_not_specialize=["T"])
def _moe_gemm1_kernel(
    x_ptr, ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr,
    w_ptr, s_ptr, gs_ptr, bias_ptr, a_ptr,
    T, N, K, E, top_k,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be, stride_am,
    alpha, limit,
    FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_KIND: tl.constexpr,
    BLOCK_SN: tl.constexpr, BLOCK_SK: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, DEQ16: tl.constexpr, BF16: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """A[row, n] = act(x[tok] @ gate_e[n].T, x[tok] @ up_e[n].T) for one block and N tile."""
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    skip, e, pair, row_ok, a_row = _block_rows(
        b, ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, T, E, BM, DIRECT
    )
    if skip:
        return
    e64 = e.to(tl.int64)
    tok = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + e64 * stride_we
    s_base = s_ptr + e64 * stride_se
    wg_ptrs, sg_ptrs = _w_ptrs(w_base, s_base, rn, stride_wn, stride_sn, FMT, GROUP, BK)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    if GATED:
        wu_ptrs, su_ptrs = _w_ptrs(w_base, s_base, rn + N, stride_wn, stride_sn, FMT, GROUP, BK)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        acc_u = acc_g
    WSTEP: tl.constexpr = BK if FMT == 2 else BK // 2
    SSTEP: tl.constexpr = 0 if FMT == 2 else BK // GROUP
    for k0 in range(0, K, BK):
        rem = K - k0
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < rem), other=0.0)
        wg = _load_w(wg_ptrs, sg_ptrs, rem, FMT, GROUP, BN, BK, EVEN_K, DEQ16, BF16)
        if SCALE_KIND == 2:  # fp8 block scales: scale each K step's partial product
            sblk = s_base + (k0 // BLOCK_SK) * stride_sk
            pg = _mma(x, wg, tl.zeros((BM, BN), dtype=tl.float32), DOT_F32)
            acc_g += pg * tl.load(sblk + (rn // BLOCK_SN) * stride_sn)[None, :]
        else:
            acc_g = _mma(x, wg, acc_g, DOT_F32)
        if GATED:
            wu = _load_w(wu_ptrs, su_ptrs, rem, FMT, GROUP, BN, BK, EVEN_K, DEQ16, BF16)
            if SCALE_KIND == 2:
                pu = _mma(x, wu, tl.zeros((BM, BN), dtype=tl.float32), DOT_F32)
                acc_u += pu * tl.load(sblk + ((rn + N) // BLOCK_SN) * stride_sn)[None, :]
            else:
                acc_u = _mma(x, wu, acc_u, DOT_F32)
            wu_ptrs += WSTEP
            su_ptrs += SSTEP
        x_ptrs += BK
        wg_ptrs += WSTEP
        sg_ptrs += SSTEP

    if FMT == 0:
        gs = _fp4_fold(gs_ptr, e64, DEQ16)
        acc_g = acc_g * gs
        acc_u = acc_u * gs
    elif FMT == 2:
        if SCALE_KIND == 0:
            s0 = tl.load(s_base)
            acc_g = acc_g * s0
            acc_u = acc_u * s0
        elif SCALE_KIND == 1:
            acc_g = acc_g * tl.load(s_base + rn * stride_sn)[None, :]
            if GATED:
                acc_u = acc_u * tl.load(s_base + (rn + N) * stride_sn)[None, :]
    if HAS_BIAS:
        acc_g = acc_g + tl.load(bias_ptr + e64 * stride_be + rn)[None, :]
        if GATED:
            acc_u = acc_u + tl.load(bias_ptr + e64 * stride_be + rn + N)[None, :]
    h = _activation(acc_g, acc_u, alpha, limit, ACT)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(a_ptrs, h.to(a_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["T"])
def _moe_gemm2_kernel(
    a_ptr, ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, tw_ptr,
    w_ptr, s_ptr, gs_ptr, bias_ptr, y_ptr,
    T, N, K, E,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be, stride_ym,
    FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_KIND: tl.constexpr,
    BLOCK_SN: tl.constexpr, BLOCK_SK: tl.constexpr,
    HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    DEQ16: tl.constexpr, BF16: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Y[pair, n] = w[pair] * (A[row] @ down_e[n].T * scale + bias) for one block and N tile."""
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    skip, e, pair, row_ok, a_row = _block_rows(
        b, ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, T, E, BM, DIRECT
    )
    if skip:
        return
    e64 = e.to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_base = w_ptr + e64 * stride_we
    s_base = s_ptr + e64 * stride_se
    w_ptrs, s_ptrs = _w_ptrs(w_base, s_base, rn, stride_wn, stride_sn, FMT, GROUP, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    WSTEP: tl.constexpr = BK if FMT == 2 else BK // 2
    SSTEP: tl.constexpr = 0 if FMT == 2 else BK // GROUP
    for k0 in range(0, K, BK):
        rem = K - k0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < rem), other=0.0)
        w = _load_w(w_ptrs, s_ptrs, rem, FMT, GROUP, BN, BK, EVEN_K, DEQ16, BF16)
        if SCALE_KIND == 2:
            part = _mma(a, w, tl.zeros((BM, BN), dtype=tl.float32), DOT_F32)
            sblk = s_base + (k0 // BLOCK_SK) * stride_sk
            acc += part * tl.load(sblk + (rn // BLOCK_SN) * stride_sn)[None, :]
        else:
            acc = _mma(a, w, acc, DOT_F32)
        a_ptrs += BK
        w_ptrs += WSTEP
        s_ptrs += SSTEP

    if FMT == 0:
        acc = acc * _fp4_fold(gs_ptr, e64, DEQ16)
    elif FMT == 2:
        if SCALE_KIND == 0:
            acc = acc * tl.load(s_base)
        elif SCALE_KIND == 1:
            acc = acc * tl.load(s_base + rn * stride_sn)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + e64 * stride_be + rn)[None, :]
    pair64 = tl.where(row_ok, pair, 0).to(tl.int64)
    acc = acc * tl.load(tw_ptr + pair64, mask=row_ok, other=0.0)[:, None]
    y_ptrs = y_ptr + pair64[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


# ---------------------------------------------------------------------------------------------
# Step 4: reduction over the top-k slots


@triton.jit
def _moe_reduce_kernel(y_ptr, ids_ptr, out_ptr, N, E, top_k, stride_ym, stride_om,
                       TOPK_P: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    j = tl.arange(0, TOPK_P)
    offs_n = pid_n * BN + tl.arange(0, BN)
    jm = j < top_k
    ids = tl.load(ids_ptr + t * top_k + j, mask=jm, other=-1)
    ok = jm & (ids >= 0) & (ids < E)
    rows = (t * top_k + j).to(tl.int64)
    v = tl.load(y_ptr + rows[:, None] * stride_ym + offs_n[None, :],
                mask=ok[:, None] & (offs_n[None, :] < N), other=0.0)  # fmt: skip
    s = tl.sum(v.to(tl.float32), axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, s.to(out_ptr.dtype.element_ty),
             mask=offs_n < N)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host side: configs, checks, launch


@dataclass(frozen=True)
class MoeGemmConfig:
    """Tile of one of the two GEMMs (block_m is shared, see :class:`MoeConfig`)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    """``direct``: one block per (token, slot) pair, no alignment (decode with few pairs per
    expert); else pairs are sorted into ``block_m``-row blocks per expert."""

    block_m: int
    gemm1: MoeGemmConfig
    gemm2: MoeGemmConfig
    direct: bool = False


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(idx).multi_processor_count)


def _narrow_n(n: int, blocks: int, sms: int, start: int) -> int:
    """Largest N tile <= start (>= 16) that still gives about two programs per SM."""
    bn = start
    while bn > 16 and blocks * triton.cdiv(n, bn) < 2 * sms:
        bn //= 2
    return bn


#: NVFP4 with at most this many tokens per expert (M * top_k / E) runs the mma.sync kernels of
#: kernels/fp4_mma_ckpt.py (SM 8.0+, gated, I and H multiples of 64) on 8-pair blocks; with more
#: tokens per expert the tl.dot kernels reuse each decoded tile across more rows and win (H200:
#: Qwen3 M=16 (1 per expert) 127 vs 147 us, DeepSeek-V3 M=256 (8 per expert) 3878 vs 3364 us;
#: benchmarks/results/moe-h200-*.md).
MMA_MAX_TOKENS_PER_EXPERT = 4


#: NVFP4 / MXFP4 with at least this many tokens per expert, on SM 9.0+ with torch._grouped_mm,
#: dequantizes each GEMM's experts to a 16-bit buffer and runs torch._grouped_mm: at that many
#: tokens the GEMMs are compute bound, and cuBLAS-class grouped GEMMs beat the tl.dot kernels by
#: more than the dequantization pass costs (H200, Mixtral M=4096 with 1024 tokens per expert:
#: tl.dot 9.5 ms, this path 6.4 ms, bf16 experts 6.1 ms; benchmarks/results/moe-h200-*.md).
#: Below it the pass is not expected to pay (estimate, not measured: Mixtral M=1024, 256 per
#: expert, ~1.3 ms of dequantization plus a ~1.9 ms grouped GEMM against 2.9 ms for tl.dot).
DEQUANT_MIN_TOKENS_PER_EXPERT = 512
#: ... as long as the transient 16-bit copy of one GEMM's experts stays below this (bytes).
DEQUANT_MAX_BUFFER_BYTES = 4 * 2**30


@dataclass(frozen=True)
class DequantMoeConfig:
    """Dequantize each GEMM's experts to 16-bit, then torch._grouped_mm (see the constant)."""


def _grouped_mm_capable(device: torch.device) -> bool:
    if device.type != "cuda" or _interpreting() or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _rows_aligned(*weights: torch.Tensor) -> bool:
    from quantdispatch.kernels.checkpoint_layout.moe_mma import rows_aligned

    return all(rows_aligned(t) for t in weights)


def _mma_capable(fmt: str, gated: bool, inter: int, hidden: int, device: torch.device) -> bool:
    from quantdispatch.kernels.checkpoint_layout.moe_mma import mma_moe_supported

    if fmt != "nvfp4" or device.type != "cuda" or _interpreting():
        return False
    return mma_moe_supported(inter, hidden, gated, torch.cuda.get_device_capability(device))


def moe_config(
    m: int,
    top_k: int,
    experts: int,
    inter: int,
    hidden: int,
    fmt: str,
    device: torch.device,
    *,
    gated: bool = True,
    allow_mma: bool = True,
    allow_dequant: bool = True,
) -> MoeConfig | MmaMoeConfig | DequantMoeConfig:
    """Tiles from the static sizes only (so graphs and compile see no data dependence).

    Tokens per expert ``tpe = M * top_k / E`` picks the regime. NVFP4 on SM 8.0+ with
    ``tpe <= MMA_MAX_TOKENS_PER_EXPERT``: the mma.sync kernels on single pairs (``direct``)
    or 8-pair blocks (:func:`.fp4_mma_ckpt.mma_moe_config`). Otherwise tl.dot kernels: <= 12
    small 16-row blocks with narrow N tiles (memory bound: cover every SM) and long K steps;
    then 32, 64, 128-row blocks with wider tiles (compute bound: reuse each decoded weight tile
    across more rows).
    ``direct`` when pairs are so few (4 * pairs <= E) that experts rarely repeat.
    """
    pairs = m * top_k
    tpe = pairs / max(experts, 1)
    sms = _num_sms(device)
    fp8 = fmt == "fp8"
    buffer = experts * max((2 * inter if gated else inter) * hidden, hidden * inter) * 2
    if (
        allow_dequant
        and fmt in ("nvfp4", "mxfp4")
        and tpe >= DEQUANT_MIN_TOKENS_PER_EXPERT
        and buffer <= DEQUANT_MAX_BUFFER_BYTES
        and _grouped_mm_capable(device)
    ):
        return DequantMoeConfig()
    if (
        allow_mma
        and tpe <= MMA_MAX_TOKENS_PER_EXPERT
        and _mma_capable(fmt, gated, inter, hidden, device)
    ):
        from quantdispatch.kernels.checkpoint_layout.moe_mma import mma_moe_config

        return mma_moe_config(pairs, experts, inter, hidden, direct=4 * pairs <= experts)
    if tpe <= 12:
        direct = 4 * pairs <= experts
        blocks = pairs if direct else min(pairs, experts)
        bk = 128 if fp8 else 256
        g1 = MoeGemmConfig(_narrow_n(inter, blocks, sms, 64), bk, 4, 3)
        g2 = MoeGemmConfig(_narrow_n(hidden, blocks, sms, 64), bk, 4, 3)
        return MoeConfig(16, g1, g2, direct)
    if tpe <= 40:
        return MoeConfig(32, MoeGemmConfig(64, 128, 4, 3), MoeGemmConfig(64, 128, 4, 3))
    if tpe <= 160:
        return MoeConfig(64, MoeGemmConfig(64, 64, 4, 3), MoeGemmConfig(128, 64, 8, 3))
    return MoeConfig(128, MoeGemmConfig(64, 64, 8, 3), MoeGemmConfig(128, 64, 8, 3))


def _interpreting() -> bool:
    """True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_moe_gemm1_kernel).__name__ == "InterpretedFunction"


def _fail(what: str, rule: str, fix: str, exc: type[Exception] = WeightFormatError) -> None:
    raise exc(format_error(f"fused_moe: {what}", rule, fix))


def _unpack_weights(
    fmt: str, w: Sequence[torch.Tensor], which: str, meta: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int, int]:
    """(codes, scales, global scale, E, N, K) of one stacked weight, checked."""
    need = {"nvfp4": 3, "mxfp4": 2, "fp8": 2}[fmt]
    if len(w) != need:
        _fail(
            f"{which} has {len(w)} tensors",
            f"{fmt} expert weights are {need} stacked tensors",
            "pass the stacked canonical tensors (see quantdispatch.moe)",
        )
    codes, scale = w[0], w[1]
    if codes.dim() != 3 or codes.stride(-1) != 1:
        _fail(
            f"{which}[0] has shape {tuple(codes.shape)}",
            "stacked expert weights are [E, N, K/2] (fp4) or [E, N, K] (fp8), rows contiguous",
            "stack the experts' weights with torch.stack",
        )
    e, n = codes.shape[0], codes.shape[1]
    if fmt == "fp8":
        if codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
            _fail(f"{which}[0] is {codes.dtype}", "FP8 weights are float8_e4m3fn", "")
        k = codes.shape[2]
        if scale.dtype != torch.float32:
            _fail(f"{which}[1] is {scale.dtype}", "FP8 scales are float32", "convert at load")
        per_expert = scale.dim() == 1 and scale.shape[0] == e
        if per_expert or (scale.dim() == 2 and tuple(scale.shape) == (e, n)):
            pass
        elif scale.dim() == 3 and len(meta) >= 3:
            bn, bk = int(meta[1]), int(meta[2])
            want = (e, triton.cdiv(n, bn), triton.cdiv(k, bk))
            if tuple(scale.shape) != want or bk % 16 != 0:
                _fail(
                    f"{which}[1] has shape {tuple(scale.shape)} with block {(bn, bk)}",
                    f"block scales are [E, ceil(N/bn), ceil(K/bk)] = {list(want)}, bk % 16 == 0",
                    "pass meta=[0, bn, bk] matching the checkpoint's weight_block_size",
                )
        else:
            _fail(
                f"{which}[1] has shape {tuple(scale.shape)} (meta {list(meta)})",
                "FP8 expert scales are [E] (tensor), [E, N] (channel) or [E, nb, kb] with "
                "meta=[0, bn, bk] (block)",
                "pass the stacked scales of this layer",
            )
        return codes.view(torch.uint8), scale, None, e, n, k
    group = _GROUP[fmt]
    if codes.dtype != torch.uint8:
        _fail(f"{which}[0] is {codes.dtype}", "packed FP4 codes are uint8 [E, N, K/2]", "")
    k = codes.shape[2] * 2
    want_dt = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    if (
        scale.dtype not in (want_dt, torch.uint8)
        or tuple(scale.shape) != (e, n, k // group)
        or scale.stride(-1) != 1
    ):
        _fail(
            f"{which}[1] is {scale.dtype} {tuple(scale.shape)}",
            f"{fmt} block scales are {want_dt} [E, N, K/{group}] = [{e}, {n}, {k // group}]",
            "pass the stacked block scales of this layer",
        )
    gs = None
    if fmt == "nvfp4":
        gs = w[2]
        if gs.dtype != torch.float32 or tuple(gs.shape) != (e,):
            _fail(
                f"{which}[2] is {gs.dtype} {tuple(gs.shape)}",
                f"NVFP4 experts have one float32 global scale (multiplier) each: [{e}]",
                "stack the per-expert global scales (merged gate/up share one)",
            )
    return codes, scale.view(torch.uint8), gs, e, n, k


def _strides(fmt: str, scale: torch.Tensor) -> tuple[int, int, int, int]:
    """(stride_se, stride_sn, stride_sk, scale kind) for the kernels."""
    if fmt != "fp8":
        return scale.stride(0), scale.stride(1), 0, 0
    if scale.dim() == 1:
        return scale.stride(0), 0, 0, 0
    if scale.dim() == 2:
        return scale.stride(0), scale.stride(1), 0, 1
    return scale.stride(0), scale.stride(1), scale.stride(2), 2


def _check_call(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: int,
    n13: int,
    n2: int,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> int:
    """The checks every MoE kernel entry shares (x already checked as [M, H] 16-bit): x on a
    GPU, routing shapes and dtypes, biases, one device. Returns top_k."""
    if x.device.type != "cuda" and not _interpreting():
        _fail(
            f"x is on {x.device}",
            "the Triton kernels run on CUDA devices",
            "use the reference backend on CPU",
            InputError,
        )
    m = x.shape[0]
    int_ids = (torch.int32, torch.int64)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_ids.dtype not in int_ids:
        _fail(
            f"topk_ids is {topk_ids.dtype} {tuple(topk_ids.shape)}",
            f"topk_ids are int32/int64 [M={m}, top_k]",
            "pass the router's top-k expert ids",
            InputError,
        )
    top_k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (m, top_k) or topk_weights.dtype != torch.float32:
        _fail(
            f"topk_weights is {topk_weights.dtype} {tuple(topk_weights.shape)}",
            f"topk_weights are float32 [M, top_k] = [{m}, {top_k}]",
            "pass the router's final weights as float32",
            InputError,
        )
    for name, bias, n in (("w13_bias", w13_bias, n13), ("w2_bias", w2_bias, n2)):
        if bias is not None and (tuple(bias.shape) != (experts, n) or bias.dtype != torch.float32):
            _fail(
                f"{name} is {bias.dtype} {tuple(bias.shape)}",
                f"expert biases are float32 [E, N] = [{experts}, {n}]",
                "stack them as float32",
            )
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13),
                    ("w2", w2), ("w13_bias", w13_bias), ("w2_bias", w2_bias)):  # fmt: skip
        if t is not None and t.device != x.device:
            _fail(f"{name} is on {t.device}, x on {x.device}", "one device", "", InputError)
    return top_k


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: list[torch.Tensor],
    w2: list[torch.Tensor],
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    *,
    fmt: str,
    activation: str,
    params: list[float],
    meta: list[int],
    config: MoeConfig | MmaMoeConfig | DequantMoeConfig | None = None,
) -> torch.Tensor:
    """Routed experts on packed stacked weights: [M, H] in x.dtype (see the module docstring).

    ``topk_ids`` hold local expert ids; ids outside [0, E) contribute nothing. ``topk_weights``
    (float32) are final. ``config`` overrides the tile heuristic (tests and tuning only).
    """
    if fmt not in _FMT:
        _fail(f"format {fmt!r}", f"formats: {', '.join(_FMT)}", "", InputError)
    spec = get_activation(activation)
    half = (torch.float16, torch.bfloat16)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in half:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        _fail(f"x is {got}", "x is float16/bfloat16 [M, H]", "flatten and cast it", InputError)
    m, hidden = x.shape
    c13, s13, g13, e, n13, k13 = _unpack_weights(fmt, w13, "w13", meta)
    c2, s2, g2, e2, n2, k2 = _unpack_weights(fmt, w2, "w2", meta)
    inter = n13 // 2 if spec.gated else n13
    if e2 != e or k13 != hidden or n2 != hidden or k2 != inter or (spec.gated and n13 % 2):
        _fail(
            f"w13 is [E={e}, N={n13}, K={k13}] and w2 [E={e2}, N={n2}, K={k2}] for x with "
            f"H={hidden} ({activation}: {'gated' if spec.gated else 'not gated'})",
            "w13 is [E, 2I (gated) or I, H] and w2 [E, H, I]",
            "pass the weights that belong to this layer",
        )
    top_k = _check_call(x, topk_ids, topk_weights, e, n13, n2, w13_bias, w2_bias, c13, c2)
    out = empty((m, hidden), x.dtype, x.device)
    if m == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    tw = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    pairs = m * top_k
    # the mma kernels load 8 bytes per weight row (moe_config checks format, GPU and shapes)
    aligned = fmt == "nvfp4" and _rows_aligned(c13, c2)
    cfg = config or moe_config(
        m, top_k, e, inter, hidden, fmt, x.device, gated=spec.gated, allow_mma=aligned
    )
    alpha, limit = 0.0, 0.0
    if spec.name == "swiglu_oai":
        alpha, limit = (tuple(params) or spec.default_params)[:2]
    if isinstance(cfg, DequantMoeConfig):
        if fmt not in ("nvfp4", "mxfp4") or not _grouped_mm_capable(x.device):
            _fail(
                f"a dequantize + grouped-GEMM config for {fmt} on {x.device}",
                "that path needs NVFP4 or MXFP4 and torch._grouped_mm on an SM 9.0+ GPU",
                "leave config=None (the heuristic picks the Triton kernels then)",
                InputError,
            )
        _run_dequant(
            x, ids, tw, e,
            lambda: _dequant_experts(fmt, c13, s13, g13, x.dtype),
            lambda: _dequant_experts(fmt, c2, s2, g2, x.dtype),
            w13_bias, w2_bias, spec.code, spec.gated, alpha, limit, out,
        )  # fmt: skip
        return out
    if not isinstance(cfg, MoeConfig):
        if not (aligned and _mma_capable(fmt, spec.gated, inter, hidden, x.device)):
            _fail(
                f"an mma config for {fmt} {activation} I={inter} H={hidden} on {x.device}",
                "the mma kernels need NVFP4, a gated activation, SM 8.0+, I and H multiples "
                "of 64 and 16-byte aligned weight rows",
                "leave config=None (the heuristic picks the tl.dot kernels then)",
                InputError,
            )
        _run_mma(x, ids, tw, (c13, s13, g13), (c2, s2, g2), w13_bias, w2_bias, spec.code,
                 alpha, limit, cfg, out, inter)  # fmt: skip
        return out
    bm = cfg.block_m
    if cfg.direct:
        n_blocks = pairs
        a = empty((pairs, inter), x.dtype, x.device)
        sorted_ids = block_expert = num_blocks = ids  # unused by the direct kernels
    else:
        sorted_ids, block_expert, num_blocks = moe_align(ids, e, bm)
        n_blocks = block_expert.shape[0]
        a = empty((n_blocks * bm, inter), x.dtype, x.device)

    fcode = _FMT[fmt]
    group = _GROUP[fmt]
    bsn, bsk = (int(meta[1]), int(meta[2])) if fmt == "fp8" and len(meta) >= 3 else (1, 1)
    dot_f32 = _interpreting()
    bf16 = x.dtype == torch.bfloat16
    deq16 = fmt == "nvfp4" and not dot_f32

    def block_k(c: MoeGemmConfig, k: int, kind: int) -> int:
        bk = max(c.block_k, 2 * group if fmt != "fp8" else 16)
        if kind == 2:  # a K step must not straddle two scale blocks
            while bsk % bk:
                bk //= 2
        return bk

    se13, sn13, sk13, kind13 = _strides(fmt, s13)
    bk1 = block_k(cfg.gemm1, hidden, kind13)
    grid1 = (n_blocks, triton.cdiv(inter, cfg.gemm1.block_n))
    _moe_gemm1_kernel[grid1](
        x, ids, sorted_ids, block_expert, num_blocks,
        c13, s13, g13 if g13 is not None else s13, w13_bias if w13_bias is not None else x, a,
        pairs, inter, hidden, e, top_k,
        x.stride(0), c13.stride(0), c13.stride(1), se13, sn13, sk13,
        w13_bias.stride(0) if w13_bias is not None else 0, a.stride(0),
        float(alpha), float(limit),
        FMT=fcode, GROUP=group, SCALE_KIND=kind13, BLOCK_SN=bsn, BLOCK_SK=bsk,
        GATED=spec.gated, ACT=spec.code, HAS_BIAS=w13_bias is not None, DIRECT=cfg.direct,
        EVEN_K=hidden % bk1 == 0, DOT_F32=dot_f32, DEQ16=deq16, BF16=bf16,
        BM=bm, BN=cfg.gemm1.block_n, BK=bk1,
        num_warps=cfg.gemm1.num_warps, num_stages=cfg.gemm1.num_stages,
    )  # fmt: skip

    se2, sn2, sk2, kind2 = _strides(fmt, s2)
    bk2 = block_k(cfg.gemm2, inter, kind2)
    b2_arg = w2_bias if w2_bias is not None else x
    b2_stride = w2_bias.stride(0) if w2_bias is not None else 0
    y = empty((pairs, hidden), x.dtype, x.device)
    grid2 = (n_blocks, triton.cdiv(hidden, cfg.gemm2.block_n))
    _moe_gemm2_kernel[grid2](
        a, ids, sorted_ids, block_expert, num_blocks, tw,
        c2, s2, g2 if g2 is not None else s2, b2_arg, y,
        pairs, hidden, inter, e,
        a.stride(0), c2.stride(0), c2.stride(1), se2, sn2, sk2, b2_stride, y.stride(0),
        FMT=fcode, GROUP=group, SCALE_KIND=kind2, BLOCK_SN=bsn, BLOCK_SK=bsk,
        HAS_BIAS=w2_bias is not None, DIRECT=cfg.direct, EVEN_K=inter % bk2 == 0,
        DOT_F32=dot_f32, DEQ16=deq16, BF16=bf16, BM=bm, BN=cfg.gemm2.block_n, BK=bk2,
        num_warps=cfg.gemm2.num_warps, num_stages=cfg.gemm2.num_stages,
    )  # fmt: skip

    _reduce(y, ids, out, e)
    return out


def _reduce(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, experts: int) -> None:
    """out[t] = the sum of token t's valid slot rows of y (step 4)."""
    m, hidden = out.shape
    top_k = ids.shape[1]
    bnr = min(1024, triton.next_power_of_2(hidden))
    _moe_reduce_kernel[(m, triton.cdiv(hidden, bnr))](
        y, ids, out, hidden, experts, top_k, y.stride(0), out.stride(0),
        TOPK_P=triton.next_power_of_2(max(top_k, 2)), BN=bnr, num_warps=4,
    )  # fmt: skip


@triton.jit
def _act_rows_kernel(h_ptr, a_ptr, e_ptr, bias_ptr, inter, stride_h, stride_a, stride_be,
                     alpha, limit, ACT: tl.constexpr, GATED: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """a[row] = act(h[row, :inter] (+ bias), h[row, inter:] (+ bias)) in fp32, stored 16-bit (the
    dequantize path's activation: one pass over the first GEMM's output)."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = n < inter
    g = tl.load(h_ptr + row * stride_h + n, mask=ok, other=0.0).to(tl.float32)
    u = g
    if GATED:
        u = tl.load(h_ptr + row * stride_h + inter + n, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = bias_ptr + tl.load(e_ptr + row).to(tl.int64) * stride_be
        g += tl.load(b + n, mask=ok, other=0.0)
        if GATED:
            u += tl.load(b + inter + n, mask=ok, other=0.0)
    a = _activation(g, u, alpha, limit, ACT)
    tl.store(a_ptr + row * stride_a + n, a.to(a_ptr.dtype.element_ty), mask=ok)


def _dequant_experts(
    fmt: str, codes: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """All experts of one stacked FP4 weight as 16-bit [E, N, K] (each value rounded once)."""
    from quantdispatch.kernels.checkpoint_layout.dequant import dequant_fp4_rows

    e, n, k = codes.shape[0], codes.shape[1], codes.shape[2] * 2
    out = empty((e, n, k), dtype, codes.device)
    for i in range(e):
        dequant_fp4_rows(
            codes[i],
            scales[i],
            gs[i] if gs is not None else None,
            out[i],
            scale_format="e4m3" if fmt == "nvfp4" else "e8m0",
        )
    return out


def _run_dequant(
    x: torch.Tensor,
    ids: torch.Tensor,
    tw: torch.Tensor,
    e: int,
    dequant13: Callable[[], torch.Tensor],
    dequant2: Callable[[], torch.Tensor],
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    act_code: int,
    gated: bool,
    alpha: float,
    limit: float,
    out: torch.Tensor,
) -> None:
    """Many tokens per expert: pairs sorted by expert (device-side, no host sync), each GEMM's
    experts dequantized to x.dtype and run as one torch._grouped_mm, activation and biases in
    fp32, routing weights applied and the slots summed in fp32. Pairs whose id this layer does
    not hold run through expert 0 with weight 0 (finite, so they add exactly 0).
    ``dequant13`` / ``dequant2`` return each GEMM's experts as x.dtype [E, N, K] (one layout's
    dequantizer; called one after the other so only one copy is alive)."""
    m, hidden = x.shape
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    key = torch.where(valid, flat, 0)
    weight = torch.where(valid, tw.reshape(-1), 0.0)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device)
    counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    sorted_expert = key[order]
    xs = x.index_select(0, order // top_k)
    w = dequant13()
    h = torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
    del w
    inter = h.shape[1] // 2 if gated else h.shape[1]
    a = empty((h.shape[0], inter), x.dtype, x.device)
    bn = min(1024, triton.next_power_of_2(inter))
    _act_rows_kernel[(h.shape[0], triton.cdiv(inter, bn))](
        h, a, sorted_expert, b13 if b13 is not None else h, inter, h.stride(0), a.stride(0),
        b13.stride(0) if b13 is not None else 0, float(alpha), float(limit),
        ACT=act_code, GATED=gated, HAS_BIAS=b13 is not None, BN=bn, num_warps=4,
    )  # fmt: skip
    del h
    w = dequant2()
    ys = torch._grouped_mm(a, w.transpose(1, 2), offs=offs).float()
    del w
    if b2 is not None:
        ys = ys + b2[sorted_expert]
    ys = ys * weight[order][:, None]
    y = torch.empty_like(ys)
    y[order] = ys
    out.copy_(y.view(m, top_k, hidden).sum(1))


def _run_mma(
    x: torch.Tensor,
    ids: torch.Tensor,
    tw: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    act_code: int,
    alpha: float,
    limit: float,
    cfg: MmaMoeConfig,
    out: torch.Tensor,
    inter: int,
) -> None:
    """Steps 1-4 with the mma.sync gate/up and down kernels of :mod:`.fp4_mma_ckpt`.
    ``inter`` (I) is passed, not read off w13: the checkpoint and the repacked layouts shape
    their code tensors differently."""
    from quantdispatch.kernels.checkpoint_layout.moe_mma import mma_moe_gemms

    m, hidden = x.shape
    top_k = ids.shape[1]
    pairs = m * top_k
    e = w13[0].shape[0]
    if x.stride(0) % 8 or x.data_ptr() % 16:  # 16-byte activation loads
        x = x.clone(memory_format=torch.contiguous_format)
    if cfg.direct:
        n_blocks = pairs
        a = empty((pairs, inter), x.dtype, x.device)
        sorted_ids = block_expert = num_blocks = ids  # unused by the direct kernels
    else:
        sorted_ids, block_expert, num_blocks = moe_align(ids, e, cfg.block_m)
        n_blocks = block_expert.shape[0]
        a = empty((n_blocks * cfg.block_m, inter), x.dtype, x.device)
    y = empty((pairs, hidden), x.dtype, x.device)
    mma_moe_gemms(
        x, ids, sorted_ids, block_expert, num_blocks, tw, n_blocks, w13, w2, b13, b2, a, y,
        top_k=top_k, act_code=act_code, alpha=alpha, limit=limit, cfg=cfg,
    )  # fmt: skip
    _reduce(y, ids, out, e)

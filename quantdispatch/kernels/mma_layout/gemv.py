"""NVFP4 / MXFP4 weight-only GEMM for small M on tensor cores, with the decode written in PTX.

Why this exists: the tl.dot kernels of :mod:`..checkpoint_layout.linear` spend ~6 instructions
per weight (static SASS count) on decode, layout moves and byte extraction, which makes them
instruction-issue bound well below the GPU's memory bandwidth (docs/design/mma-layout.md).
Here, on the repacked layout (:mod:`.layout`), each lane loads its ``mma.m16n8k16`` A fragments
for 64 K with one 16-byte load, turns every 32-bit word (8 codes) into the four 16-bit A
registers with 11 integer ops and one 16-bit FMA per two weights for the block scale
(:mod:`..common.ptx`), then runs ``mma.sync`` with the activations as the 8-column B operand.
Everything per lane is inline PTX inside a Triton program whose tensors hold exactly one element
per thread, so Triton only launches, loops and reduces across warps: the kernel needs nothing
but torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.configs import fit_mma_config, mma_base_config
from quantdispatch.kernels.common.launch import Launcher
from quantdispatch.kernels.common.ptx import decode_chunk, load_w, load_x, mma_step_tiles
from quantdispatch.kernels.mma_layout.layout import TILE_N, scale_pairs

__all__ = ["MmaGemv", "gemv_config", "mma_linear"]


@triton.jit
def _tile_sum(acc, R: tl.constexpr, NT: tl.constexpr, WK: tl.constexpr, WT: tl.constexpr):
    """[R, U, NT, WK * WT * 32] partial sums -> [R, NT, WT * 32] (chunks in flight, K split)."""
    return tl.sum(tl.reshape(tl.sum(acc, axis=1), (R, NT, WK, WT * 32)), axis=2)


@triton.jit(do_not_specialize=["M"])
def _mma_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_om,
    CHUNKS: tl.constexpr,
    NT: tl.constexpr,
    WT: tl.constexpr,
    WK: tl.constexpr,
    UNROLL: tl.constexpr,
    R: tl.constexpr,
    BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DEPTH: tl.constexpr = 1,
    SPC: tl.constexpr = 32,
):
    """One program = WT * R 16-row tiles x (8 * NT) tokens with WT * WK warps: warp (wt, wk)
    takes R consecutive tiles and every WK-th chunk from wk (a K split summed at the end). Its
    activation fragments are loaded once per chunk and used by all R tiles (at M >= 16 the
    activation loads, not the weights, fill L1: Nsight Compute, docs/design/mma-layout.md); the
    WT warps of one wk read the same activation bytes at about the same
    time, so those loads hit in L1. Each step a warp handles UNROLL chunks (wk + WK * i), and
    the weight loads of the step DEPTH steps ahead are issued before this step's math, so every
    warp keeps DEPTH * R * UNROLL * 576 bytes in flight (DEPTH = 2 costs another set of
    weight registers, for latency-bound calls with registers to spare).

    Tensor shapes (one element per thread along the last axis, 32 * WARPS): per-lane values
    [32W]; weights per tile and chunk [R, U, 32W]; activations per chunk and token tile
    [U, NT, 32W]; accumulators [R, U, NT, 32W].

    SPC: scale pairs per tile and chunk, 32 (NVFP4: one per lane) or 16 (MXFP4, group 32: lanes
    2i and 2i + 1 read the same pair, see :func:`.layout.repack_mx`)."""
    WARPS: tl.constexpr = WT * WK
    m0 = tl.program_id(0) * (8 * NT)
    idx = tl.arange(0, 32 * WARPS)
    lane = idx % 32
    warp = idx // 32
    tile = ((tl.program_id(1) * WT + warp % WT) * R).to(tl.int64)  # first tile of the warp
    wk = warp // WT
    g = lane // 4
    t = lane % 4
    # token rows of this lane's B fragments: past M they repeat row M - 1 (their output columns
    # are never stored, and a repeated row is the same cache line for the whole warp)
    tt = tl.arange(0, NT)[:, None]
    rows = tl.minimum(m0 + 8 * tt + g[None, :], M - 1).to(tl.int64)
    x_row = (x_ptr + rows * stride_xm + (16 * t)[None, :])[None, :, :]  # [1, NT, 32W]
    rr = tl.arange(0, R)[:, None, None]
    w_base = w_ptr + (tile[None, None, :] + rr) * (CHUNKS * 128) + (lane * 4)[None, None, :]
    s_lane = lane if SPC == 32 else lane // 2  # MXFP4: lanes 2i and 2i + 1 share scale pair i
    s_base = s_ptr + (tile[None, None, :] + rr) * (CHUNKS * SPC) + s_lane[None, None, :]
    cx = tl.arange(0, UNROLL)[:, None] * WK + wk[None, :]  # [U, 32W] chunk of each slot
    cw = cx[None, :, :]  # [1, U, 32W]
    STEP: tl.constexpr = WK * UNROLL
    acc0 = tl.zeros((R, UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc1 = tl.zeros((R, UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc2 = tl.zeros((R, UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    acc3 = tl.zeros((R, UNROLL, NT, 32 * WARPS), dtype=tl.float32)
    # EVEN (CHUNKS a multiple of STEP): no predicates; the prefetch past the end re-reads the
    # last chunk instead of reading out of bounds
    EVEN: tl.constexpr = CHUNKS % STEP == 0
    every_tile = rr >= 0  # [R, 1, 1]: broadcasts the chunk masks over the tiles
    q0, q1, q2, q3, u = load_w(
        w_base + cw * 128, s_base + cw * SPC, (cw < CHUNKS) & every_tile, EVEN
    )
    if DEPTH == 2:  # the second step's weights, in flight with the first's
        c1 = tl.minimum(cw + STEP, CHUNKS - 1) if EVEN else cw + STEP
        p0, p1, p2, p3, pu = load_w(
            w_base + c1 * 128, s_base + c1 * SPC, (c1 < CHUNKS) & every_tile, EVEN
        )
    for c0 in range(0, CHUNKS, STEP):
        c = c0 + cw
        nxt = tl.minimum(c + DEPTH * STEP, CHUNKS - 1) if EVEN else c + DEPTH * STEP
        n0, n1, n2, n3, nu = load_w(
            w_base + nxt * 128, s_base + nxt * SPC, (nxt < CHUNKS) & every_tile, EVEN
        )
        ok = (c0 + cx < CHUNKS)[:, None, :]
        x0, x1, x2, x3, x4, x5, x6, x7 = load_x(x_row + ((c0 + cx) * 64)[:, None, :], ok, EVEN)
        a = decode_chunk(q0, q1, q2, q3, u, BF16)
        acc0, acc1, acc2, acc3 = mma_step_tiles(acc0, acc1, acc2, acc3, a, 0, x0, x1, BF16)
        acc0, acc1, acc2, acc3 = mma_step_tiles(acc0, acc1, acc2, acc3, a, 1, x2, x3, BF16)
        acc0, acc1, acc2, acc3 = mma_step_tiles(acc0, acc1, acc2, acc3, a, 2, x4, x5, BF16)
        acc0, acc1, acc2, acc3 = mma_step_tiles(acc0, acc1, acc2, acc3, a, 3, x6, x7, BF16)
        if DEPTH == 2:
            q0, q1, q2, q3, u = p0, p1, p2, p3, pu
            p0, p1, p2, p3, pu = n0, n1, n2, n3, nu
        else:
            q0, q1, q2, q3, u = n0, n1, n2, n3, nu
    r0 = _tile_sum(acc0, R, NT, WK, WT)
    r1 = _tile_sum(acc1, R, NT, WK, WT)
    r2 = _tile_sum(acc2, R, NT, WK, WT)
    r3 = _tile_sum(acc3, R, NT, WK, WT)
    lt = tl.arange(0, WT * 32)[None, None, :]  # (warp within the program, lane)
    l32 = lt % 32
    tok = m0 + 8 * tl.arange(0, NT)[None, :, None] + 2 * (l32 % 4)  # [1, NT, WT * 32]
    n_lo = ((tl.program_id(1) * WT + lt // 32) * R + rr) * 16 + l32 // 4  # [R, 1, WT * 32]
    factor = tl.load(gs_ptr) * 256.0
    _store_out(out_ptr, bias_ptr, r0, tok, n_lo, M, stride_om, factor, HAS_BIAS)
    _store_out(out_ptr, bias_ptr, r1, tok + 1, n_lo, M, stride_om, factor, HAS_BIAS)
    _store_out(out_ptr, bias_ptr, r2, tok, n_lo + 8, M, stride_om, factor, HAS_BIAS)
    _store_out(out_ptr, bias_ptr, r3, tok + 1, n_lo + 8, M, stride_om, factor, HAS_BIAS)


@triton.jit
def _store_out(out_ptr, bias_ptr, acc, tok, n, M, stride_om, factor, HAS_BIAS: tl.constexpr):
    y = acc * factor
    if HAS_BIAS:
        y += tl.load(bias_ptr + n)
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_om + n, y.to(out_ptr.dtype.element_ty), mask=tok < M
    )


def gemv_config(tiles: int, chunks: int, m: int) -> tuple[int, int, int, int, int, int]:
    """(NT, WT, WK, UNROLL, R, DEPTH) for a call: :func:`..common.configs.mma_base_config`, except
    that from 9 tokens on, weights that are not wide keep two steps of weight loads in flight (DEPTH
    2) in narrower programs. At those M the kernel waits on memory (Nsight Compute: few eligible
    warps per scheduler, long-scoreboard the top stall, fewer programs than two per SM). Faster on
    the H200 for qkv, o and down at M = 16..32 (benchmarks/results/mma-sweep-h200-*-depth logs,
    docs/design/mma-layout.md); not at M <= 8 (no gain) nor for fused gate_up weights (slower)."""
    nt, wt, wk, unroll, r = mma_base_config(tiles, chunks, m)
    if tiles < 1024 and nt in (2, 4):
        if nt == 2:
            long_k = chunks >= 128
            wt, wk, unroll = (1, 4, 2) if tiles >= 384 else ((1, 8, 2) if long_k else (1, 4, 4))
        else:
            wt, wk, unroll = (1, 4, 4) if chunks >= 128 else (1, 2, 4)
        return (nt, *fit_mma_config(tiles, chunks, wt, wk, 1, unroll), 2)
    return nt, wt, wk, unroll, r, 1


class MmaGemv:
    """:func:`mma_linear` with the weight bound (the bound call path): per call only the
    output, the launch config for M (made once per M) and the launch."""

    def __init__(
        self,
        words: torch.Tensor,
        scales: torch.Tensor,
        global_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        config: tuple[int, ...] | None = None,
    ) -> None:
        self.tiles, self.chunks = words.shape[0], words.shape[1]
        self.n = self.tiles * TILE_N
        self._config = config
        self._fixed = dict(
            w_ptr=words,
            s_ptr=scales.view(torch.int16),
            gs_ptr=global_scale,
            bias_ptr=bias if bias is not None else global_scale,
            N=self.n,
            CHUNKS=self.chunks,
            HAS_BIAS=bias is not None,
            SPC=scale_pairs(scales),
        )
        self._launchers: dict[tuple[object, ...], Launcher] = {}
        self._plans: dict[tuple[int, bool], tuple[Launcher, int, int]] = {}

    def _plan(self, m: int, bf16: bool) -> tuple[Launcher, int, int]:
        nt, wt, wk, unroll, r, depth = (
            *(self._config or gemv_config(self.tiles, self.chunks, m)), 1, 1
        )[:6]
        if depth not in (1, 2):
            raise ValueError(
                f"DEPTH={depth}: the weight prefetch depth is 1 or 2 steps; pass 1 or 2 as the "
                f"config's sixth entry"
            )
        if self.tiles % (wt * r):
            raise ValueError(f"WT={wt} x R={r} does not divide the {self.tiles} tiles")
        key = (nt, wt, wk, unroll, r, depth, bf16)
        launcher = self._launchers.get(key)
        if launcher is None:
            launcher = Launcher(
                _mma_gemv_kernel,
                ("x_ptr", "out_ptr", "M", "stride_xm", "stride_om"),
                dict(self._fixed, NT=nt, WT=wt, WK=wk, UNROLL=unroll, R=r, BF16=bf16, DEPTH=depth),
                dict(num_warps=wt * wk, num_stages=1),
            )
            self._launchers[key] = launcher
        plan = (launcher, 8 * nt, self.tiles // (wt * r))
        self._plans[(m, bf16)] = plan
        return plan

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        out = torch.empty((m, self.n), dtype=x.dtype, device=x.device)
        if m == 0:
            return out
        if x.stride(0) % 8 or x.data_ptr() % 16 or x.stride(1) != 1:  # 16-byte loads of x rows
            x = x.clone(memory_format=torch.contiguous_format)
        bf16 = x.dtype == torch.bfloat16
        plan = self._plans.get((m, bf16))
        if plan is None:
            plan = self._plan(m, bf16)
        launcher, rows, programs = plan
        launcher(((m + rows - 1) // rows, programs), x, out, m, x.stride(0), out.stride(0))
        return out


def mma_linear(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a weight in the mma layout; x [M, K] fp16/bf16, out [M, N].

    Any M works (programs of up to 64 tokens side by side; the weight tile stays in L2 for
    the programs that share it), but it is meant for small M: the backend sends large M to
    dequantize + cuBLAS. ``config`` = (NT, WT, WK, UNROLL[, R[, DEPTH]]) overrides the
    heuristic (tuning); WT * R must divide N/16. A layer binds :class:`MmaGemv` once instead."""
    return MmaGemv(words, scales, global_scale, bias, config=config)(x)

"""NVFP4 MoE for single (token, slot) pairs in two launches: the top-k sum inside the down kernel.

Why: with a handful of tokens (decode) a MoE layer streams the experts its tokens picked once,
and each dependent launch costs time of its own: on the H200 a kernel that only *reads*
Qwen3-30B-A3B's M=1 bytes as three dependent launches (gate/up, down, top-k sum) stays far from
the streaming floor (benchmarks/results/stream-small-h200-*.md). This module drops the third
launch:

* gate/up programs, one per (pair, 16-row tile of I): the mma.sync gate and up tiles of
  :mod:`..common.moe_mma` (REPACKED mode) on the pair's token, K split over the warps,
  activation fused, 16 intermediate values stored to a small scratch ``a`` [pairs, I];
* down programs, one per (token, 16-row tile of H): each warp takes one of the token's slots
  (a fixed expert, so its loads stream like the per-pair kernel's), ``min(top_k, warps)``
  slots at a time and ``warps // that`` warps per slot splitting the chunks; each slot's sum
  is scaled by its routing weight x global scale, and the cross-warp sum at the end *is* the
  top-k sum: no per-pair output, no third launch, a fixed order (deterministic, bit for bit).

On SM 9.0+ the down kernel is a programmatic dependent launch (:mod:`..common.pdl`): gate/up
programs
(an ordinary launch: every earlier kernel is complete when they start) release it at once, its
programs start next to them, load their first weight chunks (on long loops prefetch more into
L2), and only then wait for the intermediate (``griddepcontrol.wait``: gate/up complete, its
writes visible).

Faster on the H200 than the per-pair kernels + sum; wide programs matter where the grids are
small (:func:`.moe_plan.small_moe_config`). Tried and dropped: both kernels in one cooperative
launch with a grid barrier between them (persistent programs): one warp count for both, fewer
warps in flight; the two launches beat every setting of it (docs/design/moe.md).
Experts in the mma16x64 layout of :mod:`.layout` (:func:`.moe_stacks.repack_experts`);
PTX, so GPU only (SM 8.0+).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.activation import apply_activation
from quantdispatch.kernels.common.launch import Launcher
from quantdispatch.kernels.common.moe_stages import ExpertWeights, MoeExperts, MoeInputs, MoeWork
from quantdispatch.kernels.common.pdl import gdc_launch_dependents, gdc_wait
from quantdispatch.kernels.common.ptx import chunk_mma, k_reduce, load_w, load_x
from quantdispatch.kernels.mma_layout.moe_plan import SmallMoeConfig, small_units

__all__ = ["SmallMoe", "SmallMoeExperts"]


# --------------------------------------------------------------------------------------------
# PTX helpers


# The intermediate comes from the gate/up launch (a few KB, read by every down program): loaded
# with .cg, cached in L2 only. Measured as is; the read-only (.nc) path was not tried.
_LOAD_A_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $8, 0;\n"
    "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n"
    "mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;\n"
    "@p ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$9];\n"
    "@p ld.global.cg.v4.b32 {$4, $5, $6, $7}, [$9+16]; }"
)


@triton.jit
def _load_a(a_ptrs, ok):
    """A lane's B fragments for one chunk of the intermediate: 32 bytes of one row (L2)."""
    return tl.inline_asm_elementwise(
        _LOAD_A_ASM,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,l",
        [ok.to(tl.int32), a_ptrs],
        dtype=(tl.int32,) * 8,
        is_pure=True,
        pack=1,
    )


# Start copying ``$3`` bytes at ``$2`` (16-byte aligned, a multiple of 16) into L2; one
# instruction per range, nothing waits for it (SM 9.0+).
_PREFETCH_ASM = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $1, 0;\n"
    "@p cp.async.bulk.prefetch.L2.global [$2], $3;\n"
    "mov.b32 $0, 0; }"
)


@triton.jit
def _prefetch_l2(ptrs, nbytes, ok):
    """Prefetch ``nbytes`` from each pointer whose ``ok`` is set into L2."""
    return tl.inline_asm_elementwise(
        _PREFETCH_ASM,
        "=r,r,l,r",
        [ok.to(tl.int32), ptrs, tl.full(ok.shape, nbytes, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# --------------------------------------------------------------------------------------------
# the two units


@triton.jit
def _gate_up_unit(
    u, x_ptr, ids_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, a_ptr, E,
    stride_xm, stride_we, stride_se, stride_be, stride_am, alpha, limit, lane, warp,
    TOP_K: tl.constexpr, CH: tl.constexpr, TILES: tl.constexpr, W: tl.constexpr,
    U: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BF16: tl.constexpr,
    SPC: tl.constexpr,
):  # fmt: skip
    """Gate and up tile ``u % TILES`` of pair ``u // TILES`` over all H (K split over the
    warps), activation, 16 intermediate values stored. A foreign expert stores nothing (the
    down kernel never reads its row)."""
    p = u // TILES
    tile = u % TILES
    e = tl.load(ids_ptr + p).to(tl.int32)
    if (e >= 0) & (e < E):
        e64 = e.to(tl.int64)
        t = lane % 4
        x_row = (x_ptr + (p // TOP_K).to(tl.int64) * stride_xm + 16 * t)[None, None, :]
        tile64 = tile.to(tl.int64) * CH
        w_base = (w_ptr + e64 * stride_we + tile64 * 128 + 4 * lane)[None, :]
        s_lane = lane if SPC == 32 else lane // 2  # MXFP4: lane pairs share a scale pair
        s_base = (s_ptr + e64 * stride_se + tile64 * SPC + s_lane)[None, :]
        UP_W: tl.constexpr = TILES * CH * 128  # the up tiles follow the gate tiles
        UP_S: tl.constexpr = TILES * CH * SPC
        chunk0 = tl.arange(0, U)[:, None] * W + warp[None, :]  # [U, 32W]
        STEP: tl.constexpr = W * U
        EVEN: tl.constexpr = CH % STEP == 0
        acc0 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        acc1 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        acc2 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        acc3 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        v0 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        v1 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        v2 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        v3 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        ok0 = chunk0 < CH
        q = load_w(w_base + chunk0 * 128, s_base + chunk0 * SPC, ok0, EVEN)
        qu = load_w(w_base + UP_W + chunk0 * 128, s_base + UP_S + chunk0 * SPC, ok0, EVEN)
        for c0 in range(0, CH, STEP):
            c = c0 + chunk0
            nxt = tl.minimum(c + STEP, CH - 1) if EVEN else c + STEP
            okn = nxt < CH
            qn = load_w(w_base + nxt * 128, s_base + nxt * SPC, okn, EVEN)
            qun = load_w(w_base + UP_W + nxt * 128, s_base + UP_S + nxt * SPC, okn, EVEN)
            xs = load_x(x_row + (c * 64)[:, None, :], (c < CH)[:, None, :], EVEN)
            acc0, acc1, acc2, acc3 = chunk_mma(acc0, acc1, acc2, acc3, q, xs, BF16, True)
            v0, v1, v2, v3 = chunk_mma(v0, v1, v2, v3, qu, xs, BF16, True)
            q = qn
            qu = qun
        # column 0 of the MMA output is the token (lanes t == 0): rows g (acc0) and g + 8 (acc2)
        factor = tl.load(gs_ptr + e64) * 256.0
        g_lo = k_reduce(acc0, 1, W, 1) * factor
        g_hi = k_reduce(acc2, 1, W, 1) * factor
        u_lo = k_reduce(v0, 1, W, 1) * factor
        u_hi = k_reduce(v2, 1, W, 1) * factor
        lo = tl.arange(0, 32)[None, :]
        n = tile * 16 + lo // 4
        keep = lo % 4 == 0
        if HAS_BIAS:
            g_lo += tl.load(b_ptr + e64 * stride_be + n)
            g_hi += tl.load(b_ptr + e64 * stride_be + n + 8)
            u_lo += tl.load(b_ptr + e64 * stride_be + TILES * 16 + n)
            u_hi += tl.load(b_ptr + e64 * stride_be + TILES * 16 + n + 8)
        row = a_ptr + p.to(tl.int64) * stride_am + n
        h_lo = apply_activation(g_lo, u_lo, alpha, limit, ACT)
        h_hi = apply_activation(g_hi, u_hi, alpha, limit, ACT)
        tl.store(row, h_lo.to(a_ptr.dtype.element_ty), mask=keep)
        tl.store(row + 8, h_hi.to(a_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _down_unit(
    v, a_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, out_ptr, E,
    stride_am, stride_we, stride_se, stride_be, stride_om, lane, warp,
    TOP_K: tl.constexpr, CH: tl.constexpr, TILES: tl.constexpr, W: tl.constexpr,
    U: tl.constexpr, HAS_BIAS: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr,
    PF: tl.constexpr, SPC: tl.constexpr,
):  # fmt: skip
    """Output tile ``v % TILES`` of token ``v // TILES``: the sum over the token's slots of
    routing weight x down(expert, intermediate row). The warps take min(TOP_K, W) slots at a
    time (a fixed expert per warp and pass, its chunks split over W // that many warps); the
    cross-warp sum at the end is the top-k sum, in a fixed order. PDL (a programmatic dependent
    launch): the first PF chunks of every slot's weights go to L2 and the first chunks to
    registers before the wait for the gate/up launch; routing ids and weights predate it."""
    m = v // TILES
    tile = v % TILES
    t = lane % 4
    SPP: tl.constexpr = TOP_K if TOP_K < W else W  # slots per pass
    WS: tl.constexpr = W // SPP  # warps per slot
    PASSES: tl.constexpr = (TOP_K + SPP - 1) // SPP
    STEP: tl.constexpr = WS * U
    active = warp < SPP * WS
    chunk0 = tl.arange(0, U)[:, None] * WS + (warp // SPP)[None, :]  # [U, 32W]
    tile64 = tile.to(tl.int64) * CH
    sum_lo = tl.zeros((U, 1, 32 * W), dtype=tl.float32)  # rows g (acc0) of the token column
    sum_hi = tl.zeros((U, 1, 32 * W), dtype=tl.float32)  # rows g + 8 (acc2)
    if PDL and PF > 0:  # one lane per slot: its PF leading chunks of codes and scales
        for ps in tl.static_range(PASSES):
            slot = ps * SPP + warp
            mine = (lane == 0) & (warp < SPP) & (slot < TOP_K)
            e = tl.load(ids_ptr + m * TOP_K + slot, mask=mine, other=-1).to(tl.int32)
            mine = mine & (e >= 0) & (e < E)
            e64 = tl.where(mine, e, 0).to(tl.int64)
            _prefetch_l2(w_ptr + e64 * stride_we + tile64 * 128, PF * 512, mine)
            _prefetch_l2(s_ptr + e64 * stride_se + tile64 * SPC, PF * 2 * SPC, mine)
    for ps in tl.static_range(PASSES):
        slot = ps * SPP + warp % SPP
        pair = m * TOP_K + slot
        ok_s = active & (slot < TOP_K)
        e = tl.load(ids_ptr + pair, mask=ok_s, other=-1).to(tl.int32)
        ok_s = ok_s & (e >= 0) & (e < E)
        e64 = tl.where(ok_s, e, 0).to(tl.int64)
        f = tl.load(tw_ptr + pair, mask=ok_s, other=0.0) * tl.load(gs_ptr + e64, mask=ok_s,
                                                                   other=0.0)  # fmt: skip
        w_base = (w_ptr + e64 * stride_we + tile64 * 128 + 4 * lane)[None, :]
        s_lane = lane if SPC == 32 else lane // 2  # MXFP4: lane pairs share a scale pair
        s_base = (s_ptr + e64 * stride_se + tile64 * SPC + s_lane)[None, :]
        a_row = (a_ptr + pair.to(tl.int64) * stride_am + 16 * t)[None, None, :]
        ok_s2 = ok_s[None, :]
        acc0 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        acc1 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        acc2 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        acc3 = tl.zeros((U, 1, 32 * W), dtype=tl.float32)
        q = load_w(w_base + chunk0 * 128, s_base + chunk0 * SPC, (chunk0 < CH) & ok_s2, False)
        if PDL and ps == 0:
            gdc_wait()  # the gate/up launch is complete and its intermediate visible
        for c0 in range(0, CH, STEP):
            c = c0 + chunk0
            nxt = c + STEP
            qn = load_w(w_base + nxt * 128, s_base + nxt * SPC, (nxt < CH) & ok_s2, False)
            ok = (c < CH) & ok_s2
            xs = _load_a(a_row + (c * 64)[:, None, :], ok[:, None, :])
            acc0, acc1, acc2, acc3 = chunk_mma(acc0, acc1, acc2, acc3, q, xs, BF16, True)
            q = qn
        sum_lo += acc0 * f[None, None, :]
        sum_hi += acc2 * f[None, None, :]
    lo = tl.arange(0, 32)[None, :]
    n = tile * 16 + lo // 4
    keep = lo % 4 == 0
    y_lo = k_reduce(sum_lo, 1, W, 1) * 256.0
    y_hi = k_reduce(sum_hi, 1, W, 1) * 256.0
    if HAS_BIAS:
        for s in tl.static_range(TOP_K):
            es = tl.load(ids_ptr + m * TOP_K + s).to(tl.int32)
            valid = (es >= 0) & (es < E)
            ws = tl.where(valid, tl.load(tw_ptr + m * TOP_K + s), 0.0)
            es64 = tl.where(valid, es, 0).to(tl.int64)
            y_lo += ws * tl.load(b_ptr + es64 * stride_be + n)
            y_hi += ws * tl.load(b_ptr + es64 * stride_be + n + 8)
    row = out_ptr + m.to(tl.int64) * stride_om + n
    tl.store(row, y_lo.to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(row + 8, y_hi.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _small_moe_kernel(
    x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, gs13_ptr, b13_ptr,
    w2_ptr, s2_ptr, gs2_ptr, b2_ptr, a_ptr, out_ptr, E,
    stride_xm, stride_w13, stride_s13, stride_b13, stride_w2, stride_s2, stride_b2,
    stride_am, stride_om, alpha, limit,
    TOP_K: tl.constexpr, CH1: tl.constexpr, TILES1: tl.constexpr, CH2: tl.constexpr,
    TILES2: tl.constexpr, W: tl.constexpr, U: tl.constexpr, ACT: tl.constexpr,
    HAS_B13: tl.constexpr, HAS_B2: tl.constexpr, BF16: tl.constexpr, GATE_UP: tl.constexpr,
    PDL: tl.constexpr, PF: tl.constexpr, SPC: tl.constexpr = 32,
):  # fmt: skip
    """One unit per program: GATE_UP (pair, I tile) or down (token, H tile). PDL: gate/up
    programs let the down launch start at once (it waits for their completion itself; gate/up
    itself is an ordinary launch, so everything the down programs load before that wait was
    complete before gate/up started)."""
    idx = tl.arange(0, 32 * W)
    lane = idx % 32
    warp = idx // 32
    if GATE_UP:
        if PDL:
            gdc_launch_dependents()
        _gate_up_unit(
            tl.program_id(0), x_ptr, ids_ptr, w13_ptr, s13_ptr, gs13_ptr, b13_ptr, a_ptr, E,
            stride_xm, stride_w13, stride_s13, stride_b13, stride_am, alpha, limit,
            lane, warp, TOP_K, CH1, TILES1, W, U, ACT, HAS_B13, BF16, SPC,
        )  # fmt: skip
    else:
        _down_unit(
            tl.program_id(0), a_ptr, ids_ptr, tw_ptr, w2_ptr, s2_ptr, gs2_ptr, b2_ptr, out_ptr,
            E, stride_am, stride_w2, stride_s2, stride_b2, stride_om, lane, warp,
            TOP_K, CH2, TILES2, W, U, HAS_B2, BF16, PDL, PF, SPC,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# host side


class SmallMoe:
    """The single-pair kernels over one layer's repacked stacks with its launches bound once per
    config and dtype (the bound MoE path): a call allocates the intermediate and launches the
    gate/up and down kernels with the per-call tensors only."""

    def __init__(
        self,
        w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        b13: torch.Tensor | None,
        b2: torch.Tensor | None,
        act_code: int,
        alpha: float,
        limit: float,
        inter: int,
        top_k: int,
    ) -> None:
        c13, s13, g13 = w13
        c2, s2, g2 = w2
        s13, s2 = s13.view(torch.int16), s2.view(torch.int16)  # scale pairs
        self.inter, self.hidden, self.top_k = inter, c2.shape[1] * 16, top_k
        self._fixed = dict(
            w13_ptr=c13, s13_ptr=s13, gs13_ptr=g13, b13_ptr=b13 if b13 is not None else g13,
            w2_ptr=c2, s2_ptr=s2, gs2_ptr=g2, b2_ptr=b2 if b2 is not None else g2,
            E=c13.shape[0], stride_w13=c13.stride(0), stride_s13=s13.stride(0),
            stride_b13=b13.stride(0) if b13 is not None else 0, stride_w2=c2.stride(0),
            stride_s2=s2.stride(0), stride_b2=b2.stride(0) if b2 is not None else 0,
            alpha=float(alpha), limit=float(limit), TOP_K=top_k, CH1=self.hidden // 64,
            TILES1=inter // 16, CH2=inter // 64, TILES2=self.hidden // 16, ACT=act_code,
            HAS_B13=b13 is not None, HAS_B2=b2 is not None, SPC=s13.shape[3],
        )  # fmt: skip
        self._launchers: dict[tuple[SmallMoeConfig, bool], tuple[Launcher, Launcher]] = {}

    def _pair(self, cfg: SmallMoeConfig, bf16: bool) -> tuple[Launcher, Launcher]:
        pf = min(cfg.prefetch, self.inter // 64) if cfg.pdl else 0
        fixed = dict(self._fixed, BF16=bf16, PDL=cfg.pdl)
        up = Launcher(
            _small_moe_kernel, _SMALL_VARYING,
            dict(fixed, W=cfg.warps, U=cfg.unroll, GATE_UP=True, PF=0),
            dict(num_warps=cfg.warps, num_stages=1),
        )  # fmt: skip
        down = Launcher(
            _small_moe_kernel, _SMALL_VARYING,
            dict(fixed, W=cfg.warps_down, U=cfg.unroll_down, GATE_UP=False, PF=pf),
            dict(num_warps=cfg.warps_down, num_stages=1,
                 **({"launch_pdl": True} if cfg.pdl else {})),
        )  # fmt: skip
        pair = self._launchers[(cfg, bf16)] = (up, down)
        return pair

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, cfg: SmallMoeConfig,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        m = x.shape[0]
        if x.stride(0) % 8 or x.data_ptr() % 16:  # 16-byte activation loads
            x = x.clone(memory_format=torch.contiguous_format)
        a = checks.empty((m * self.top_k, self.inter), x.dtype, x.device)  # the intermediate
        bf16 = x.dtype == torch.bfloat16
        up, down = self._launchers.get((cfg, bf16)) or self._pair(cfg, bf16)
        units1, units2 = small_units(m, self.top_k, self.inter, self.hidden)
        args = (x, ids, tw, a, out, x.stride(0), a.stride(0), out.stride(0))
        up((units1,), *args)
        down((units2,), *args)


_SMALL_VARYING = ("x_ptr", "ids_ptr", "tw_ptr", "a_ptr", "out_ptr", "stride_xm", "stride_am",
                  "stride_om")  # fmt: skip


class SmallMoeExperts(MoeExperts):
    """The single-pair kernels as the experts stage of :mod:`..common.moe_stages`: they read
    ``topk_ids`` themselves and the down kernel sums the slots into ``out`` (no align, no
    reduce stage). Its launches are bound per call; a layer binds :class:`SmallMoe` once
    instead (:class:`.moe_bound.MmaLayoutMoe`)."""

    whole_call = True

    def __init__(self, weights: ExpertWeights, cfg: SmallMoeConfig, inter: int) -> None:
        self.weights, self.cfg, self.inter = weights, cfg, inter

    def apply(self, inp: MoeInputs, work: MoeWork) -> None:
        (w13, w2, b13, b2), act = self.weights, inp.act
        small = SmallMoe(w13, w2, b13, b2, act.code, act.alpha, act.limit, self.inter, inp.top_k)
        small(inp.x, inp.ids, inp.tw, self.cfg, work.out)

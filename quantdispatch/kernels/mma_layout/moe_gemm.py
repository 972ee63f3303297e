"""NVFP4 and MXFP4 MoE experts in the ``mma16x64`` layout: every regime on one repacked copy.

Why: the MoE kernels on the checkpoint layout (:mod:`..common.moe_mma`,
:mod:`..checkpoint_layout.moe`) decode each weight with more instructions than the repacked
linear kernels (15 vs 11 integer ops per 8 codes, activation permutes, byte-wise scales), and at
few tokens per expert they are issue bound, so the same mma.sync design streams faster from the
repacked layout (docs/design/moe.md). With the tl.dot GEMM that decodes the repacked layout
(:mod:`.gemm`) every regime can read the repacked copy, and it holds the same bytes (no second
copy). The regime is chosen in :mod:`.moe_plan`:

* single (token, slot) pairs (4 x pairs <= E: decode): the mma.sync gate/up tiles of
  :mod:`..common.moe_mma` and a down kernel that also sums the top-k slots
  (:mod:`.moe_pairs`: two launches instead of three);
* few tokens per expert: the mma.sync gate/up + down kernels of
  :mod:`..common.moe_mma` in their REPACKED mode (gate and up tiles of a warp share
  the activation fragments, activation fused) on 8-pair blocks;
* mid: a grouped GEMM (:func:`_moe_gemm_kernel`): expert-sorted blocks of ``block_m`` pairs
  (:func:`..common.moe_align.moe_align`) times 64-row weight tiles, the weight decoded
  into the wgmma A operand as in :mod:`.gemm` (swap AB: weight rows x tokens). Gate/up programs run
  the gate tile and the up tile on the same activation tile (one shared-memory tile feeds both dots)
  and fuse the activation; they write the intermediate with its columns already in the MMA K order,
  so the down GEMM reads it as is (the tokens' own activations are permuted once per call,
  :func:`.activation_order.kappa_order`);
* very many (SM 9.0+ with ``torch._grouped_mm``): each GEMM's experts dequantized to 16-bit
  by the layout's own dequant kernel, then ``torch._grouped_mm`` (as for the checkpoint layout).

Stacked tensors: ``words`` int32 [E, N/16, K/64, 32, 4], ``scales`` uint8 [E, N/16, K/64, 32, 2]
(:func:`.moe_stacks.repack_experts`; N = 2I for w13, gate tiles then up tiles), ``global_scale``
fp32 [E]. MXFP4 (:func:`.moe_stacks.repack_experts_mx`): scales [E, N/16, K/64, 16, 2], one pair
per group of 32 read by two lanes, and each expert's scales relative to its own largest (its
global scale).
The layout places codes for one 16-bit activation dtype (bf16 or fp16), fixed at repack.

Every regime runs the stages of :mod:`..common.moe_stages`; :func:`mma_layout_moe` checks the
stacks, asks the plan and picks the experts (the grouped GEMM's are :class:`GroupedGemmExperts`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from quantdispatch.errors import InputError
from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.activation import apply_activation
from quantdispatch.kernels.common.checks import interpreting
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.common.moe_activations import ActivationArgs, activation_args
from quantdispatch.kernels.common.moe_dequant import DequantExperts
from quantdispatch.kernels.common.moe_mma import MmaExperts
from quantdispatch.kernels.common.moe_plan import DequantMoeConfig, MmaMoeConfig, grouped_mm_capable
from quantdispatch.kernels.common.moe_stages import (
    ExpertWeights,
    MoeExperts,
    MoeInputs,
    MoeWork,
    prepare_inputs,
    run_stages,
)
from quantdispatch.kernels.common.wgmma_guard import settle
from quantdispatch.kernels.mma_layout.activation_order import kappa_order
from quantdispatch.kernels.mma_layout.layout import TILE_N
from quantdispatch.kernels.mma_layout.moe_pairs import SmallMoeExperts
from quantdispatch.kernels.mma_layout.moe_plan import (
    MoeGemmTile,
    SmallMoeConfig,
    mma_layout_moe_plan,
)
from quantdispatch.kernels.mma_layout.moe_stacks import check_stack, dequant_experts, fail
from quantdispatch.kernels.mma_layout.tile_decode import weight_tile

__all__ = ["GroupedGemmExperts", "checked_stacks", "gated_activation", "mma_layout_moe"]


def _tile_warps(tile: MoeGemmTile, block_n: int) -> int:
    """Warps for one GEMM of ``tile`` run ``block_n`` rows wide: the tile's warps scale with
    the rows when a GEMM whose N the tile's width does not divide falls back to 64-row tiles
    (8 warps on 64 rows would split the tokens between two warpgroups that decode the same
    weights, which was much slower for gpt-oss-20b, N = 2880: docs/design/moe.md)."""
    return max(4, tile.warps * block_n // tile.block_n)


@triton.jit
def _tile_pointers(w_ptr, s_ptr, e64, stride_we, stride_se, tile0,
                   CHUNKS: tl.constexpr, BT: tl.constexpr, CK: tl.constexpr,
                   SPC: tl.constexpr):  # fmt: skip
    """Word and scale pointers of BT 16-row tiles from ``tile0`` of expert e, first K step
    (SPC 16, MXFP4: int32 pointers to both scale pairs of a row group, as in
    :func:`.gemm._mma_gemm_kernel`)."""
    t = tl.arange(0, BT)[:, None, None, None, None]
    c = tl.arange(0, CK)[None, :, None, None, None]
    g = tl.arange(0, 8)[None, None, :, None, None]
    q = tl.arange(0, 4)[None, None, None, :, None]  # t of the layout: the lane in its quad
    j = tl.arange(0, 4)[None, None, None, None, :]
    base = (tile0 + t).to(tl.int64) * CHUNKS + c
    w_ptrs = w_ptr + e64 * stride_we + base * 128 + g * 16 + q * 4 + j
    if SPC == 32:
        s_ptrs = s_ptr + e64 * stride_se + base * 32 + g * 4 + q
    else:
        s32 = s_ptr.to(tl.pointer_type(tl.int32))
        s_ptrs = s32 + e64 * (stride_se // 2) + base * (SPC // 2) + g
    return w_ptrs, s_ptrs


@triton.jit(do_not_specialize=["T"])
def _moe_gemm_kernel(
    x_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, tw_ptr,
    w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr,
    T, top_k, n_blocks, up_tiles,
    stride_xm, stride_we, stride_se, stride_be, stride_om,
    alpha, limit,
    CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, CK: tl.constexpr,
    GATE_UP: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BF16: tl.constexpr,
    DOT_F32: tl.constexpr, SETTLE: tl.constexpr, SPC: tl.constexpr = 32,
):  # fmt: skip
    """One [BLOCK_N weight rows, BLOCK_M pairs] tile of one expert-sorted block.

    Program ids run the blocks fastest, so the blocks of one expert (adjacent after the
    alignment) read the same weight tile back to back (from L2 after the first). GATE_UP: x
    rows are tokens (``pair // top_k``) of the K-ordered x, the gate tile (rows from
    ``pid_n * BLOCK_N``) and the up tile (``up_tiles`` 16-row tiles further) share each
    activation tile, and the activation is stored to row ``b * BLOCK_M + slot`` of the
    intermediate at the MMA K-order column of each output column. Down: x rows are those
    intermediate rows; out row = pair, times the pair's routing weight. SETTLE: read the
    accumulators in every step (:func:`..common.wgmma_guard.settle`; the Triton < 3.7 wgmma bug)."""
    pid = tl.program_id(0)
    b = pid % n_blocks
    pid_n = pid // n_blocks
    if b >= tl.load(nvalid_ptr):
        return
    e64 = tl.load(bexp_ptr + b).to(tl.int64)
    BT: tl.constexpr = BLOCK_N // 16
    BK: tl.constexpr = 64 * CK
    EVEN: tl.constexpr = CHUNKS % CK == 0
    K: tl.constexpr = CHUNKS * 64
    slot = tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + b * BLOCK_M + slot)
    m_ok = pair < T
    x_row = tl.where(m_ok, pair // top_k, 0) if GATE_UP else b * BLOCK_M + slot
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + x_row.to(tl.int64)[:, None] * stride_xm + k[None, :]
    w_ptrs, s_ptrs = _tile_pointers(w_ptr, s_ptr, e64, stride_we, stride_se, pid_n * BT,
                                    CHUNKS, BT, CK, SPC)  # fmt: skip
    up_w = up_tiles * (CHUNKS * 128)  # < 2^31: (I / 16) * (H / 64) * 128 = I * H / 8
    S_STEP: tl.constexpr = 32 if SPC == 32 else SPC // 2  # scale pointer units per chunk
    MX: tl.constexpr = SPC != 32
    up_s = up_tiles * (CHUNKS * S_STEP)
    c = tl.arange(0, CK)[None, :, None, None, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for c0 in range(0, CHUNKS, CK):
        if EVEN:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_ok[:, None] & (c0 * 64 + k < K)[None, :], other=0.0)
        xt = tl.trans(x.to(tl.float32)) if DOT_F32 else tl.trans(x)
        w = weight_tile(w_ptrs, s_ptrs, c0 + c < CHUNKS, CK, BF16, DOT_F32, EVEN, MX)
        acc = tl.dot(w, xt, acc, input_precision="ieee") if DOT_F32 else tl.dot(w, xt, acc)
        if GATE_UP:
            wu = weight_tile(w_ptrs + up_w, s_ptrs + up_s, c0 + c < CHUNKS, CK, BF16, DOT_F32,
                              EVEN, MX)  # fmt: skip
            if DOT_F32:
                acc_up = tl.dot(wu, xt, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(wu, xt, acc_up)
        if SETTLE:  # the next decode must not overwrite A registers of wgmmas in flight
            acc = settle(acc)
            if GATE_UP:
                acc_up = settle(acc_up)
        w_ptrs += CK * 128
        s_ptrs += CK * S_STEP
        x_ptrs += BK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    factor = tl.load(gs_ptr + e64) * 256.0
    if GATE_UP:
        g = acc * factor
        u = acc_up * factor
        if HAS_BIAS:
            bias = bias_ptr + e64 * stride_be
            g += tl.load(bias + offs_n)[:, None]
            u += tl.load(bias + up_tiles * 16 + offs_n)[:, None]
        h = apply_activation(g, u, alpha, limit, ACT)
        # column n = 64 c + 16 t + 4 j + 2 cc + h goes to 64 c + 16 j + 8 cc + 2 t + h
        r = offs_n % 64
        col = offs_n - r + 16 * ((r // 4) % 4) + 8 * ((r // 2) % 2) + 2 * (r // 16) + r % 2
        a_row = (b * BLOCK_M + slot).to(tl.int64)
        out = out_ptr + a_row[None, :] * stride_om + col[:, None]
        tl.store(out, h.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
    else:
        y = acc * factor
        if HAS_BIAS:
            y += tl.load(bias_ptr + e64 * stride_be + offs_n)[:, None]
        p64 = tl.where(m_ok, pair, 0).to(tl.int64)
        y = y * tl.load(tw_ptr + p64, mask=m_ok, other=0.0)[None, :]
        out = out_ptr + p64[None, :] * stride_om + offs_n[:, None]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])


class GroupedGemmExperts(MoeExperts):
    """The grouped GEMM (:func:`_moe_gemm_kernel`) as the experts stage, over repacked stacks
    checked by :func:`.moe_stacks.check_stack`, with the plan's tile."""

    def __init__(
        self, weights: ExpertWeights, tile: MoeGemmTile, inter: int, facts: DeviceFacts
    ) -> None:
        if not isinstance(tile, MoeGemmTile) or tile.block_m % 16 or tile.block_n % 64:
            fail(f"config {tile!r}", "MoeGemmTile with block_m a multiple of 16, block_n of 64",
                 "leave config=None", InputError)  # fmt: skip
        self.tile, self.inter, self.block_m, self.facts = tile, inter, tile.block_m, facts
        w13, w2, b13, b2 = weights
        self._gemms = (self._weights(w13, b13, True), self._weights(w2, b2, False))

    def _weights(self, w: Sequence[torch.Tensor], bias: torch.Tensor | None, gate_up: bool) -> dict:
        """The launch arguments of one GEMM's weights (scale pairs as one 16-bit load)."""
        words, scales, gs = w[0], w[1].view(torch.int16), w[2]
        n = self.inter if gate_up else words.shape[1] * TILE_N
        bn = self.tile.block_n if n % self.tile.block_n == 0 else 64
        return dict(
            w_ptr=words, s_ptr=scales, gs_ptr=gs, bias_ptr=bias if bias is not None else gs,
            up_tiles=self.inter // TILE_N if gate_up else 0, stride_we=words.stride(0),
            stride_se=scales.stride(0), stride_be=bias.stride(0) if bias is not None else 0,
            CHUNKS=words.shape[2], BLOCK_N=bn, GATE_UP=gate_up, HAS_BIAS=bias is not None,
            num_warps=_tile_warps(self.tile, bn), SPC=w[1].shape[3],
        )  # fmt: skip

    def apply(self, inp: MoeInputs, work: MoeWork) -> None:
        blocks, a, y = work.buffers()
        x, act, cfg, n_blocks = inp.x, inp.act, self.tile, blocks.n_blocks
        common = dict(
            sorted_ptr=blocks.sorted_ids, bexp_ptr=blocks.block_expert,
            nvalid_ptr=blocks.num_blocks, tw_ptr=inp.tw, T=inp.pairs, top_k=inp.top_k,
            n_blocks=n_blocks, alpha=float(act.alpha), limit=float(act.limit), BLOCK_M=cfg.block_m,
            CK=cfg.chunks, ACT=act.code, BF16=x.dtype == torch.bfloat16,
            DOT_F32=interpreting(), num_stages=cfg.stages,
            SETTLE=self.facts.rs_wgmma_hazard and not interpreting(),  # the weight is wgmma's A
        )  # fmt: skip
        g13, g2 = self._gemms
        launch(_moe_gemm_kernel, (n_blocks * (self.inter // g13["BLOCK_N"]),), x_ptr=kappa_order(x),
               out_ptr=a, stride_xm=inp.hidden, stride_om=a.stride(0), **g13, **common)  # fmt: skip
        launch(_moe_gemm_kernel, (n_blocks * (inp.hidden // g2["BLOCK_N"]),), x_ptr=a, out_ptr=y,
               stride_xm=a.stride(0), stride_om=y.stride(0), **g2, **common)  # fmt: skip


def mma_layout_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    *,
    activation: str,
    params: Sequence[float],
    packed_for: torch.dtype,
    config: SmallMoeConfig | MmaMoeConfig | MoeGemmTile | DequantMoeConfig | None = None,
    pdl: bool = True,
    facts: DeviceFacts | None = None,
) -> torch.Tensor:
    """Routed experts on repacked stacks: [M, H] in x.dtype. ``topk_ids`` hold local expert ids
    (others contribute nothing), ``topk_weights`` (float32) are final. ``config``: the plan's
    choice (None: :func:`.moe_plan.mma_layout_moe_plan` here). ``pdl`` (default True): the plan
    may make the single-pair down kernel a programmatic dependent launch where the device has
    them (False: never). ``facts``: x's device (None: asked here)."""
    act = gated_activation(activation, params)
    e, inter, hidden = checked_stacks(x, w13, w2, packed_for)
    stacks = (e, 2 * inter, hidden, w13[0], w2[0])
    inp = prepare_inputs(x, topk_ids, topk_weights, act, stacks, w13_bias, w2_bias, whole_x=True)
    out = checks.empty((inp.m, hidden), x.dtype, x.device)
    if inp.m == 0:
        return out
    facts = facts or device_facts(x.device)
    cfg = config or mma_layout_moe_plan(inp.m, inp.top_k, e, inter, hidden, facts, pdl=pdl)
    weights = ExpertWeights(tuple(w13), tuple(w2), w13_bias, w2_bias)
    return run_stages(_experts(cfg, weights, inter, facts, x), inp, out)


def gated_activation(activation: str, params: Sequence[float]) -> ActivationArgs:
    """The activation's kernel arguments; the repacked kernels run gated activations only."""
    act = activation_args(activation, params)
    if not act.gated:
        fail(
            f"activation {activation!r}",
            "the repacked MoE kernels run gated activations",
            "keep the checkpoint layout (QuantMoE does for non-gated layers)",
            InputError,
        )
    return act


def checked_stacks(
    x: torch.Tensor,
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    packed_for: torch.dtype,
) -> tuple[int, int, int]:
    """x and both repacked stacks checked against each other; returns (E, I, H)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != packed_for:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        fail(
            f"x is {got}",
            f"x is [M, H] in {packed_for} (the layout places codes for one 16-bit dtype)",
            f"pass {packed_for} activations",
            InputError,
        )
    e, n13, hidden = check_stack(w13, "w13")
    e2, n2, inter = check_stack(w2, "w2")
    if e2 != e or n13 != 2 * inter or n2 != hidden or x.shape[1] != hidden:
        fail(
            f"w13 is [E={e}, N={n13}, K={hidden}], w2 [E={e2}, N={n2}, K={inter}], x "
            f"{tuple(x.shape)}",
            "w13 is [E, 2I, H], w2 [E, H, I] and x [M, H]",
            "pass the weights that belong to this layer",
        )
    return e, inter, hidden


def _experts(
    cfg: object, weights: ExpertWeights, inter: int, facts: DeviceFacts, x: torch.Tensor
) -> MoeExperts:
    """The experts of the config's kernel family, after checking the config suits this call."""
    w13, w2, b13, b2 = weights
    if isinstance(cfg, DequantMoeConfig):
        if not grouped_mm_capable(facts):
            fail(f"a dequantize config on {x.device}", "needs torch._grouped_mm on SM 9.0+",
                 "leave config=None", InputError)  # fmt: skip
        return DequantExperts(
            ExpertWeights(
                lambda dt: dequant_experts(*w13, dt), lambda dt: dequant_experts(*w2, dt), b13, b2
            )
        )
    if isinstance(cfg, SmallMoeConfig):
        _on_gpu(x, f"config {cfg.label()}", "the single-pair kernels are PTX")
        if cfg.pdl and not facts.dependent_launches:
            fail(f"config {cfg.label()} on {x.device}",
                 "a programmatic dependent launch needs SM 9.0+ and Triton's grid dependency "
                 "control", "use pdl=False", InputError)  # fmt: skip
        return SmallMoeExperts(weights, cfg, inter)
    if isinstance(cfg, MmaMoeConfig):
        _on_gpu(x, "an mma.sync config", "the mma kernels are PTX")
        return MmaExperts(weights, cfg, inter)
    return GroupedGemmExperts(weights, cfg, inter, facts)  # type: ignore[arg-type]


def _on_gpu(x: torch.Tensor, what: str, rule: str) -> None:
    """The PTX kernels run on a CUDA GPU, compiled (not under the interpreter)."""
    if interpreting() or x.device.type != "cuda":
        fail(f"{what} off a CUDA GPU", rule,
             "use a GEMM config (MoeGemmTile) under the interpreter", InputError)  # fmt: skip

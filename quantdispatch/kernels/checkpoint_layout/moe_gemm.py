"""The experts stage of a MoE call on the checkpoint layout with the tl.dot grouped GEMMs
(:class:`TlDotExperts`; the stages around it: :mod:`..common.moe_stages`).

* **Gate/up GEMM** per (block, N tile): rows of x gathered by token, the packed weights of the
   block's expert decoded in registers (integer-op decoders of :mod:`..common.decode`), two fp32
   accumulators (gate and up tiles), per-expert global scale / FP8 scale and bias in fp32, the
   activation fused, the intermediate stored in x.dtype in sorted order.
* **Down GEMM** per (block, N tile) on that intermediate; fp32 epilogue applies scale, bias and
   the pair's routing weight and writes one row per (token, slot) pair.

K and N need not be multiples of the tiles (masked K tail, clamped N rows). The launcher is
:func:`.moe.fused_moe`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.checkpoint_layout.moe_plan import MoeConfig, MoeGemmConfig
from quantdispatch.kernels.checkpoint_layout.moe_stacks import (
    FORMAT_CODES,
    GROUPS,
    scale_strides,
)
from quantdispatch.kernels.common.activation import apply_activation
from quantdispatch.kernels.common.checks import interpreting
from quantdispatch.kernels.common.decode import (
    e2m1_pair_to_16bit,
    e2m1_pair_to_f32,
    e4m3_to_f32,
    e4m3_to_f32_scaled_finite,
    e8m0_to_f32_scaled,
)
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.common.moe_stages import ExpertWeights, MoeExperts, MoeInputs, MoeWork

__all__ = ["TlDotExperts", "moe_gemm1_kernel", "moe_gemm2_kernel"]


@triton.jit
def _load_w(w_ptrs, s_ptrs, rem, FMT: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, EVEN_K: tl.constexpr, DEQ16: tl.constexpr,
            BF16: tl.constexpr):  # fmt: skip
    """One [BN, BK] weight tile, every value exact.

    NVFP4 on a GPU (DEQ16): codes and block scales decoded straight to x's 16-bit type
    (integer ops and bitcasts, :func:`..common.decode.e2m1_pair_to_16bit`), one 16-bit multiply per
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
def _block_rows(ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, T, E, BM: tl.constexpr,
                DIRECT: tl.constexpr):  # fmt: skip
    """(skip, expert, pair index per row, row in use, intermediate row) of this program's
    block (program id 0), and its N tile (program id 1)."""
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    return skip, e, pair, row_ok, a_row, pid_n


@triton.jit
def _tile_cols(pid_n, N, BN: tl.constexpr, BK: tl.constexpr):
    """N tile ``pid_n``: (K offsets of one step, output columns, the weight rows they read,
    clamped in bounds, int64)."""
    offs_k = tl.arange(0, BK)
    offs_n = pid_n * BN + tl.arange(0, BN)
    return offs_k, offs_n, tl.minimum(offs_n, N - 1).to(tl.int64)


@triton.jit
def _load_rows(ptrs, row_ok, offs_k, rem, EVEN_K: tl.constexpr):
    """One K step of the rows in use (zeros elsewhere, and past K unless EVEN_K)."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=row_ok[:, None] & (offs_k[None, :] < rem), other=0.0)


@triton.jit
def _k_step(x, acc, w_ptrs, s_ptrs, s_base, rows, k0, rem, stride_sn, stride_sk,
            FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_KIND: tl.constexpr,
            BLOCK_SN: tl.constexpr, BLOCK_SK: tl.constexpr, EVEN_K: tl.constexpr,
            DOT_F32: tl.constexpr, DEQ16: tl.constexpr, BF16: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """acc += x @ w.T over one K step of the weight ``rows``; FP8 block scales scale the step's
    own product."""
    w = _load_w(w_ptrs, s_ptrs, rem, FMT, GROUP, BN, BK, EVEN_K, DEQ16, BF16)
    if SCALE_KIND == 2:
        part = _mma(x, w, tl.zeros((BM, BN), dtype=tl.float32), DOT_F32)
        sblk = s_base + (k0 // BLOCK_SK) * stride_sk
        acc += part * tl.load(sblk + (rows // BLOCK_SN) * stride_sn)[None, :]
    else:
        acc = _mma(x, w, acc, DOT_F32)
    return acc


@triton.jit
def _epilogue(acc, gs_ptr, s_base, bias_ptr, e64, rows, stride_sn, stride_be, FMT: tl.constexpr,
              SCALE_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, DEQ16: tl.constexpr):  # fmt: skip
    """The scales the K loop left out (NVFP4 global, FP8 tensor or channel), then the bias, on
    the outputs of the weight ``rows``."""
    if FMT == 0:
        acc = acc * _fp4_fold(gs_ptr, e64, DEQ16)
    elif FMT == 2:
        if SCALE_KIND == 0:
            acc = acc * tl.load(s_base)
        elif SCALE_KIND == 1:
            acc = acc * tl.load(s_base + rows * stride_sn)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + e64 * stride_be + rows)[None, :]
    return acc


@triton.jit(do_not_specialize=["T"])
def moe_gemm1_kernel(
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
    skip, e, pair, row_ok, a_row, pid_n = _block_rows(
        ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, T, E, BM, DIRECT
    )
    if skip:
        return
    e64 = e.to(tl.int64)
    tok = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    offs_k, offs_n, rn = _tile_cols(pid_n, N, BN, BK)
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
        x = _load_rows(x_ptrs, row_ok, offs_k, rem, EVEN_K)
        acc_g = _k_step(x, acc_g, wg_ptrs, sg_ptrs, s_base, rn, k0, rem, stride_sn, stride_sk,
                        FMT, GROUP, SCALE_KIND, BLOCK_SN, BLOCK_SK, EVEN_K, DOT_F32, DEQ16,
                        BF16, BM, BN, BK)  # fmt: skip
        if GATED:
            acc_u = _k_step(x, acc_u, wu_ptrs, su_ptrs, s_base, rn + N, k0, rem, stride_sn,
                            stride_sk, FMT, GROUP, SCALE_KIND, BLOCK_SN, BLOCK_SK, EVEN_K,
                            DOT_F32, DEQ16, BF16, BM, BN, BK)  # fmt: skip
            wu_ptrs += WSTEP
            su_ptrs += SSTEP
        x_ptrs += BK
        wg_ptrs += WSTEP
        sg_ptrs += SSTEP

    # non-gated activations read only acc_g
    acc_g = _epilogue(acc_g, gs_ptr, s_base, bias_ptr, e64, rn, stride_sn, stride_be, FMT,
                      SCALE_KIND, HAS_BIAS, DEQ16)  # fmt: skip
    if GATED:
        acc_u = _epilogue(acc_u, gs_ptr, s_base, bias_ptr, e64, rn + N, stride_sn, stride_be,
                          FMT, SCALE_KIND, HAS_BIAS, DEQ16)  # fmt: skip
    h = apply_activation(acc_g, acc_u, alpha, limit, ACT)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(a_ptrs, h.to(a_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["T"])
def moe_gemm2_kernel(
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
    """Y[pair, n] = w[pair] * (A[row] @ down_e[n].T * scale + bias) for one block and N tile:
    one row per (token, slot) pair, which the top-k reduce sums per token."""
    skip, e, pair, row_ok, a_row, pid_n = _block_rows(
        ids_ptr, sorted_ptr, bexp_ptr, nvalid_ptr, T, E, BM, DIRECT
    )
    if skip:
        return
    e64 = e.to(tl.int64)
    offs_k, offs_n, rn = _tile_cols(pid_n, N, BN, BK)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_base = w_ptr + e64 * stride_we
    s_base = s_ptr + e64 * stride_se
    w_ptrs, s_ptrs = _w_ptrs(w_base, s_base, rn, stride_wn, stride_sn, FMT, GROUP, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    WSTEP: tl.constexpr = BK if FMT == 2 else BK // 2
    SSTEP: tl.constexpr = 0 if FMT == 2 else BK // GROUP
    for k0 in range(0, K, BK):
        rem = K - k0
        a = _load_rows(a_ptrs, row_ok, offs_k, rem, EVEN_K)
        acc = _k_step(a, acc, w_ptrs, s_ptrs, s_base, rn, k0, rem, stride_sn, stride_sk, FMT,
                      GROUP, SCALE_KIND, BLOCK_SN, BLOCK_SK, EVEN_K, DOT_F32, DEQ16, BF16, BM,
                      BN, BK)  # fmt: skip
        a_ptrs += BK
        w_ptrs += WSTEP
        s_ptrs += SSTEP

    acc = _epilogue(acc, gs_ptr, s_base, bias_ptr, e64, rn, stride_sn, stride_be, FMT,
                    SCALE_KIND, HAS_BIAS, DEQ16)  # fmt: skip
    pair64 = tl.where(row_ok, pair, 0).to(tl.int64)
    acc = acc * tl.load(tw_ptr + pair64, mask=row_ok, other=0.0)[:, None]
    y_ptrs = y_ptr + pair64[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


# --------------------------------------------------------------------------------------------
# host side


class TlDotExperts(MoeExperts):
    """The tl.dot gate/up and down kernels as the experts stage (:mod:`..common.moe_stages`),
    over checked stacks (:func:`.moe_stacks.unpack_stack`, each an
    :class:`.moe_stacks.ExpertStack`) with the plan's tiles. ``block_size``:
    FP8 block scales' (rows, columns)."""

    def __init__(
        self,
        fmt: str,
        weights: ExpertWeights,
        block_size: tuple[int, int] | None,
        cfg: MoeConfig,
        inter: int,
    ) -> None:
        self.fmt, self.weights, self.cfg = fmt, weights, cfg
        self.inter, self.block_m, self.direct = inter, cfg.block_m, cfg.direct
        self._bsn, self._bsk = block_size if fmt == "fp8" and block_size is not None else (1, 1)
        self._group = GROUPS[fmt]
        self._dot_f32 = interpreting()

    def _block_k(self, c: MoeGemmConfig, kind: int) -> int:
        bk = max(c.block_k, 2 * self._group if self.fmt != "fp8" else 16)
        if kind == 2:  # a K step must not straddle two scale blocks
            while self._bsk % bk:
                bk //= 2
        return bk

    def _constexprs(self, x: torch.Tensor, kind: int, c: MoeGemmConfig, k: int) -> dict:
        bk = self._block_k(c, kind)
        return dict(
            FMT=FORMAT_CODES[self.fmt], GROUP=self._group, SCALE_KIND=kind, BLOCK_SN=self._bsn,
            BLOCK_SK=self._bsk, DIRECT=self.direct, EVEN_K=k % bk == 0, DOT_F32=self._dot_f32,
            DEQ16=self.fmt == "nvfp4" and not self._dot_f32, BF16=x.dtype == torch.bfloat16,
            BM=self.block_m, BN=c.block_n, BK=bk, num_warps=c.num_warps,
            num_stages=c.num_stages,
        )  # fmt: skip

    def apply(self, inp: MoeInputs, work: MoeWork) -> None:
        blocks, a, y = work.buffers()
        x, ids, act, e, hidden, inter = inp.x, inp.ids, inp.act, inp.experts, inp.hidden, self.inter
        rows = (blocks.sorted_ids, blocks.block_expert, blocks.num_blocks)
        (c13, s13, g13, *_), (c2, s2, g2, *_), b13, b2 = self.weights
        se13, sn13, sk13, kind13 = scale_strides(self.fmt, s13)
        launch(moe_gemm1_kernel, (blocks.n_blocks, triton.cdiv(inter, self.cfg.gemm1.block_n)),
            x, ids, *rows, c13, s13, g13 if g13 is not None else s13, b13 if b13 is not None else x,
            a, inp.pairs, inter, hidden, e, inp.top_k, x.stride(0), c13.stride(0), c13.stride(1),
            se13, sn13, sk13, b13.stride(0) if b13 is not None else 0, a.stride(0),
            float(act.alpha), float(act.limit), GATED=act.gated, ACT=act.code,
            HAS_BIAS=b13 is not None, **self._constexprs(x, kind13, self.cfg.gemm1, hidden),
        )  # fmt: skip
        se2, sn2, sk2, kind2 = scale_strides(self.fmt, s2)
        launch(moe_gemm2_kernel, (blocks.n_blocks, triton.cdiv(hidden, self.cfg.gemm2.block_n)),
            a, ids, *rows, inp.tw, c2, s2, g2 if g2 is not None else s2,
            b2 if b2 is not None else x, y, inp.pairs, hidden, inter, e, a.stride(0),
            c2.stride(0), c2.stride(1), se2, sn2, sk2, b2.stride(0) if b2 is not None else 0,
            y.stride(0), HAS_BIAS=b2 is not None,
            **self._constexprs(x, kind2, self.cfg.gemm2, inter),
        )  # fmt: skip

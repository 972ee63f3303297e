"""Weight-only FP4 GEMM (NVFP4 and MXFP4) in Triton: ``out = x @ W.T (+ bias)``.

The weights stay in the checkpoint layout (``packed`` uint8 [N, K/2], low nibble = even
element; ``block_scale`` [N, K/group]; no repacking) and are dequantized tile by tile in
registers, right in the MMA operand layout (Triton hoists the decode past the layout change):

* NVFP4 on a GPU (``DEQ16``): both E2M1 codes of a byte become 16-bit floats with 2 integer
  ops per code (:func:`..common.decode.e2m1_pair_to_16bit`) and are multiplied by the block scale in
  16-bit: ``e2m1 * scale * 2^-8`` is exact (<= 5 significant bits, normal range) and the
  2^8 returns in the fp32 epilogue. Subnormal scales and code 0.5 pass through 16-bit
  subnormals, which 16-bit arithmetic keeps (no flush-to-zero forms are emitted).
* MXFP4 (E8M0 scales span 2^-127..2^127, too wide for one 16-bit multiply) and the CPU
  interpreter (whose bf16 arithmetic is wrong) decode in fp32 (``e2m1 * scale`` exactly).
* Accumulation is fp32; the NVFP4 global scale (read on the device) and the bias are applied
  to the fp32 accumulator in the epilogue, never after a 16-bit cast.

Two kernels, picked on the host from the config table (:mod:`..common.configs`, keyed by GPU, shape
and M bucket; no autotuning at call time):

* ``_fp4_small_m_kernel`` (``config.split > 0``, the small-M path, used up to M ~ 32): a
  16-row tile, narrow N tiles, and K split ``split`` ways *inside* each program (a batched MMA
  summed once at the end). At M <= 16 an N tile feeds only one 8- or 16-wide MMA per warp,
  so without the split a 4096-wide layer has ~4 warps per SM: far too few to stream weights.
  No workspace, no atomics, deterministic.
* ``_fp4_gemm_kernel`` (``split == 0``): classic tiles with grouped (L2-friendly) tile order;
  ``tl.dot`` becomes wgmma for 64+ row tiles on Hopper.

Rows of x past M are masked, never re-read (16 copies of one row hammer one L2 line). No host
synchronization, no allocation besides the output, no state: CUDA-graph safe. Measured numbers
and their limits: docs/design/checkpoint-layout.md.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.bound_linear import VARYING, BoundTiledLinear
from quantdispatch.kernels.common.checks import (
    SCALE_GROUP,
    check_activation,
    check_bias,
    check_fp4_weights,
    check_same_device,
    interpreting,
)
from quantdispatch.kernels.common.configs import GemmConfig, get_config
from quantdispatch.kernels.common.decode import (
    e2m1_pair_to_16bit,
    e2m1_pair_to_f32,
    e4m3_to_f32_scaled,
    e4m3_to_f32_scaled_finite,
    e8m0_to_f32_scaled,
)
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.common.launch import Launcher
from quantdispatch.kernels.common.wgmma_guard import settle

__all__ = ["Fp4Linear", "fp4_linear", "mma_tile"]


_KIND = {"e4m3": "nvfp4", "e8m0": "mxfp4"}


@triton.jit
def _fp4_codes_and_scales(p, sb, SCALE_E8M0: tl.constexpr, DEQ16: tl.constexpr, BF16: tl.constexpr):
    """Elementwise decode: packed bytes -> (low, high) values, scale codes -> scale values.

    DEQ16 (NVFP4 on a GPU): codes straight to 16-bit, scale to 16-bit; their product is
    ``e2m1 * scale * 2^-8`` (exact; the 2^8 is undone in the epilogue).
    Otherwise (MXFP4, the interpreter): fp32; the product is ``e2m1 * scale`` exactly.
    """
    if DEQ16:
        lo, hi = e2m1_pair_to_16bit(p, BF16)  # e2m1 * 2^-126 (bf16) / 2^-14 (fp16)
        if BF16:
            s = (e4m3_to_f32_scaled_finite(sb) * 8.507059173023462e37).to(tl.bfloat16)  # *2^118
        else:
            s = (e4m3_to_f32_scaled_finite(sb) * 16384.0).to(tl.float16)  # * 2^6
    else:
        lo, hi = e2m1_pair_to_f32(p)  # e2m1 * 2^-14, exact
        if SCALE_E8M0:  # noqa: SIM108 (constexpr branches read better in kernel code)
            s = e8m0_to_f32_scaled(sb, 14)  # 2^(s-127) * 2^14
        else:
            s = e4m3_to_f32_scaled(sb) * 4194304.0  # (e4m3 * 2^-8) * 2^22 = e4m3 * 2^14
    return lo, hi, s


@triton.jit
def _dequant_fp4_tile(
    p,
    sb,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    DEQ16: tl.constexpr,
    BF16: tl.constexpr,
):
    """[BN, BK/2] packed bytes + [BN, BK/GROUP] scale codes -> [BN, BK] weights."""
    lo, hi, s = _fp4_codes_and_scales(p, sb, SCALE_E8M0, DEQ16, BF16)
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // GROUP, GROUP))
    w = w * s[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _dequant_fp4_tile3(
    p,
    sb,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    DEQ16: tl.constexpr,
    BF16: tl.constexpr,
):
    """The same for a [SPLIT, BN, BK] stack of K slices (the small-M kernel)."""
    lo, hi, s = _fp4_codes_and_scales(p, sb, SCALE_E8M0, DEQ16, BF16)
    w = tl.reshape(tl.join(lo, hi), (SPLIT, BLOCK_N, BLOCK_K // GROUP, GROUP))
    w = w * s[:, :, :, None]
    return tl.reshape(w, (SPLIT, BLOCK_N, BLOCK_K))


@triton.jit
def mma_tile(acc, x, w, SWAP_AB: tl.constexpr, DOT_F32: tl.constexpr, SETTLE: tl.constexpr):
    """acc += x @ w.T ([BM, BN]), or with SWAP_AB acc += w @ x.T ([BN, BM]): the weights as the
    MMA's A operand, which suits tiny M (the x tile is the narrow B operand). SETTLE (with SWAP_AB):
    read acc at once (:func:`..common.wgmma_guard.settle`), so the next K step's decode does not
    overwrite the A registers of wgmmas in flight (the Triton < 3.7 pipelining bug). DOT_F32 is for
    the interpreter only: its bf16 dot is wrong; fp32 is exact for these inputs (16-bit values, fp32
    products)."""
    if DOT_F32:
        xf = x.to(tl.float32)
        wf = w.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(wf, tl.trans(xf), acc, input_precision="ieee")
        else:
            acc = tl.dot(xf, tl.trans(wf), acc, input_precision="ieee")
    else:
        w16 = w.to(x.dtype)
        if SWAP_AB:
            acc = tl.dot(w16, tl.trans(x), acc)
            if SETTLE:
                acc = settle(acc)
        else:
            acc = tl.dot(x, tl.trans(w16), acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _fp4_small_m_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HAS_GS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    DEQ16: tl.constexpr,
    BF16: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Small-M path: one [BLOCK_M, BLOCK_N] output tile, K split SPLIT ways *inside* the
    program (a batched [SPLIT, ...] MMA whose slices the compiler spreads over warps, summed
    once at the end). At M <= 16 an N tile only feeds one 8-column MMA per warp, so without
    the split a 4096-wide layer has ~4 warps per SM -- too few loads in flight to stream
    weights at HBM speed. The in-program split needs no workspace, no atomics and no second
    pass, and the sum is deterministic."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    BKH: tl.constexpr = BLOCK_K // 2
    NG: tl.constexpr = BLOCK_K // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    sp = tl.arange(0, SPLIT)[:, None, None]
    k3 = tl.arange(0, BLOCK_K)[None, None, :]
    kh3 = tl.arange(0, BKH)[None, None, :]
    g3 = tl.arange(0, NG)[None, None, :]
    # slice s of every step covers K columns [k0 + s*BLOCK_K, k0 + (s+1)*BLOCK_K)
    x_ptrs = x_ptr + rm[None, :, None] * stride_xm + (sp * BLOCK_K + k3)
    w_ptrs = w_ptr + rn[None, :, None] * stride_wn + (sp * BKH + kh3)
    s_ptrs = s_ptr + rn[None, :, None] * stride_sn + (sp * NG + g3)

    PREC: tl.constexpr = "ieee" if DOT_F32 else None
    if SWAP_AB:
        acc = tl.zeros((SPLIT, BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((SPLIT, BLOCK_M, BLOCK_N), dtype=tl.float32)
    # rows past M are masked, not re-read: 16 copies of one row hammer one L2 line
    row_ok = (offs_m < M)[None, :, None]
    for k0 in range(0, K, SPLIT * BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            p = tl.load(w_ptrs)
            sb = tl.load(s_ptrs)
        else:
            rem = K - k0 - sp * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok & (k3 < rem), other=0.0)
            p = tl.load(w_ptrs, mask=kh3 < rem // 2, other=0)
            sb = tl.load(s_ptrs, mask=g3 < rem // GROUP, other=0)
        w = _dequant_fp4_tile3(p, sb, SPLIT, BLOCK_N, BLOCK_K, GROUP, SCALE_E8M0, DEQ16, BF16)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        if SWAP_AB:  # [SPLIT, BN, BM]: the weights are the MMA's A operand
            acc = tl.dot(w, tl.permute(x, (0, 2, 1)), acc, input_precision=PREC)
        else:
            acc = tl.dot(x, tl.permute(w, (0, 2, 1)), acc, input_precision=PREC)
        x_ptrs += SPLIT * BLOCK_K
        w_ptrs += SPLIT * BKH
        s_ptrs += SPLIT * NG

    out = tl.sum(acc, axis=0)
    if SWAP_AB:
        out = tl.trans(out)
    if DEQ16:
        out = out * 256.0  # the 2^-8 of the 16-bit decode
    if HAS_GS:
        out = out * tl.load(gs_ptr)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fp4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HAS_GS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    DEQ16: tl.constexpr,
    BF16: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SETTLE: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile; loops over all of K (no split, no workspace).
    SETTLE: see :func:`mma_tile`."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M M-tiles walk the same N-tiles together (weight reuse in L2)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    BKH: tl.constexpr = BLOCK_K // 2
    NG: tl.constexpr = BLOCK_K // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # N rows past the end re-read row N-1 (never stored); M rows are masked in the loop
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kh = tl.arange(0, BKH)
    offs_g = tl.arange(0, NG)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + offs_kh[None, :]
    s_ptrs = s_ptr + rn[:, None] * stride_sn + offs_g[None, :]

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_ok = (offs_m < M)[:, None]  # rows past M masked (no duplicate requests), see above
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            p = tl.load(w_ptrs)
            sb = tl.load(s_ptrs)
        else:
            rem = K - k0
            x = tl.load(x_ptrs, mask=row_ok & (offs_k[None, :] < rem), other=0.0)
            p = tl.load(w_ptrs, mask=offs_kh[None, :] < rem // 2, other=0)
            sb = tl.load(s_ptrs, mask=offs_g[None, :] < rem // GROUP, other=0)
        w = _dequant_fp4_tile(p, sb, BLOCK_N, BLOCK_K, GROUP, SCALE_E8M0, DEQ16, BF16)
        acc = mma_tile(acc, x, w, SWAP_AB, DOT_F32, SETTLE)
        x_ptrs += BLOCK_K
        w_ptrs += BKH
        s_ptrs += NG

    if SWAP_AB:
        acc = tl.trans(acc)
    if DEQ16:
        acc = acc * 256.0  # the 2^-8 of the 16-bit decode
    if HAS_GS:
        acc = acc * tl.load(gs_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class Fp4Linear(BoundTiledLinear):
    """:func:`fp4_linear` with the weight bound (the bound call path): the weight checks run
    once, each M's config and launcher are made once; a call checks x, allocates the output and
    launches."""

    where = "fp4_linear"

    def __init__(
        self,
        packed: torch.Tensor,
        block_scale: torch.Tensor,
        global_scale: torch.Tensor | None,
        *,
        scale_format: Literal["e4m3", "e8m0"],
        bias: torch.Tensor | None = None,
        config: GemmConfig | None = None,
        deq16: bool | None = None,
        facts: DeviceFacts | None = None,
    ) -> None:
        self.k = packed.shape[1] * 2 if packed.dim() == 2 else -1
        scale_u8 = check_fp4_weights(packed, block_scale, global_scale, scale_format, self.k)
        check_same_device(
            packed, "fp4_linear", block_scale=block_scale, global_scale=global_scale, bias=bias
        )
        self.n = packed.shape[0]
        check_bias(bias, self.n, "fp4_linear")
        self.scale_format = scale_format
        self.facts = facts or device_facts(packed.device)
        self._config, self._deq16 = config, deq16
        self._fixed = dict(
            w_ptr=packed, s_ptr=scale_u8, N=self.n, K=self.k, stride_wn=packed.stride(0),
            stride_sn=scale_u8.stride(0), GROUP=SCALE_GROUP[scale_format],
            SCALE_E8M0=scale_format == "e8m0", HAS_GS=global_scale is not None,
            HAS_BIAS=bias is not None, DOT_F32=interpreting(),
            gs_ptr=global_scale if global_scale is not None else packed,  # placeholder: unread
            bias_ptr=bias if bias is not None else packed,
        )  # fmt: skip
        self._plans = {}

    def _plan(self, m: int, dtype: torch.dtype) -> tuple[Launcher, tuple[int, ...]]:
        n, k = self.n, self.k
        config = self._config or get_config(_KIND[self.scale_format], self.facts, n, k, m)[0]
        block_k = max(config.block_k, SCALE_GROUP[self.scale_format])
        bf16 = dtype == torch.bfloat16
        deq16 = self._deq16
        if deq16 is None:  # the interpreter's bf16 arithmetic is wrong: fp32 decode there
            deq16 = self.scale_format == "e4m3" and not (interpreting() and bf16)
        fixed = dict(
            self._fixed, DEQ16=deq16 and self.scale_format == "e4m3", BF16=bf16,
            SWAP_AB=bool(config.swap_ab), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=block_k,
        )  # fmt: skip
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        if config.split:  # small-M family: K split inside each program
            grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))
            even_k = k % (block_k * config.split) == 0
            kernel, extra = _fp4_small_m_kernel, dict(EVEN_K=even_k, SPLIT=config.split)
        else:  # tiled family
            grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
            # swap-AB: the decoded weight is the MMA's A operand (wgmma on SM 9.x)
            settled = bool(config.swap_ab) and self.facts.rs_wgmma_hazard
            kernel = _fp4_gemm_kernel
            extra = dict(EVEN_K=k % block_k == 0, GROUP_M=config.group_m, SETTLE=settled)
        launcher = Launcher(kernel, VARYING, dict(fixed, **extra), options)
        return self._keep(m, dtype, (launcher, grid))


def fp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    scale_format: Literal["e4m3", "e8m0"],
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    deq16: bool | None = None,
    facts: DeviceFacts | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with W = e2m1(packed) * block_scale [* global_scale]; [M, N] in x.dtype.

    ``scale_format='e4m3'`` is NVFP4 (group 16, ``global_scale`` a float32 one-element tensor on the
    device, never read on the host); ``'e8m0'`` is MXFP4 (group 32, no global scale, or the factor
    :func:`quantdispatch.formats.mxfp4.rebase_mx_scales_for_fp16` returns for its rebased codes).
    ``config`` overrides the table and ``deq16`` the decode variant (tuning and tests only);
    ``facts``: x's device (None: asked here). A layer binds :class:`Fp4Linear` once instead.
    """
    k = packed.shape[1] * 2 if packed.dim() == 2 else -1
    x = check_activation(x, k, "fp4_linear")
    check_same_device(x, "fp4_linear", packed=packed)
    bound = Fp4Linear(
        packed, block_scale, global_scale, scale_format=scale_format, bias=bias, config=config,
        deq16=deq16, facts=facts or device_facts(x.device),
    )  # fmt: skip
    return bound(x)

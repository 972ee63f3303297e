"""Weight-only FP8 (E4M3) GEMM in Triton, W8A16: ``out = x @ (W * scale).T (+ bias)``.

For GPUs without FP8 tensor cores (SM75-SM86) and for FP8 checkpoints whose activations stay
16-bit. The e4m3 bytes are decoded with integer ops (no fp8 dtype in Triton, which rejects it
below SM89) straight to their exact 16-bit value (:func:`..common.decode.e4m3_to_16bit`: bits into
the bottom of the 16-bit exponent field, one exact power-of-two multiply); the interpreter's
bf16 path uses the fp32 decode instead. Scales, by ``scale.dim()``:

* 0: per-tensor, 1: per-output-channel [N] -- applied to the fp32 accumulator at the end;
* 2: block [ceil(N/bn), ceil(K/bk)] (DeepSeek-style 128x128) -- each K tile lies inside one
  scale block (BLOCK_K divides bk), so every tile's fp32 partial product is scaled by its
  per-column block scale before it is accumulated.

Two kernels, picked on the host from the config table by M (:mod:`..common.configs`): the small-M
kernel (``config.split > 0``) splits K inside each program, as the FP4 small-M kernel does, so
a 4096-wide layer keeps enough warps per SM to stream its weights at M <= 16; the tiled
kernel takes larger M. Same CUDA-graph properties as :mod:`.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.errors import InputError, format_error
from quantdispatch.kernels.checkpoint_layout.linear import mma_tile
from quantdispatch.kernels.common.bound_linear import VARYING, BoundTiledLinear
from quantdispatch.kernels.common.checks import (
    check_activation,
    check_bias,
    check_fp8_weights,
    check_same_device,
    interpreting,
)
from quantdispatch.kernels.common.configs import GemmConfig, get_config
from quantdispatch.kernels.common.decode import e4m3_to_16bit, e4m3_to_f32_scaled
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.common.launch import Launcher

__all__ = ["Fp8Linear", "fp8_weight_only_linear"]


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_om,
    SCALE_KIND: tl.constexpr,
    BLOCK_SN: tl.constexpr,
    BLOCK_SK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    BF16: tl.constexpr,
    DEQ16: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SETTLE: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over all of K; SCALE_KIND 0 tensor, 1 channel, 2 block.
    SETTLE: see :func:`.linear.mma_tile`."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + offs_k[None, :]
    s_row_ptrs = s_ptr + (rn // BLOCK_SN) * stride_sn  # block scales of this tile's columns

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_ok = (offs_m < M)[:, None]  # rows past M masked: no duplicate requests to one line
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            b = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=row_ok & (offs_k[None, :] < K - k0), other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[None, :] < K - k0, other=0)
        if DEQ16:  # noqa: SIM108 -- exact e4m3 values straight in 16-bit
            w = e4m3_to_16bit(b, BF16)
        else:  # interpreter's bf16: fp32, e4m3 * 2^-8 (the 2^8 goes to the epilogue)
            w = e4m3_to_f32_scaled(b)
        if SCALE_KIND == 2:  # this K tile lies in one scale block: scale its partial product
            part = tl.zeros(acc.shape, dtype=tl.float32)
            part = mma_tile(part, x, w, SWAP_AB, DOT_F32, SETTLE)
            s_blk = tl.load(s_row_ptrs + (k0 // BLOCK_SK) * stride_sk)
            if SWAP_AB:
                acc += part * s_blk[:, None]
            else:
                acc += part * s_blk[None, :]
        else:
            acc = mma_tile(acc, x, w, SWAP_AB, DOT_F32, SETTLE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if SWAP_AB:
        acc = tl.trans(acc)
    if SCALE_KIND == 0:
        acc = acc * tl.load(s_ptr)
    elif SCALE_KIND == 1:
        acc = acc * tl.load(s_ptr + rn)[None, :]
    if not DEQ16:
        acc = acc * 256.0
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fp8_small_m_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_om,
    SCALE_KIND: tl.constexpr,
    BLOCK_SN: tl.constexpr,
    BLOCK_SK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    BF16: tl.constexpr,
    DEQ16: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Small-M path: one [BLOCK_M, BLOCK_N] output tile, K split SPLIT ways inside the program
    (a batched [SPLIT, ...] MMA, summed once at the end), as the FP4 small-M kernel does: at
    M <= 16 a tiled program feeds one narrow MMA, so a 4096-wide layer has too few warps per
    SM to stream its weights. Block scales (SCALE_KIND 2): each slice lies inside one scale
    block (BLOCK_K divides BLOCK_SK), so each slice's fp32 partial product is scaled by its
    own block scale before it is accumulated. No workspace, no atomics, deterministic."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    sp = tl.arange(0, SPLIT)[:, None, None]
    k3 = tl.arange(0, BLOCK_K)[None, None, :]
    # slice s of every step covers K columns [k0 + s*BLOCK_K, k0 + (s+1)*BLOCK_K)
    x_ptrs = x_ptr + rm[None, :, None] * stride_xm + (sp * BLOCK_K + k3)
    w_ptrs = w_ptr + rn[None, :, None] * stride_wn + (sp * BLOCK_K + k3)
    if SWAP_AB:  # the block scales of this tile's rows, one per slice: [SPLIT, BN, 1]
        s_blk_ptrs = s_ptr + (rn // BLOCK_SN)[None, :, None] * stride_sn
    else:  # [SPLIT, 1, BN]
        s_blk_ptrs = s_ptr + (rn // BLOCK_SN)[None, None, :] * stride_sn

    PREC: tl.constexpr = "ieee" if DOT_F32 else None
    if SWAP_AB:
        acc = tl.zeros((SPLIT, BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((SPLIT, BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_ok = (offs_m < M)[None, :, None]  # rows past M masked, not re-read
    for k0 in range(0, K, SPLIT * BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            b = tl.load(w_ptrs)
        else:
            rem = K - k0 - sp * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok & (k3 < rem), other=0.0)
            b = tl.load(w_ptrs, mask=k3 < rem, other=0)
        if DEQ16:  # noqa: SIM108 -- exact e4m3 values straight in 16-bit
            w = e4m3_to_16bit(b, BF16)
        else:  # interpreter's bf16: fp32, e4m3 * 2^-8 (the 2^8 goes to the epilogue)
            w = e4m3_to_f32_scaled(b)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        if SCALE_KIND == 2:  # a fresh partial product per step, scaled per slice below
            if SWAP_AB:
                part = tl.zeros((SPLIT, BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                part = tl.zeros((SPLIT, BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            part = acc
        if SWAP_AB:  # [SPLIT, BN, BM]: the weights are the MMA's A operand
            part = tl.dot(w, tl.permute(x, (0, 2, 1)), part, input_precision=PREC)
        else:
            part = tl.dot(x, tl.permute(w, (0, 2, 1)), part, input_precision=PREC)
        if SCALE_KIND == 2:
            kb = (k0 + sp * BLOCK_K) // BLOCK_SK  # [SPLIT, 1, 1]
            kb_ok = k0 + sp * BLOCK_K < K  # slices past K: their partial products are 0
            s_blk = tl.load(s_blk_ptrs + kb * stride_sk, mask=kb_ok, other=0.0)
            acc += part * s_blk
        else:
            acc = part
        x_ptrs += SPLIT * BLOCK_K
        w_ptrs += SPLIT * BLOCK_K

    out = tl.sum(acc, axis=0)
    if SWAP_AB:
        out = tl.trans(out)
    if SCALE_KIND == 0:
        out = out * tl.load(s_ptr)
    elif SCALE_KIND == 1:
        out = out * tl.load(s_ptr + rn)[None, :]
    if not DEQ16:
        out = out * 256.0
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _scale_block_fit(block_k: int, kind: int, bk: int) -> int:
    """The K tile (or slice) width: halved until it divides the scale block's K width, so no
    tile straddles two block scales (block scales only)."""
    start = block_k
    if kind == 2:
        while bk % block_k != 0:
            block_k //= 2
        if block_k < 16:
            raise InputError(
                format_error(
                    f"fp8_weight_only_linear: config block_k={start} against scale blocks "
                    f"{bk} wide",
                    "halving the K tile must reach a divisor of the scale block that is at "
                    "least 16 (the MMA K step)",
                    "pass a config whose block_k is a power of two >= 16 (tuning only)",
                )
            )
    return block_k


class Fp8Linear(BoundTiledLinear):
    """:func:`fp8_weight_only_linear` with the weight bound (the bound call path): the weight
    checks run once, each M's config and launcher are made once; a call checks x, allocates the
    output and launches."""

    where = "fp8_weight_only_linear"

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        *,
        block_size: tuple[int, int] | None,
        bias: torch.Tensor | None = None,
        config: GemmConfig | None = None,
        facts: DeviceFacts | None = None,
    ) -> None:
        self.k = weight.shape[1] if weight.dim() == 2 else -1
        w_u8, self.kind, (bn, self.bk) = check_fp8_weights(weight, scale, block_size, self.k)
        check_same_device(weight, "fp8_weight_only_linear", scale=scale, bias=bias)
        self.n = weight.shape[0]
        check_bias(bias, self.n, "fp8_weight_only_linear")
        self.facts = facts or device_facts(weight.device)
        self._config = config
        block = self.kind == 2
        self._fixed = dict(
            w_ptr=w_u8, s_ptr=scale, N=self.n, K=self.k, stride_wn=w_u8.stride(0),
            stride_sn=scale.stride(0) if block else 0, stride_sk=scale.stride(1) if block else 0,
            SCALE_KIND=self.kind, BLOCK_SN=bn, BLOCK_SK=self.bk, HAS_BIAS=bias is not None,
            DOT_F32=interpreting(), bias_ptr=bias if bias is not None else w_u8,  # unread
        )  # fmt: skip
        self._plans = {}

    def _plan(self, m: int, dtype: torch.dtype) -> tuple[Launcher, tuple[int, ...]]:
        n, k = self.n, self.k
        config = self._config or get_config("fp8", self.facts, n, k, m)[0]
        bf16 = dtype == torch.bfloat16
        fixed = dict(
            self._fixed, BF16=bf16, DEQ16=not (interpreting() and bf16),
            SWAP_AB=bool(config.swap_ab), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        )  # fmt: skip
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        if config.split:  # the small-M kernel: K split in-program
            block_k = _scale_block_fit(config.block_k, self.kind, self.bk)
            grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))
            kernel = _fp8_small_m_kernel
            extra = dict(
                BLOCK_K=block_k, EVEN_K=k % (config.split * block_k) == 0, SPLIT=config.split
            )
        else:
            # one byte per weight: K tiles twice as wide in bytes as FP4's; keep stages inside
            # 227 KB
            top = min(config.block_k, 256 if config.block_m <= 32 else 128)
            block_k = _scale_block_fit(top, self.kind, self.bk)
            grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
            kernel = _fp8_gemm_kernel
            # swap-AB: the decoded weight is the MMA's A operand (wgmma on SM 9.x)
            settled = bool(config.swap_ab) and self.facts.rs_wgmma_hazard
            extra = dict(
                BLOCK_K=block_k, EVEN_K=k % block_k == 0, GROUP_M=config.group_m, SETTLE=settled
            )
        launcher = Launcher(kernel, VARYING, dict(fixed, **extra), options)
        return self._keep(m, dtype, (launcher, grid))


def fp8_weight_only_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_size: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    facts: DeviceFacts | None = None,
) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` with 16-bit activations; [M, N] in x.dtype.

    ``scale``: 0-dim (tensor), [N] (channel) or [ceil(N/bn), ceil(K/bk)] with
    ``block_size=(bn, bk)`` (block). ``config`` overrides the table (tuning and tests only);
    ``facts``: x's device (None: asked here). A layer binds :class:`Fp8Linear` once instead.
    """
    k = weight.shape[1] if weight.dim() == 2 else -1
    x = check_activation(x, k, "fp8_weight_only_linear")
    check_same_device(x, "fp8_weight_only_linear", weight=weight)
    bound = Fp8Linear(
        weight, scale, block_size=block_size, bias=bias, config=config,
        facts=facts or device_facts(x.device),
    )  # fmt: skip
    return bound(x)

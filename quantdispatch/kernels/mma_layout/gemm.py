"""NVFP4 GEMM for mid M on the ``mma16x64`` layout, through ``tl.dot`` (wgmma on Hopper).

Why this exists: the GEMV-style kernel of :mod:`.gemv` issues one ``mma.sync`` per 8 tokens
per decoded fragment and re-reads the activations per weight tile, so from ~32 tokens on it is
latency and L1 bound (Nsight Compute; docs/design/wgmma-gemm.md), and dequantizing whole slabs for
cuBLAS moves 4.5x the weight bytes. Here each program decodes a [BLOCK_N, 64 * CHUNKS] weight
tile once per K step, with the same PTX bit tricks as the GEMV kernel (11 integer ops and 4
16-bit FMAs per 8 codes), and hands it to ``tl.dot`` as the *A* operand of ``out^T = W x^T``
("swap AB"): the weight rows fill the 64-row MMA dimension, the tokens (up to 256) the N
dimension, so the decode cost is shared by every token of the tile. The decode:
:mod:`.tile_decode`; the tiles: :mod:`.gemm_tiles`; the activations' K order:
:mod:`.activation_order`.

Numerics as in :mod:`.layout`: 16-bit operands ``e2m1 * scale * 2^-8`` (exact), fp32
accumulation, ``2^8 * global_scale`` and the bias on the fp32 sums. ``DOT_F32`` (the CPU
interpreter, which runs no PTX) decodes the same bits with Triton integer ops into fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantdispatch.capability import SM90_PLUS
from quantdispatch.kernels.common.device_facts import (
    DeviceFacts,
    device_facts,
    has_host_descriptors,
)
from quantdispatch.kernels.common.launch import Launcher
from quantdispatch.kernels.common.pdl import gdc_launch_dependents, gdc_wait
from quantdispatch.kernels.common.wgmma_guard import settle
from quantdispatch.kernels.mma_layout.activation_order import KappaOrder, kappa_order
from quantdispatch.kernels.mma_layout.gemm_tiles import GemmTile, mma_gemm_config
from quantdispatch.kernels.mma_layout.layout import CHUNK_K, TILE_N, scale_pairs
from quantdispatch.kernels.mma_layout.tile_decode import weight_tile

__all__ = ["PAD_TMA_ROWS", "MmaGemm", "mma_gemm"]


#: Whether TMA tiles read activations padded to whole BLOCK_M rows (benchmarks switch it off
#: to compare; see :func:`mma_gemm`).
PAD_TMA_ROWS = True


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
    version waited on those address registers: docs/design/wgmma-gemm.md).

    x is [M, K] contiguous with its columns already in the MMA's K order (:func:`kappa_order`).
    M tiles of one weight tile run back to back (program id order), so the weight tile is read
    from HBM once and from L2 after. With SPLIT > 1, ``out_ptr`` is an fp32 [SPLIT, M, N]
    workspace of unscaled partial sums (summed by :func:`_split_sum_kernel`).
    SETTLE: read the accumulator in every step (:func:`..common.wgmma_guard.settle`), so the
    next step's decode never writes A registers of wgmmas in flight (Triton < 3.7 pipelining
    bug). The weight words and scales stay on pointer loads: by TMA too it was slower, as ptxas
    then serialized the wgmma chain of the split register-operand dot
    (docs/design/wgmma-gemm.md)."""
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
        w = weight_tile(w_ptrs, s_ptrs, c0 + c < CHUNKS, CK, BF16, DOT_F32, EVEN, SPC == 16)
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


def _x_descriptor(xk: torch.Tensor, tile: GemmTile, facts: DeviceFacts) -> object:
    """A TMA descriptor of the K-ordered activations in [BLOCK_M, BK] boxes (made on the host,
    passed by value: nothing is allocated on the device, so CUDA graphs capture it)."""
    if xk.device.type != "cuda" or facts.capability not in SM90_PLUS:
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


class MmaGemm:
    """:func:`mma_gemm` with the weight bound (the bound call path): the tile, split and
    launchers of each M are made once; a call permutes the activations, launches the GEMM (and
    the split sum) and returns the output."""

    def __init__(
        self,
        words: torch.Tensor,
        scales: torch.Tensor,
        global_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        tile: GemmTile | None = None,
        pdl: bool = True,
        facts: DeviceFacts | None = None,
    ) -> None:
        self.chunks = words.shape[1]
        self.n, self.k = words.shape[0] * TILE_N, self.chunks * CHUNK_K
        self.facts = facts or device_facts(words.device)
        self._tile = tile
        # on SM 9.0+ the permutation, the GEMM and the split sum form a programmatic-dependent
        # chain: each launch starts while the one before finishes and waits for it before it
        # reads
        self.pdl = pdl and self.facts.dependent_launches
        self._kappa = KappaOrder(self.k, release_next=self.pdl) if self.facts.compiled else None
        bias_arg = bias if bias is not None else global_scale
        self._gemm_fixed = dict(
            w_ptr=words, s_ptr=scales.view(torch.int16), gs_ptr=global_scale, bias_ptr=bias_arg,
            stride_om=self.n, CHUNKS=self.chunks, HAS_BIAS=bias is not None, PDL=self.pdl,
            SETTLE=self.facts.rs_wgmma_hazard,  # the decoded weight is wgmma's A
            SPC=scale_pairs(scales),
        )  # fmt: skip
        self._sum_fixed = dict(
            gs_ptr=global_scale, bias_ptr=bias_arg, N=self.n, HAS_BIAS=bias is not None,
            BLOCK=_SUM_BLOCK, PDL=self.pdl,
        )  # fmt: skip
        self._pdl_option = {"launch_pdl": True} if self.pdl else {}
        self._plans: dict[tuple[int, torch.dtype, str], _GemmPlan] = {}

    def _plan(self, m: int, dtype: torch.dtype, device: str) -> _GemmPlan:
        tile = self._tile or mma_gemm_config(self.n, self.k, m, tma=self.facts.tma)
        if self.n % tile.block_n or tile.block_n % 16:
            raise ValueError(f"BLOCK_N={tile.block_n} does not divide N={self.n} in 16-row tiles")
        # TMA boxes that run past the activations' last row were slow on the H200
        # (docs/design/wgmma-gemm.md); the copy into the K order is made whole tiles high
        rows = triton.cdiv(m, tile.block_m) * tile.block_m if tile.tma and PAD_TMA_ROWS else m
        ck = tile.chunks
        per_split = triton.cdiv(triton.cdiv(self.chunks, max(1, tile.split)), ck) * ck
        split = triton.cdiv(self.chunks, per_split)
        gemm = Launcher(
            _mma_gemm_kernel,
            ("x_ptr", "out_ptr", "M"),
            dict(
                self._gemm_fixed, PER_SPLIT=per_split, BLOCK_N=tile.block_n,
                BLOCK_M=tile.block_m, CK=ck, SPLIT=split, BF16=dtype == torch.bfloat16,
                DOT_F32=device != "cuda", X_TMA=tile.tma,
            ),
            dict(num_warps=tile.warps, num_stages=tile.stages, maxnreg=tile.maxnreg,
                 **self._pdl_option),
        )  # fmt: skip
        summed = None
        if split > 1:
            summed = Launcher(
                _split_sum_kernel,
                ("ws_ptr", "out_ptr", "MN"),
                dict(self._sum_fixed, SPLIT=split),
                dict(num_warps=4, **self._pdl_option),
            )
        grid = (triton.cdiv(m, tile.block_m) * (self.n // tile.block_n), split)
        plan = _GemmPlan(tile, rows, split, grid, gemm, summed)
        if len(self._plans) > _MAX_PLANS:
            self._plans.clear()
        self._plans[(m, dtype, device)] = plan
        return plan

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        out = torch.empty((m, self.n), dtype=x.dtype, device=x.device)
        if m == 0:
            return out
        if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x must be [M, {self.k}] bf16/fp16, got {x.dtype} {tuple(x.shape)}")
        device = "cuda" if x.is_cuda else x.device.type
        plan = self._plans.get((m, x.dtype, device))
        if plan is None:
            plan = self._plan(m, x.dtype, device)
        if self._kappa is not None and device == "cuda":
            xk = self._kappa(x, plan.rows)
        else:
            xk = kappa_order(x, release_next=self.pdl, rows=plan.rows)
        x_arg: object = _x_descriptor(xk, plan.tile, self.facts) if plan.tile.tma else xk
        if plan.split == 1:
            plan.gemm(plan.grid, x_arg, out, m)
            return out
        partial = torch.empty((plan.split, m, self.n), dtype=torch.float32, device=x.device)
        plan.gemm(plan.grid, x_arg, partial, m)
        assert plan.summed is not None
        plan.summed((triton.cdiv(m * self.n, _SUM_BLOCK),), partial, out, m * self.n)
        return out


@dataclass(frozen=True)
class _GemmPlan:
    """What a call of M rows launches: its tile, the padded rows of the permuted activations,
    the K split, the GEMM's grid and the bound launchers."""

    tile: GemmTile
    rows: int
    split: int
    grid: tuple[int, int]
    gemm: Launcher
    summed: Launcher | None


_SUM_BLOCK = 1024
#: Plans kept per bound GEMM (one per distinct M seen; cleared past this).
_MAX_PLANS = 4096


def mma_gemm(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: GemmTile | None = None,
    pdl: bool = True,
    facts: DeviceFacts | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a weight in the mma16x64 layout (x [M, K] in the 16-bit dtype the
    layout was packed for); out [M, N]. ``pdl`` (default True): the permutation, the GEMM and
    the split sum as programmatic dependent launches where the device has them (False: never).
    ``facts``: x's device (None: asked here). A layer binds :class:`MmaGemm` once instead."""
    facts = facts or device_facts(x.device)
    return MmaGemm(words, scales, global_scale, bias, tile=tile, pdl=pdl, facts=facts)(x)

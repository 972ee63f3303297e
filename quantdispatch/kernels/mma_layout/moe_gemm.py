"""NVFP4 and MXFP4 MoE experts in the ``mma16x64`` layout: every regime on one repacked copy.

Why: the MoE kernels on the checkpoint layout (:mod:`.fp4_mma_ckpt`, :mod:`.fused_moe`) decode
each weight with more instructions than the repacked linear kernels (15 vs 11 integer ops per 8
codes, activation permutes, byte-wise scales), and at few tokens per expert they are issue
bound: on the H200 the same mma.sync design streamed gate_up at M=1 in 32 us from the
checkpoint layout and in 22 us repacked (benchmarks/NOTES.md). Experts used to stay in the
checkpoint layout because their larger-M kernels read it; with the tl.dot GEMM that decodes the
repacked layout (:mod:`.fp4_mma_gemm`) every regime can read the repacked copy, and it holds the
same bytes (no second copy):

* single (token, slot) pairs (4 x pairs <= E: decode): the mma.sync gate/up tiles of
  :mod:`.fp4_mma_ckpt` and a down kernel that also sums the top-k slots
  (:mod:`.fp4_mma_moe_small`: two launches instead of three);
* few tokens per expert: the mma.sync gate/up + down kernels of :mod:`.fp4_mma_ckpt` in their
  REPACKED mode (gate and up tiles of a warp share the activation fragments, activation fused)
  on 8-pair blocks;
* mid: a grouped GEMM (:func:`_moe_gemm_kernel`): expert-sorted blocks of ``block_m`` pairs
  (:func:`.fused_moe.moe_align`) times 64-row weight tiles, the weight decoded into the wgmma A
  operand as in :mod:`.fp4_mma_gemm` (swap AB: weight rows x tokens). Gate/up programs run the
  gate tile and the up tile on the same activation tile (one shared-memory tile feeds both
  dots) and fuse the activation; they write the intermediate with its columns already in the MMA
  K order, so the down GEMM reads it as is (the tokens' own activations are permuted once per
  call, :func:`.fp4_mma_gemm.kappa_order`);
* very many (SM 9.0+ with ``torch._grouped_mm``): each GEMM's experts dequantized to 16-bit
  by the layout's own dequant kernel, then ``torch._grouped_mm`` (as for the checkpoint layout).

Stacked tensors: ``words`` int32 [E, N/16, K/64, 32, 4], ``scales`` uint8 [E, N/16, K/64, 32, 2]
(:func:`repack_experts`; N = 2I for w13, gate tiles then up tiles), ``global_scale`` fp32 [E].
MXFP4 (:func:`repack_experts_mx`): scales [E, N/16, K/64, 16, 2], one pair per group of 32 read
by two lanes, and each expert's scales relative to its own largest (its global scale).
The layout places codes for one 16-bit activation dtype (bf16 or fp16), fixed at repack.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantdispatch.errors import InputError, WeightFormatError, format_error
from quantdispatch.kernels.checkpoint_layout import moe as fused_moe
from quantdispatch.kernels.checkpoint_layout.moe import (
    DequantMoeConfig,
    _activation,
    _check_call,
    _grouped_mm_capable,
    _interpreting,
    _reduce,
    _run_dequant,
    _run_mma,
    moe_align,
)
from quantdispatch.kernels.checkpoint_layout.moe_mma import MmaMoeConfig, mma_moe_config
from quantdispatch.kernels.common.pdl import pdl_capable
from quantdispatch.kernels.common.wgmma_guard import rs_wgmma_hazard, settle
from quantdispatch.kernels.mma_layout.gemm import _weight_tile, kappa_order
from quantdispatch.kernels.mma_layout.layout import (
    CHUNK_K,
    TILE_N,
    mma_dequant_rows,
    repack,
    repack_mx,
    unpack,
)
from quantdispatch.kernels.mma_layout.moe_pairs import SmallMoeConfig, small_moe, small_moe_config
from quantdispatch.moe_math import get_activation

__all__ = [
    "MMA_MAX_TOKENS_PER_EXPERT",
    "MoeDeviceFacts",
    "MoeGemmTile",
    "dequant_experts",
    "describe_moe_config",
    "mma_layout_moe",
    "moe_kernel_ranges",
    "moe_layout_config",
    "moe_layout_supported",
    "moe_plan",
    "repack_experts",
    "repack_experts_mx",
    "unpack_experts",
]

#: Up to this many tokens per expert (M * top_k / E) the mma.sync kernels run; above, the
#: grouped GEMM (its blocks are at least 16 pairs: with fewer tokens per expert most of each
#: wgmma would be padding).
MMA_MAX_TOKENS_PER_EXPERT = 4
#: From this many tokens per expert (SM 9.0+), dequantize + torch._grouped_mm, for experts of at
#: least DEQUANT_MIN_EXPERT_ELEMENTS (I x H). H200 (session 17, moe-sweep-h200-2026-11-30-s17-
#: crossover.json; us, the plan's grouped GEMM tile vs dequantize): Mixtral-8x7B (14336 x 4096)
#: 512 per expert 3687 vs 4114, 640 4502 vs 4636, 768 5408 vs 5309, 896 6229 vs 5864, 1024
#: 7190 vs 6380; Qwen3-30B-A3B (768 x 2048) the GEMM wins at 512 / 768 / 1024 (2155 vs 3967,
#: 3081 vs 5293, 4073 vs 6618: torch._grouped_mm over 128 small experts is slow itself), as it
#: does for gpt-oss-20b (2880 x 2880) at 512 (2431 vs 3325, session 16). (fused_moe's
#: checkpoint-layout kernels keep 512 for all experts: not re-measured.)
DEQUANT_MIN_TOKENS_PER_EXPERT = 768
DEQUANT_MIN_EXPERT_ELEMENTS = 2**25
#: ... as long as the transient 16-bit copy of one GEMM's experts stays below this (bytes).
DEQUANT_MAX_BUFFER_BYTES = 4 * 2**30
#: Small experts (I x H at most DIRECT_MAX_EXPERT_ELEMENTS) run one mma block per (token, slot)
#: pair, no expert sort, up to this many tokens per expert: their blocks of 8 pairs would mostly
#: hold one pair, and the sort is a large part of a small expert's time. H200 (session 16,
#: ksplit-probe-h200-2026-11-30-few*.log; us per layer, one block per pair vs 8-pair blocks):
#: Qwen3-30B-A3B (768 x 2048) M=5 38.6 vs 45.6, M=6 43.8 vs 48.4, M=8 51.5 vs 55.5; 64 experts
#: of 1024 x 2048, top-8, M=3 32.0 vs 38.0, M=4 37.5 vs 42.6. Bigger experts keep the blocks
#: (1536 x 4096 M=8 179.6 vs 160.8; gpt-oss-120b M=12 178.7 vs 167.2).
DIRECT_MAX_TOKENS_PER_EXPERT = 0.5
DIRECT_MAX_EXPERT_ELEMENTS = 1 << 22


def moe_layout_supported(
    inter: int, hidden: int, gated: bool, capability: tuple[int, int] | None
) -> bool:
    """Whether NVFP4 experts are repacked: a gated activation (the kernels pair gate and up
    tiles), SM 8.0+ (bf16 mma.sync), I and H multiples of 64 (whole 64-row GEMM tiles)."""
    return (
        gated
        and capability is not None
        and capability >= (8, 0)
        and inter > 0
        and hidden > 0
        and inter % 64 == 0
        and hidden % 64 == 0
    )


def _stack_buffers(packed: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty repacked stacks for packed uint8 [E, N, K/2]: words int32 [E, N/16, K/64, 32, 4]
    and scales uint8 [E, N/16, K/64, pairs, 2] (32 pairs NVFP4, 16 MXFP4)."""
    e, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    lead = (e, n // TILE_N, k // CHUNK_K)
    words = torch.empty((*lead, 32, 4), dtype=torch.int32, device=packed.device)
    return words, torch.empty((*lead, pairs, 2), dtype=torch.uint8, device=packed.device)


def repack_experts(
    packed: torch.Tensor, block_scale: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked checkpoint tensors (packed uint8 [E, N, K/2], E4M3 block scales [E, N, K/16])
    -> (words int32 [E, N/16, K/64, 32, 4], scales uint8 [E, N/16, K/64, 32, 2]), expert by
    expert on the tensors' device (one expert's temporaries at a time). Same bytes."""
    codes = block_scale.view(torch.uint8)
    words, scales = _stack_buffers(packed, 32)
    for i in range(packed.shape[0]):
        words[i], scales[i] = repack(packed[i], codes[i], act_dtype)
    return words, scales


def repack_experts_mx(
    packed: torch.Tensor, e8m0: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked MXFP4 experts (packed uint8 [E, N, K/2], E8M0 bytes [E, N, K/32]) -> (words
    [E, N/16, K/64, 32, 4], scales uint8 [E, N/16, K/64, 16, 2], global scales fp32 [E]),
    expert by expert (:func:`.fp4_mma.repack_mx`: each expert's scales relative to its own
    largest). Raises WeightFormatError if any expert's scales span more than the layout holds."""
    codes = e8m0.view(torch.uint8)
    words, scales = _stack_buffers(packed, 16)
    gs = torch.empty((packed.shape[0],), dtype=torch.float32, device=packed.device)
    for i in range(packed.shape[0]):
        words[i], scales[i], gs[i] = repack_mx(packed[i], codes[i], act_dtype)
    return words, scales, gs


def unpack_experts(
    words: torch.Tensor, scales: torch.Tensor, act_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_experts`: (packed uint8 [E, N, K/2], E4M3 codes uint8
    [E, N, K/16]); exact except inside zero-scale blocks (their values are 0 either way)."""
    pairs = [unpack(words[i], scales[i], act_dtype) for i in range(words.shape[0])]
    return torch.stack([p for p, _ in pairs]), torch.stack([s for _, s in pairs])


def dequant_experts(
    words: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """All experts of one stacked repacked weight as 16-bit [E, N, K] (natural row and column
    order, each value rounded once)."""
    e, n, k = words.shape[0], words.shape[1] * TILE_N, words.shape[2] * CHUNK_K
    out = fused_moe.empty((e, n, k), dtype, words.device)
    for i in range(e):
        mma_dequant_rows(words[i], scales[i], gs[i], 0, n, out[i])
    return out


@dataclass(frozen=True)
class MoeGemmTile:
    """Grouped GEMM tile: pairs per block, weight rows per program, K chunks (of 64) per step,
    warps, pipeline stages."""

    block_m: int
    block_n: int = 64
    chunks: int = 2
    warps: int = 4
    stages: int = 4

    def shared_bytes(self, gate_up: bool = True) -> int:
        """Shared memory the pipelined loop needs, an upper bound: per stage the activation
        tile (block_m x 64 chunks x 2 B) and the words (32 B per weight row and chunk) and
        scale pairs (4 B) of one weight tile, two for gate/up. (Triton 3.9 compiled for sm_90
        / sm_86 uses 36-96 / 24-64 KB for the four tiles of :func:`moe_layout_config`, this
        says 39-150: it does not always stage the words.)"""
        tiles = 2 if gate_up else 1
        per_stage = self.block_m * 128 * self.chunks + tiles * self.block_n * self.chunks * 36
        return self.stages * per_stage

    def label(self) -> str:
        return f"gemm BM{self.block_m} {self.block_n}x{64 * self.chunks}w{self.warps}s{self.stages}"


#: Opt-in shared memory per block (bytes) by compute capability where torch does not report it:
#: 163 KB on A100 / Orin, 227 KB on Hopper and datacenter Blackwell, 99 KB on the others (RTX
#: 30 / 40 / 50 series, L40S, A10).
_SHARED_BY_CAPABILITY = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): 227 * 1024,
                         (10, 0): 227 * 1024, (10, 3): 227 * 1024}  # fmt: skip
_SHARED_DEFAULT = 99 * 1024
#: Kept free for what the estimate does not count (epilogue layout conversions, barriers).
_SHARED_MARGIN = 8 * 1024


def _max_shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (bytes; no limit off the GPU)."""
    if device.type != "cuda":
        return 227 * 1024
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin:
        return int(optin)
    return _SHARED_BY_CAPABILITY.get((props.major, props.minor), _SHARED_DEFAULT)


def _tile_warps(tile: MoeGemmTile, block_n: int) -> int:
    """Warps for one GEMM of ``tile`` run ``block_n`` rows wide: the tile's warps scale with
    the rows when a GEMM whose N the tile's width does not divide falls back to 64-row tiles
    (8 warps on 64 rows would split the tokens between two warpgroups that decode the same
    weights: gpt-oss-20b, N = 2880, M=1024 1033.6 us against 716.6 with 4; session 16,
    moe-mxfp4-sweep-h200-2026-11-30-s16-wide.json)."""
    return max(4, tile.warps * block_n // tile.block_n)


def _fit_shared(tile: MoeGemmTile, limit: int) -> MoeGemmTile:
    """``tile``, or the largest smaller one whose pipeline fits ``limit`` bytes by the upper
    bound of :meth:`MoeGemmTile.shared_bytes` (the 128-pair tile's is ~150 KB: kept on A100 /
    H100, the 64-pair tile on a 99 KB RTX or L40S, none of which was measured)."""
    smaller = [MoeGemmTile(64, stages=3), MoeGemmTile(32, stages=3), MoeGemmTile(16, stages=3)]
    for t in [tile, *smaller]:
        if t.block_m <= tile.block_m and t.shared_bytes() + _SHARED_MARGIN <= limit:
            return t
    return MoeGemmTile(16, stages=2)


@functools.cache
def _fixed_facts(device: torch.device) -> tuple[bool, int]:
    """(torch._grouped_mm runs there, shared memory per program) of one device, asked once."""
    return _grouped_mm_capable(device), _max_shared_memory(device)


@dataclass(frozen=True)
class MoeDeviceFacts:
    """What the MoE regime takes from the GPU besides the sizes: whether torch._grouped_mm
    runs there (SM 9.0+), the shared memory one program may use, and whether the down kernel is
    a programmatic dependent launch. ``of`` asks the device; ``for_capability`` answers from a
    compute capability alone (doctor's simulated GPUs)."""

    grouped_mm: bool
    shared_bytes: int
    pdl: bool

    @classmethod
    def of(cls, device: torch.device) -> MoeDeviceFacts:
        """Per call (each forward without a config): the fixed facts come from a per-device
        cache; PDL is asked each time (``QUANTDISPATCH_PDL`` may change)."""
        grouped_mm, shared_bytes = _fixed_facts(device)
        return cls(grouped_mm, shared_bytes, pdl_capable(device))

    @classmethod
    def for_capability(cls, capability: tuple[int, int]) -> MoeDeviceFacts:
        from quantdispatch.kernels.common.pdl import HAS_GDC, pdl_enabled

        hopper = capability >= (9, 0)
        return cls(
            hopper and hasattr(torch, "_grouped_mm"),
            _SHARED_BY_CAPABILITY.get(capability, _SHARED_DEFAULT),
            hopper and HAS_GDC and pdl_enabled(),
        )


def moe_layout_config(
    m: int,
    top_k: int,
    experts: int,
    inter: int,
    hidden: int,
    device: torch.device,
    *,
    allow_dequant: bool = True,
) -> SmallMoeConfig | MmaMoeConfig | MoeGemmTile | DequantMoeConfig:
    """:func:`moe_plan` for ``device``."""
    facts = MoeDeviceFacts.of(device)
    return moe_plan(m, top_k, experts, inter, hidden, facts, allow_dequant=allow_dequant)


def moe_plan(
    m: int,
    top_k: int,
    experts: int,
    inter: int,
    hidden: int,
    facts: MoeDeviceFacts,
    *,
    allow_dequant: bool = True,
) -> SmallMoeConfig | MmaMoeConfig | MoeGemmTile | DequantMoeConfig:
    """The regime from the static sizes only (graphs and compile see no data dependence).

    Tokens per expert ``tpe = M * top_k / E``: <= MMA_MAX_TOKENS_PER_EXPERT the mma.sync
    kernels (single pairs when 4 * pairs <= E, with the top-k sum in the down kernel,
    :func:`.fp4_mma_moe_small.small_moe_config`; small experts up to
    DIRECT_MAX_TOKENS_PER_EXPERT one block per pair; else 8-pair blocks); >=
    DEQUANT_MIN_TOKENS_PER_EXPERT on SM 9.0+ dequantize + grouped_mm for experts of
    DEQUANT_MIN_EXPERT_ELEMENTS+ (Mixtral's; smaller experts keep the GEMM); else the grouped
    GEMM, with blocks of 16 / 32 / 64 pairs (64-row weight tiles, 4 warps) and above 96 tokens
    per expert 128 pairs on 128-row tiles (8 warps; 64-row tiles and 4 warps where 128 does
    not divide I or H, e.g. gpt-oss's 2880). From the H200 sweep
    (benchmarks/results/moe-sweep-h200-*.json; us): at 4 per expert the mma kernels win
    (Qwen3 M=64 125 vs 167, DeepSeek-V3 M=128 1952 vs 2409); at 8 it is mixed (Qwen3 163 vs
    172, Mixtral 310 vs 353, DeepSeek-V3 2777 vs 2564) and the GEMM wins the sum; 16 per expert:
    32-pair blocks (Qwen3 M=256 199 vs 229 for 16, 266 for 64); 32: 64 (DeepSeek-V3 M=1024 4229
    vs 4529 for 32); 256: 128 (Mixtral M=1024 1862 vs 2162 for 64). Three stages beat four
    (e.g. Qwen3 M=1024 395 vs 431). With the accumulators settled each K step (SM 9.x,
    :mod:`.wgmma_hazard`; moe-sweep-h200-2026-11-30-settled.json) the same tiles won at 8, 16,
    32, 64 and 256 per expert, and 128 pairs on 128-row tiles already at 128 (DeepSeek-V3
    M=4096 10465 vs 12094 for 64-pair blocks; at 64 per expert 64 still wins: Qwen3 M=1024 397
    vs 464), hence the switch above 96. A tile whose pipeline does not fit the GPU's shared
    memory gives way to a smaller one (:func:`_fit_shared`)."""
    pairs = m * top_k
    tpe = pairs / max(experts, 1)
    buffer = experts * max(2 * inter * hidden, hidden * inter) * 2
    if (
        allow_dequant
        and tpe >= DEQUANT_MIN_TOKENS_PER_EXPERT
        and inter * hidden >= DEQUANT_MIN_EXPERT_ELEMENTS
        and buffer <= DEQUANT_MAX_BUFFER_BYTES
        and facts.grouped_mm
    ):
        return DequantMoeConfig()
    if tpe <= MMA_MAX_TOKENS_PER_EXPERT:
        single = 4 * pairs <= experts  # the top-k sum inside the down kernel
        small = tpe <= DIRECT_MAX_TOKENS_PER_EXPERT and inter * hidden <= DIRECT_MAX_EXPERT_ELEMENTS
        direct = single or small  # one block per pair, no expert sort
        cfg = mma_moe_config(pairs, experts, inter, hidden, direct=direct, repacked=True)
        if single:  # fp4_mma_moe_small, its gate/up tuned as the per-pair mma kernels
            return small_moe_config(
                m, top_k, inter, hidden, cfg.gemm1.wk, cfg.gemm1.unroll, facts.pdl
            )
        return cfg
    if tpe <= 12:
        tile = MoeGemmTile(16, stages=3)
    elif tpe <= 24:
        tile = MoeGemmTile(32, stages=3)
    elif tpe <= 96:
        tile = MoeGemmTile(64, stages=3)
    elif inter % 128 or hidden % 128:  # 128-row tiles would not divide N: 64 rows, 4 warps
        tile = MoeGemmTile(128, block_n=64, warps=4, stages=3)
    else:
        tile = MoeGemmTile(128, block_n=128, warps=8, stages=3)
    return _fit_shared(tile, facts.shared_bytes)


def describe_moe_config(cfg: SmallMoeConfig | MmaMoeConfig | MoeGemmTile | DequantMoeConfig) -> str:
    """doctor's words for one regime and its launch parameters."""
    if isinstance(cfg, SmallMoeConfig):
        return (
            "single (token, slot) pairs: mma.sync gate/up, then a down kernel that also sums "
            f"the top-k slots ({cfg.label()})"
        )
    if isinstance(cfg, MmaMoeConfig):
        g1, g2 = cfg.gemm1, cfg.gemm2
        what = "one per (token, slot) pair" if cfg.direct else f"blocks of {cfg.block_m} pairs"
        return (
            f"mma.sync kernels, {what} (gate/up / down: K split {g1.wk} / {g2.wk} ways, "
            f"{g1.unroll} / {g2.unroll} chunks in flight, {g1.wt} / {g2.wt} tiles a warp)"
        )
    if isinstance(cfg, MoeGemmTile):
        return f"grouped tl.dot GEMM decoding the repacked experts ({cfg.label()})"
    return "experts dequantized per GEMM + torch._grouped_mm"


def moe_kernel_ranges(
    top_k: int, experts: int, inter: int, hidden: int, facts: MoeDeviceFacts,
    max_m: int = 1 << 16,
) -> list[tuple[int, int, str]]:  # fmt: skip
    """(first M, last M, words) for every run of M in 1..max_m that gets the same config from
    :func:`moe_plan`; the last run ends at ``max_m`` (and goes on beyond it)."""
    ranges: list[tuple[int, int, str]] = []
    start, prev = 1, moe_plan(1, top_k, experts, inter, hidden, facts)
    for m in range(2, max_m + 1):
        cfg = moe_plan(m, top_k, experts, inter, hidden, facts)
        if cfg != prev:
            ranges.append((start, m - 1, describe_moe_config(prev)))
            start, prev = m, cfg
    ranges.append((start, max_m, describe_moe_config(prev)))
    return ranges


# --------------------------------------------------------------------------------------------
# the grouped GEMM


@triton.jit
def _tile_pointers(w_ptr, s_ptr, e64, stride_we, stride_se, tile0,
                   CHUNKS: tl.constexpr, BT: tl.constexpr, CK: tl.constexpr,
                   SPC: tl.constexpr):  # fmt: skip
    """Word and scale pointers of BT 16-row tiles from ``tile0`` of expert e, first K step
    (SPC 16, MXFP4: int32 pointers to both scale pairs of a row group, as in
    :func:`.fp4_mma_gemm._mma_gemm_kernel`)."""
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
    accumulators in every step (:func:`.wgmma_hazard.settle`; the Triton < 3.7 wgmma bug)."""
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
        w = _weight_tile(w_ptrs, s_ptrs, c0 + c < CHUNKS, CK, BF16, DOT_F32, EVEN, MX)
        acc = tl.dot(w, xt, acc, input_precision="ieee") if DOT_F32 else tl.dot(w, xt, acc)
        if GATE_UP:
            wu = _weight_tile(w_ptrs + up_w, s_ptrs + up_s, c0 + c < CHUNKS, CK, BF16, DOT_F32,
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
        h = _activation(g, u, alpha, limit, ACT)
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


# --------------------------------------------------------------------------------------------
# host side


def _fail(what: str, rule: str, fix: str, exc: type[Exception] = WeightFormatError) -> None:
    raise exc(format_error(f"mma16x64 MoE: {what}", rule, fix))


def _check_stack(w: Sequence[torch.Tensor], which: str) -> tuple[int, int, int]:
    """(E, N, K) of one stacked repacked weight, checked."""
    if len(w) != 3:
        _fail(f"{which} has {len(w)} tensors", "words, scales and global scales", "")
    words, scales, gs = w
    if words.dtype != torch.int32 or words.dim() != 5 or tuple(words.shape[3:]) != (32, 4):
        _fail(
            f"{which} words are {words.dtype} {tuple(words.shape)}",
            "repacked expert words are int32 [E, N/16, K/64, 32, 4]",
            "build them with fp4_mma_moe.repack_experts (QuantMoE does)",
        )
    e, tiles, chunks = words.shape[:3]
    pairs = scales.shape[3] if scales.dim() == 5 else 0
    if (
        scales.dtype != torch.uint8
        or tuple(scales.shape) != (e, tiles, chunks, pairs, 2)
        or (pairs not in (32, 16))
    ):
        _fail(
            f"{which} scales are {scales.dtype} {tuple(scales.shape)}",
            f"repacked expert scales are uint8 [{e}, {tiles}, {chunks}, 32, 2] (NVFP4) or "
            f"[{e}, {tiles}, {chunks}, 16, 2] (MXFP4)",
            "pass the scales repack_experts / repack_experts_mx returned with these words",
        )
    if gs.dtype != torch.float32 or tuple(gs.shape) != (e,):
        _fail(f"{which} global scales are {gs.dtype} {tuple(gs.shape)}", f"float32 [{e}]", "")
    if not (words.is_contiguous() and scales.is_contiguous()):
        _fail(f"{which} is not contiguous", "repacked stacks are contiguous", "call .contiguous()")
    return e, tiles * TILE_N, chunks * CHUNK_K


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
) -> torch.Tensor:
    """Routed experts on repacked stacks: [M, H] in x.dtype. ``topk_ids`` hold local expert ids
    (others contribute nothing), ``topk_weights`` (float32) are final. ``config`` overrides the
    regime choice (tests and tuning only)."""
    spec = get_activation(activation)
    if not spec.gated:
        _fail(
            f"activation {activation!r}",
            "the repacked MoE kernels run gated activations",
            "keep the checkpoint layout (QuantMoE does for non-gated layers)",
            InputError,
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != packed_for:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        _fail(
            f"x is {got}",
            f"x is [M, H] in {packed_for} (the layout places codes for one 16-bit dtype)",
            f"pass {packed_for} activations",
            InputError,
        )
    e, n13, hidden = _check_stack(w13, "w13")
    e2, n2, inter = _check_stack(w2, "w2")
    if e2 != e or n13 != 2 * inter or n2 != hidden or x.shape[1] != hidden:
        _fail(
            f"w13 is [E={e}, N={n13}, K={hidden}], w2 [E={e2}, N={n2}, K={inter}], x "
            f"{tuple(x.shape)}",
            "w13 is [E, 2I, H], w2 [E, H, I] and x [M, H]",
            "pass the weights that belong to this layer",
        )
    m = x.shape[0]
    top_k = _check_call(x, topk_ids, topk_weights, e, n13, n2, w13_bias, w2_bias, w13[0], w2[0])
    out = fused_moe.empty((m, hidden), x.dtype, x.device)
    if m == 0:
        return out
    x = x if x.is_contiguous() else x.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    tw = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    alpha, limit = 0.0, 0.0
    if spec.name == "swiglu_oai":
        alpha, limit = (tuple(params) or spec.default_params)[:2]
    cfg = config or moe_layout_config(m, top_k, e, inter, hidden, x.device)
    pairs = m * top_k
    if isinstance(cfg, DequantMoeConfig):
        if not _grouped_mm_capable(x.device):
            _fail(f"a dequantize config on {x.device}", "needs torch._grouped_mm on SM 9.0+",
                  "leave config=None", InputError)  # fmt: skip
        _run_dequant(
            x, ids, tw, e,
            lambda: dequant_experts(*w13, x.dtype), lambda: dequant_experts(*w2, x.dtype),
            w13_bias, w2_bias, spec.code, True, alpha, limit, out,
        )  # fmt: skip
        return out
    if isinstance(cfg, SmallMoeConfig):
        if _interpreting() or x.device.type != "cuda":
            _fail(f"config {cfg.label()} off a CUDA GPU", "the single-pair kernels are PTX",
                  "use a GEMM config (MoeGemmTile) under the interpreter", InputError)  # fmt: skip
        if cfg.pdl and not pdl_capable(x.device):
            _fail(f"config {cfg.label()} on {x.device}",
                  "a programmatic dependent launch needs SM 9.0+ and Triton's grid dependency "
                  "control", "use pdl=False", InputError)  # fmt: skip
        small_moe(x, ids, tw, tuple(w13), tuple(w2), w13_bias, w2_bias, spec.code,  # type: ignore[arg-type]
                  alpha, limit, cfg, out, inter)  # fmt: skip
        return out
    if isinstance(cfg, MmaMoeConfig):
        if _interpreting() or x.device.type != "cuda":
            _fail("an mma.sync config off a CUDA GPU", "the mma kernels are PTX",
                  "use a GEMM config (MoeGemmTile) under the interpreter", InputError)  # fmt: skip
        _run_mma(x, ids, tw, tuple(w13), tuple(w2), w13_bias, w2_bias, spec.code,  # type: ignore[arg-type]
                 alpha, limit, cfg, out, inter)  # fmt: skip
        return out
    if not isinstance(cfg, MoeGemmTile) or cfg.block_m % 16 or cfg.block_n % 64:
        _fail(f"config {cfg!r}", "MoeGemmTile with block_m a multiple of 16, block_n of 64",
              "leave config=None", InputError)  # fmt: skip
    bm = cfg.block_m
    sorted_ids, block_expert, num_blocks = moe_align(ids, e, bm)
    n_blocks = block_expert.shape[0]
    a = fused_moe.empty((n_blocks * bm, inter), x.dtype, x.device)
    y = fused_moe.empty((pairs, hidden), x.dtype, x.device)
    common = dict(
        sorted_ptr=sorted_ids, bexp_ptr=block_expert, nvalid_ptr=num_blocks, tw_ptr=tw,
        T=pairs, top_k=top_k, n_blocks=n_blocks, alpha=float(alpha), limit=float(limit),
        BLOCK_M=bm, CK=cfg.chunks, ACT=spec.code, BF16=x.dtype == torch.bfloat16,
        DOT_F32=_interpreting(), num_stages=cfg.stages,
        SETTLE=rs_wgmma_hazard(x.device) and not _interpreting(),  # the weight is wgmma's A
        SPC=w13[1].shape[3],  # 32 NVFP4, 16 MXFP4 scale pairs per tile and chunk
    )  # fmt: skip
    bn13 = cfg.block_n if inter % cfg.block_n == 0 else 64
    w, s, g = w13[0], w13[1].view(torch.int16), w13[2]  # scale pairs as one 16-bit load
    _moe_gemm_kernel[(n_blocks * (inter // bn13),)](
        x_ptr=kappa_order(x), w_ptr=w, s_ptr=s, gs_ptr=g,
        bias_ptr=w13_bias if w13_bias is not None else g, out_ptr=a, up_tiles=inter // TILE_N,
        stride_xm=hidden, stride_we=w.stride(0), stride_se=s.stride(0),
        stride_be=w13_bias.stride(0) if w13_bias is not None else 0, stride_om=a.stride(0),
        CHUNKS=hidden // CHUNK_K, BLOCK_N=bn13, GATE_UP=True, HAS_BIAS=w13_bias is not None,
        num_warps=_tile_warps(cfg, bn13), **common,
    )  # fmt: skip
    bn2 = cfg.block_n if hidden % cfg.block_n == 0 else 64
    w, s, g = w2[0], w2[1].view(torch.int16), w2[2]
    _moe_gemm_kernel[(n_blocks * (hidden // bn2),)](
        x_ptr=a, w_ptr=w, s_ptr=s, gs_ptr=g,
        bias_ptr=w2_bias if w2_bias is not None else g, out_ptr=y, up_tiles=0,
        stride_xm=a.stride(0), stride_we=w.stride(0), stride_se=s.stride(0),
        stride_be=w2_bias.stride(0) if w2_bias is not None else 0, stride_om=y.stride(0),
        CHUNKS=inter // CHUNK_K, BLOCK_N=bn2, GATE_UP=False, HAS_BIAS=w2_bias is not None,
        num_warps=_tile_warps(cfg, bn2), **common,
    )  # fmt: skip
    _reduce(y, ids, out, e)
    return out

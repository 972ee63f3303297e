"""The align stage of a MoE call: (token, slot) pairs grouped by expert, each group padded to
whole blocks (the tl.dot, mma.sync and grouped-GEMM experts of both layouts read them).

The M * top_k pairs are grouped by expert and each expert's group is padded to a multiple of
``block_m``, written into a worst-case-sized buffer (``max_blocks * block_m`` entries, pads hold
the sentinel T), with one expert id per block and the number of used blocks in a one-element
device tensor. One Triton program does it when all pairs fit one chunk (a one-hot [chunk, E]
matrix: counts are its column sums, the rank of a pair inside its expert its column prefix
sum); bigger inputs take three launches (per-chunk counts, one program turning them into
offsets, per-chunk scatter). Ids outside [0, E) (experts another rank holds, -1) get no slot at
all. Shapes depend only on (M, top_k, E, block_m); no host synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.launch import launch

__all__ = ["BlockRouting", "max_blocks_for", "moe_align", "route_blocks"]


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
    sorted_ids = checks.empty((max_blocks * block_m,), torch.int32, dev)
    block_expert = checks.empty((max_blocks,), torch.int32, dev)
    num_blocks = checks.empty((1,), torch.int32, dev)
    e_pad = triton.next_power_of_2(max(num_experts, 2))
    ch = _chunk(pairs, e_pad)
    chb = max(16, min(triton.next_power_of_2(max_blocks), max(16, 16384 // e_pad)))
    n_chunks = triton.cdiv(pairs, ch)
    if n_chunks <= 1:
        launch(_align_single_kernel, (1,),
            ids, sorted_ids, block_expert, num_blocks, pairs, num_experts, max_blocks,
            BM=block_m, CH=ch, E_PAD=e_pad, CHB=chb, num_warps=4,
        )  # fmt: skip
    else:
        part = checks.empty((2, n_chunks, e_pad), torch.int32, dev)  # counts, then bases
        launch(
            _align_count_kernel, (n_chunks,), ids, part[0], pairs, num_experts, CH=ch, E_PAD=e_pad
        )
        launch(_align_offsets_kernel, (1,),
            part[0], part[1], sorted_ids, block_expert, num_blocks, pairs, n_chunks, max_blocks,
            BM=block_m, E_PAD=e_pad, CHB=chb, num_warps=4,
        )  # fmt: skip
        launch(_align_scatter_kernel, (n_chunks,),
            ids, part[1], sorted_ids, pairs, num_experts, CH=ch, E_PAD=e_pad
        )
    return sorted_ids, block_expert, num_blocks


@dataclass(frozen=True)
class BlockRouting:
    """The align stage's result for one call: ``n_blocks`` blocks of ``block_m`` pair slots.
    Sorted: ``sorted_ids`` / ``block_expert`` / ``num_blocks`` of :func:`moe_align`. ``direct``:
    one block per (token, slot) pair (``block_m`` 1), the expert read from ``topk_ids``, which
    the three fields then hold (the direct kernels never read them)."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    n_blocks: int
    block_m: int
    direct: bool


def route_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, direct: bool
) -> BlockRouting:
    """The pairs of ``topk_ids`` [M, top_k] in blocks for the expert GEMMs: one per pair when
    ``direct`` (no launch), else expert-sorted blocks of ``block_m`` (:func:`moe_align`)."""
    if direct:
        return BlockRouting(topk_ids, topk_ids, topk_ids, topk_ids.numel(), 1, True)
    sorted_ids, block_expert, num_blocks = moe_align(topk_ids, num_experts, block_m)
    return BlockRouting(sorted_ids, block_expert, num_blocks, block_expert.shape[0], block_m, False)

"""A MoE call as stages, shared by every kernel family of both layouts.

1. **prepare** (:func:`prepare_inputs`): the routing tensors checked against x and the weights,
   made contiguous, the activation resolved to kernel arguments
   (:func:`.moe_activations.activation_args`).
2. **align** (:func:`.moe_align.route_blocks`): the (token, slot) pairs in expert-sorted blocks of
   the experts' ``block_m`` pairs, or one block per pair (``direct``).
3. **experts** (:class:`MoeExperts`): one object per kernel family, holding the stacked weights
   and the plan's config: :meth:`~MoeExperts.workspace_shapes` sizes the intermediate and the
   per-pair output, :meth:`~MoeExperts.apply` runs the gate/up GEMM with the activation fused and
   the down GEMM with the routing weights applied.
4. **finalize** (:func:`moe_reduce`): out[t] = the fp32 sum of token t's valid slot rows
   (deterministic: no atomics), cast to x.dtype; slots with ids outside [0, E) are skipped.

Experts that route and sum by themselves (``whole_call``: the dequantize + grouped-GEMM path, the
single-pair kernels whose down kernel sums the slots) skip stages 2 and 4. :func:`run_stages`
runs the stages; each layout's launcher validates its stacks and picks the experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.checks import check_moe_call
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.common.moe_activations import ActivationArgs
from quantdispatch.kernels.common.moe_align import BlockRouting, route_blocks

__all__ = [
    "ExpertWeights",
    "MoeExperts",
    "MoeInputs",
    "MoeWork",
    "moe_reduce",
    "prepare_inputs",
    "run_stages",
]


@dataclass(frozen=True)
class MoeInputs:
    """One checked call: x [M, H] 16-bit, ``ids`` [M, top_k] local expert ids (others contribute
    nothing) and ``tw`` float32 [M, top_k] final routing weights, all contiguous as the kernels
    need; ``experts`` (E) held by this layer; ``act`` the activation's kernel arguments."""

    x: torch.Tensor
    ids: torch.Tensor
    tw: torch.Tensor
    experts: int
    act: ActivationArgs

    @property
    def m(self) -> int:
        return self.x.shape[0]

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]

    @property
    def pairs(self) -> int:
        return self.ids.numel()

    @property
    def hidden(self) -> int:
        return self.x.shape[1]


def prepare_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act: ActivationArgs,
    stacks: tuple[int, int, int, torch.Tensor, torch.Tensor],
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    *,
    whole_x: bool,
) -> MoeInputs:
    """The prepare stage (x already checked as [M, H] 16-bit): routing and biases checked
    against ``stacks`` = (E, N of w13, N of w2, w13's and w2's first tensors, for their
    devices). ``whole_x``: x made contiguous, else only its rows' elements (row stride kept)."""
    experts, n13, n2, c13, c2 = stacks
    check_moe_call(x, topk_ids, topk_weights, experts, n13, n2, w13_bias, w2_bias, c13, c2)
    dense = x.is_contiguous() if whole_x else x.stride(1) == 1
    return MoeInputs(
        x if dense else x.contiguous(),
        topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous(),
        topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous(),
        experts,
        act,
    )


class ExpertWeights(NamedTuple):
    """One layer's two expert stacks (each the layout's tuple of tensors) and their float32
    biases ([E, N] or None), as an experts class takes them."""

    w13: Any
    w2: Any
    b13: torch.Tensor | None
    b2: torch.Tensor | None


@dataclass(frozen=True)
class MoeWork:
    """What the runner hands the experts: the call's output, and (unless ``whole_call``) the
    align stage's blocks, the intermediate ``a`` and the per-pair output ``y``."""

    out: torch.Tensor
    blocks: BlockRouting | None = None
    a: torch.Tensor | None = None
    y: torch.Tensor | None = None

    def buffers(self) -> tuple[BlockRouting, torch.Tensor, torch.Tensor]:
        """(blocks, a, y) of a call that went through the align stage."""
        assert self.blocks is not None and self.a is not None and self.y is not None
        return self.blocks, self.a, self.y


class MoeExperts:
    """One kernel family's two expert GEMMs over one layer's stacks, with the plan's config.

    ``block_m`` / ``direct``: the blocks the align stage makes for it; ``inter``: I, the
    intermediate's width. ``whole_call``: :meth:`apply` routes the pairs and writes ``out``
    itself (no align, no workspace, no reduce stage)."""

    block_m: int = 1
    direct: bool = False
    whole_call: bool = False
    inter: int = 0

    def workspace_shapes(
        self, inp: MoeInputs, blocks: BlockRouting
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """(intermediate, per-pair output) shapes: one intermediate row per block slot (pads
        included), one output row per (token, slot) pair."""
        return (blocks.n_blocks * blocks.block_m, self.inter), (inp.pairs, inp.hidden)

    def apply(self, inp: MoeInputs, work: MoeWork) -> None:
        """Gate/up into ``work.a`` then down into ``work.y`` (``whole_call``: everything into
        ``work.out``)."""
        raise NotImplementedError


def run_stages(experts: MoeExperts, inp: MoeInputs, out: torch.Tensor) -> torch.Tensor:
    """align -> experts -> finalize for a prepared call with M > 0; returns ``out`` [M, H]."""
    if experts.whole_call:
        experts.apply(inp, MoeWork(out))
        return out
    blocks = route_blocks(inp.ids, inp.experts, experts.block_m, experts.direct)
    a_shape, y_shape = experts.workspace_shapes(inp, blocks)
    a = checks.empty(a_shape, inp.x.dtype, inp.x.device)
    y = checks.empty(y_shape, inp.x.dtype, inp.x.device)
    experts.apply(inp, MoeWork(out, blocks, a, y))
    moe_reduce(y, inp.ids, out, inp.experts)
    return out


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


def moe_reduce(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, experts: int) -> None:
    """The finalize stage: out[t] = the sum of token t's valid slot rows of y."""
    m, hidden = out.shape
    top_k = ids.shape[1]
    bnr = min(1024, triton.next_power_of_2(hidden))
    launch(_moe_reduce_kernel, (m, triton.cdiv(hidden, bnr)),
        y, ids, out, hidden, experts, top_k, y.stride(0), out.stride(0),
        TOPK_P=triton.next_power_of_2(max(top_k, 2)), BN=bnr, num_warps=4,
    )  # fmt: skip

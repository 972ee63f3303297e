"""Routed experts on a provider's Marlin MoE GEMM (vLLM's ``_moe_C.moe_wna16_marlin_gemm``).

The provider op is one grouped GEMM: rows of a [tokens * top_k, N] output, grouped by expert
in blocks of ``moe_block_size`` rows (``sorted_token_ids``: flattened (token, slot) indices,
padded per expert with the value tokens * top_k; ``expert_ids``: the expert of every block;
``num_tokens_past_padded``: the padded total). The first GEMM reads input row ``id // top_k``,
the second (top_k = 1) reads row ``id``. Everything around the two GEMMs is ours, in torch:
the block alignment (no host sync, so CUDA graphs capture it), the biases, the activation, and
the routing weights, applied once in float32 (the provider's ``mul_topk_weights`` stays off;
routed scaling is already in the weights QuantMoE computed) by the finalize stage the MoE paths
without the Triton reduce share (:mod:`quantdispatch.kernels.common.moe_finalize`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from quantdispatch.backends.marlin_contract import (
    FLOAT4_E2M1F_ID,
    encode_nvfp4_scales,
    gptq_order,
    nvfp4_global_scale,
    nvfp4_scale_factor,
    pad_rows_cols,
    permute_scales,
)
from quantdispatch.backends.marlin_table import Contract, Schema
from quantdispatch.kernels.common.moe_finalize import local_pairs, weight_and_sum

__all__ = ["MarlinExperts", "align_tokens", "block_size_for", "prepare_stack", "run_moe"]

#: Row-block sizes the MoE kernel is built for.
MOE_BLOCK_SIZES = (8, 16, 32, 48, 64)


def block_size_for(tokens: int, top_k: int, experts: int) -> int:
    """The smallest block that is not mostly full of one expert's rows (vLLM's heuristic:
    stop at the first size with tokens * top_k / experts / size < 0.9)."""
    for size in MOE_BLOCK_SIZES:
        if tokens * top_k / max(experts, 1) / size < 0.9:
            return size
    return MOE_BLOCK_SIZES[-1]


def align_tokens(
    topk_ids: torch.Tensor, experts: int, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_past_padded) for ids [M, k]; ids outside
    [0, experts) (another rank's experts, -1) are left out: no block computes them."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    valid = (flat >= 0) & (flat < experts)
    key = torch.where(valid, flat, torch.full_like(flat, experts))
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:experts] + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - run_start[sorted_key]
    cap = n + min(n, experts) * (block - 1)
    dest = torch.where(
        sorted_key < experts,
        starts[sorted_key.clamp(max=experts - 1)] + rank,
        torch.full_like(rank, cap),
    )
    sorted_ids = torch.full((cap + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, cap, block, device=dev)
    owner = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(owner < experts, owner, torch.full_like(owner, -1))
    total = ends[-1:].to(torch.int32) if experts else torch.zeros(1, dtype=torch.int32)
    return sorted_ids[:cap].contiguous(), expert_ids.to(torch.int32), total


def prepare_stack(
    fmt: str,
    tensors: Sequence[torch.Tensor],
    act_dtype: torch.dtype,
    repack,
    *,
    rows: int,
    k_pad: int,
    shards: int,
) -> list[torch.Tensor]:
    """One canonical expert stack (packed [E, N, K/2], scales [E, N, K/g] (, global [E])) in
    Marlin's form: each of the ``shards`` row blocks (gate, up) zero-padded to ``rows`` rows,
    K zero-padded to ``k_pad``; per expert repacked, scales permuted and (NVFP4) encoded with
    that expert's own power-of-two factor folded into its per-tensor scale."""
    group = 16 if fmt == "nvfp4" else 32
    packed, block_scale = tensors[0], tensors[1].view(torch.uint8)
    e, n = packed.shape[:2]

    def pad(t: torch.Tensor, cols: int) -> torch.Tensor:
        parts = t.reshape(e, shards, n // shards, t.shape[-1])
        return pad_rows_cols(parts, rows, cols).reshape(e, shards * rows, cols)

    codes = pad(packed, k_pad // 2)
    scales = pad(block_scale, k_pad // group)
    qweights, scale_out, globals_out = [], [], []
    for i in range(e):
        qweights.append(repack(gptq_order(codes[i]), k_pad, shards * rows))
        s = permute_scales(scales[i].t().contiguous())
        if fmt == "mxfp4":
            scale_out.append(s)
            continue
        e4m3 = s.view(torch.float8_e4m3fn)
        factor = nvfp4_scale_factor(e4m3, act_dtype)
        scale_out.append(encode_nvfp4_scales(e4m3, act_dtype, factor))
        globals_out.append(nvfp4_global_scale(tensors[2][i], act_dtype, factor))
    out = [torch.stack(qweights)]
    if fmt == "mxfp4":
        out.append(torch.stack(scale_out).view(torch.float8_e8m0fnu))
    else:
        out.append(torch.stack(scale_out).view(torch.float8_e4m3fn))
        out.append(torch.cat(globals_out).contiguous())
    return out


class Route(NamedTuple):
    """The align stage's result in the provider's terms, with what every GEMM call repeats."""

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_past_padded: torch.Tensor
    topk_weights: torch.Tensor
    block: int
    top_k: int


def _call(
    contract: Contract,
    a: torch.Tensor,
    c: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    workspace: torch.Tensor,
    route: Route,
    top_k: int,
    size_m: int,
    size_n: int,
    size_k: int,
) -> torch.Tensor:
    op = contract.op("moe")
    head = (a, c, qweight, None, scales, None, global_scale, None)
    mid = (*route[:3], route.topk_weights, route.block, top_k, False, FLOAT4_E2M1F_ID, size_m,
           size_n, size_k)  # fmt: skip
    tail = (False, True, False, -1, -1, -1)  # no atomic add, fp32 reduce, no float zp, auto
    if contract.schema is Schema.MARLIN_GEMM:
        return op(*head, workspace, *mid, *tail)
    if contract.schema is Schema.MARLIN_GEMM_GIDX:
        return op(*head, None, None, workspace, *mid, True, *tail)
    raise NotImplementedError(f"no MoE binding for the {contract.schema.value} schema")


class MarlinExperts:
    """The experts stage on Marlin: both expert GEMMs on the provider's grouped GEMM, the first
    GEMM's bias and the activation between them in torch (the activation contract of
    :mod:`quantdispatch.moe.activations`). ``w13`` / ``w2``: (qweight, scales[, global],
    workspace) from :func:`prepare_stack`, I padded to ``inter_pad``."""

    def __init__(
        self,
        contract: Contract,
        w13: Sequence[torch.Tensor],
        w2: Sequence[torch.Tensor],
        *,
        inter: int,
        inter_pad: int,
        gated: bool,
    ) -> None:
        self.contract, self.w13, self.w2 = contract, w13, w2
        self.inter, self.inter_pad, self.shards = inter, inter_pad, 2 if gated else 1
        self.nvfp4 = len(w13) == 4

    def workspace_shapes(
        self, pairs: int, hidden: int
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """(first GEMM's output, per-pair output) shapes, one row per (token, slot) pair."""
        return (pairs, self.shards * self.inter_pad), (pairs, hidden)

    def _gemm(self, w: Sequence[torch.Tensor], a: torch.Tensor, c: torch.Tensor,
              route: Route, top_k: int) -> torch.Tensor:  # fmt: skip
        """c [rows, N] = the grouped GEMM of a's rows (a row per token when ``top_k`` is the
        layer's, per pair when 1) by the blocks' experts."""
        return _call(self.contract, a, c, w[0], w[1], w[2] if self.nvfp4 else None, w[-1],
                     route, top_k, a.shape[0], c.shape[1], a.shape[1])  # fmt: skip

    def apply(
        self,
        x: torch.Tensor,
        route: Route,
        expert: torch.Tensor,
        w13_bias: torch.Tensor | None,
        activation: str,
        params: Sequence[float],
    ) -> torch.Tensor:
        """Per-pair expert outputs [M * top_k, H] in x.dtype (routing weights not applied);
        ``expert``: each pair's expert id, foreign ones sent to 0 (their rows are dropped by
        the finalize stage)."""
        from quantdispatch.moe.activations import apply_activation

        pairs = expert.numel()
        h_shape, y_shape = self.workspace_shapes(pairs, x.shape[1])
        h = torch.zeros(h_shape, dtype=x.dtype, device=x.device)
        h = self._gemm(self.w13, x.contiguous(), h, route, route.top_k)
        hf = h.float().reshape(pairs, self.shards, self.inter_pad)[:, :, : self.inter]
        hf = hf.reshape(pairs, -1)
        if w13_bias is not None:
            hf = hf + w13_bias.float()[expert]
        act = apply_activation(hf, activation, params)
        if self.inter_pad != self.inter:
            act = torch.nn.functional.pad(act, (0, self.inter_pad - self.inter))
        y = torch.zeros(y_shape, dtype=x.dtype, device=x.device)
        return self._gemm(self.w2, act.to(x.dtype).contiguous(), y, route, 1)


def run_moe(
    contract: Contract,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    params: Sequence[float],
    *,
    inter: int,
    inter_pad: int,
    gated: bool,
) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * expert_{id[t, k]}(x[t]) with both expert GEMMs on Marlin:
    align (:func:`align_tokens`), :class:`MarlinExperts`, then the shared finalize
    (:func:`..kernels.common.moe_finalize.weight_and_sum`: second bias, routing weights,
    fp32 top-k sum)."""
    m, top_k = topk_ids.shape
    experts = w13[0].shape[0]
    block = block_size_for(m, top_k, experts)
    weights = topk_weights.to(torch.float32).contiguous()
    route = Route(*align_tokens(topk_ids, experts, block), weights, block, top_k)
    _, expert = local_pairs(topk_ids, experts)
    stage = MarlinExperts(contract, w13, w2, inter=inter, inter_pad=inter_pad, gated=gated)
    y = stage.apply(x, route, expert, w13_bias, activation, params)
    return weight_and_sum(y, topk_ids, weights, experts, w2_bias).to(x.dtype)

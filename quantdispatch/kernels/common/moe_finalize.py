"""The MoE stages in plain torch, for the experts that do not go through the Triton reduce of
:mod:`.moe_stages`: which (token, slot) pairs this layer holds, and the finalize stage that
applies the routing weights and sums each token's slots in fp32. The dequantize + grouped-GEMM
experts (:mod:`.moe_dequant`) and the Marlin backend's MoE share them. No triton import.
"""

from __future__ import annotations

import torch

__all__ = ["local_pairs", "weight_and_sum"]


def local_pairs(topk_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, expert) per flattened pair of ``topk_ids`` [M, top_k]: whether its id is one of
    this layer's [0, E) (others: experts another rank holds, -1), and the id as int64 with the
    others sent to expert 0 (a safe index; their weight is zeroed by :func:`weight_and_sum`)."""
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < experts)
    return valid, torch.where(valid, flat, 0)


def weight_and_sum(
    rows: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The finalize stage: ``rows`` [M * top_k, H] (one per pair, in pair order) in fp32, plus
    the pair's expert ``bias`` [E, H], times its routing weight (0 for pairs this layer does not
    hold), summed over each token's slots: fp32 [M, H]."""
    m, top_k = topk_ids.shape
    valid, expert = local_pairs(topk_ids, experts)
    y = rows.float()
    if bias is not None:
        y = y + bias.float()[expert]
    weight = torch.where(valid, topk_weights.reshape(-1).float(), 0.0)
    return (y * weight[:, None]).view(m, top_k, -1).sum(1)

"""MoE routing: router logits -> (global expert ids, final weights), and which experts a layer
holds.

:func:`route` takes softmax or sigmoid scores, optional DeepSeek grouped top-k
(``e_score_correction_bias`` is used to choose, never as a weight), optional renormalization,
and applies the routed scaling factor exactly once, here. Expert parallelism: a layer may hold
a subset of the experts; pairs routed to experts it does not hold contribute nothing (their
local id is -1), so the sum over ranks is the full layer. Precomputed ids outside
[0, num_experts) are checked on the host in eager mode (``validate_ids``); where they are not
(capture, compile, ``validate_ids=False``) they contribute nothing, never another expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from quantdispatch.errors import CheckpointError, ConfigurationError, InputError, format_error

__all__ = [
    "RoutingConfig",
    "Scoring",
    "build_expert_map",
    "check_topk",
    "held_experts",
    "route",
    "to_local_ids",
]

Scoring = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become (expert ids, weights); see :func:`route`."""

    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def check(self, num_experts: int) -> None:
        """Shape rules, on host integers only (no device synchronization)."""
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigurationError(
                format_error(
                    f"unknown router scoring {self.scoring!r}",
                    "scoring is 'softmax' (Qwen, Mixtral, gpt-oss) or 'sigmoid' (DeepSeek-V3)",
                    "pass the model config's scoring_func",
                )
            )
        if not isinstance(self.top_k, int) or self.top_k < 1 or self.top_k > num_experts:
            raise ConfigurationError(
                format_error(
                    f"top_k={self.top_k!r} with {num_experts} experts",
                    "each token picks 1 <= top_k <= num_experts distinct experts",
                    "pass the model config's num_experts_per_tok and num_experts",
                )
            )
        if (self.n_group is None) != (self.topk_group is None):
            raise ConfigurationError(
                format_error(
                    f"n_group={self.n_group} but topk_group={self.topk_group}",
                    "grouped top-k needs both (DeepSeek: n_group=8, topk_group=4)",
                    "pass both or neither",
                )
            )
        if self.n_group is not None and self.topk_group is not None:
            ng, tg = self.n_group, self.topk_group
            if ng < 1 or num_experts % ng or not 1 <= tg <= ng:
                raise ConfigurationError(
                    format_error(
                        f"n_group={ng}, topk_group={tg} with {num_experts} experts",
                        "n_group divides the expert count and 1 <= topk_group <= n_group",
                        "pass the model config's values",
                    )
                )
            if self.top_k > tg * (num_experts // ng):
                raise ConfigurationError(
                    format_error(
                        f"top_k={self.top_k} but the {tg} chosen groups hold only "
                        f"{tg * (num_experts // ng)} experts",
                        "top_k <= topk_group * experts per group",
                        "check n_group / topk_group / top_k",
                    )
                )
        f = self.routed_scaling_factor
        if not isinstance(f, (int, float)) or not f > 0 or f != f or f == float("inf"):
            raise ConfigurationError(
                format_error(
                    f"routed_scaling_factor={f!r}",
                    "it is a finite positive number (1.0 = none)",
                    "pass the model config's routed_scaling_factor",
                )
            )


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: Scoring = "softmax",
    renormalize: bool = False,
    n_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [M, E] -> (global expert ids int32 [M, top_k], weights float32 [M, top_k]).

    * scores = softmax(logits) or sigmoid(logits), in float32;
    * choice = scores + e_score_correction_bias (if given: it only steers the choice);
    * grouped top-k (n_group, topk_group): experts split into n_group groups, a group scores
      the sum of its top 2 choice values (its max without a correction bias), only the experts
      of the best topk_group groups stay eligible;
    * ids = top_k of choice; weights = scores at those ids (never the biased values);
    * renormalize: weights / their sum (softmax + renormalize = softmax over the top-k
      logits: Mixtral, Qwen, gpt-oss);
    * weights *= routed_scaling_factor, exactly once (the weights are final: backends never
      scale again).

    Static shapes, no host synchronization: safe in CUDA graphs and torch.compile.
    """
    if router_logits.dim() != 2:
        raise InputError(
            format_error(
                f"router_logits has shape {tuple(router_logits.shape)}",
                "router logits are [tokens, num_experts]",
                "flatten leading dimensions first",
            )
        )
    m, num_experts = router_logits.shape
    cfg = RoutingConfig(top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor)
    cfg.check(num_experts)
    logits = router_logits.to(torch.float32)
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores
    if e_score_correction_bias is not None:
        if tuple(e_score_correction_bias.shape) != (num_experts,):
            raise InputError(
                format_error(
                    f"e_score_correction_bias has shape {tuple(e_score_correction_bias.shape)}",
                    f"it has one value per expert: ({num_experts},)",
                    "pass the router's e_score_correction_bias",
                )
            )
        choice = scores + e_score_correction_bias.to(torch.float32)
    if n_group is not None and topk_group is not None and n_group > 1:
        per = num_experts // n_group
        grouped = choice.view(m, n_group, per)
        if e_score_correction_bias is not None and per >= 2:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand(m, n_group, per).reshape(m, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * float(routed_scaling_factor)
    return ids.to(torch.int32), weights


def to_local_ids(global_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global expert ids -> this layer's local ids (-1 for experts it does not hold).

    Ids outside [0, num_experts) (-1 for a dropped pair, or garbage) are "no expert" and
    contribute nothing, without a device sync (so also under CUDA graphs and torch.compile,
    where ``validate_ids`` cannot look at the values): the map has one extra last entry -1 and
    ids are clamped to [-1, num_experts], so every invalid id lands on a -1. Without a map the
    ids go to the backends as they are, and every backend skips ids outside [0, E)."""
    if expert_map is None:
        return global_ids
    last = expert_map.shape[0] - 1
    return expert_map[global_ids.to(torch.long).clamp(-1, last)]


def held_experts(expert_ids: Sequence[int] | torch.Tensor | None, e: int, total: int) -> list[int]:
    """The global ids of the ``e`` experts a layer holds, in local order (default: all)."""
    if expert_ids is None:
        if e != total:
            raise CheckpointError(
                format_error(
                    f"the layer holds {e} experts but num_experts={total}",
                    "holding a subset (expert parallelism) needs the global ids held",
                    "pass expert_ids=[...] (global ids, in local order)",
                )
            )
        return list(range(e))
    ids = [
        int(i)
        for i in (expert_ids.tolist() if isinstance(expert_ids, torch.Tensor) else expert_ids)
    ]
    if len(ids) != e:
        raise CheckpointError(
            format_error(
                f"expert_ids lists {len(ids)} experts but the weights hold {e}",
                "one global id per expert held, in local order",
                "pass the ids of the experts whose weights you passed",
            )
        )
    bad = [i for i in ids if not 0 <= i < total]
    if bad or len(set(ids)) != len(ids):
        raise ConfigurationError(
            format_error(
                f"expert_ids {ids[:8]}{'...' if len(ids) > 8 else ''} has out-of-range "
                f"({bad[:4]}) or repeated ids",
                f"distinct global ids in [0, num_experts={total})",
                "pass this rank's expert ids",
            )
        )
    return ids


def build_expert_map(
    held: Sequence[int], num_experts: int, device: torch.device
) -> torch.Tensor | None:
    """Global id -> local id (int32 [num_experts + 1], -1 where not held; the last entry, -1,
    catches invalid ids: :func:`to_local_ids`); None when all are held in global order."""
    if list(held) == list(range(num_experts)):
        return None
    mapping = torch.full((num_experts + 1,), -1, dtype=torch.int32)
    mapping[torch.tensor(held, dtype=torch.long)] = torch.arange(len(held), dtype=torch.int32)
    return mapping.to(device)


def _tracing(t: torch.Tensor) -> bool:
    """True under torch.compile tracing or CUDA-graph capture (no data-dependent checks)."""
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_topk(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    m: int,
    num_experts: int,
    device: torch.device,
    validate_ids: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed routing for ``m`` tokens -> (global ids [m, k], float32 weights [m, k]).
    ``validate_ids`` checks the id range on the host (skipped while tracing or capturing)."""
    if topk_weights is None:
        raise InputError(
            format_error(
                "topk_ids given without topk_weights",
                "precomputed routing is ids and weights",
                "pass both",
            )
        )
    ids = topk_ids.reshape(m, -1) if topk_ids.dim() != 2 else topk_ids
    if (
        ids.dim() != 2
        or ids.shape[0] != m
        or ids.dtype not in (torch.int32, torch.int64)
        or tuple(topk_weights.shape) != tuple(ids.shape)
        or not topk_weights.is_floating_point()
    ):
        raise InputError(
            format_error(
                f"topk_ids is {ids.dtype} {tuple(ids.shape)} and topk_weights "
                f"{topk_weights.dtype} {tuple(topk_weights.shape)} for {m} tokens",
                "precomputed routing is int32/int64 ids and float weights, both [tokens, k]",
                "pass the router's top-k ids and weights",
            )
        )
    if ids.shape[1] > num_experts:
        raise InputError(
            format_error(
                f"topk_ids has k={ids.shape[1]} slots but the model has {num_experts} experts",
                "top_k <= num_experts",
                "pass the router's top-k",
            )
        )
    if ids.device != topk_weights.device or ids.device != device:
        raise InputError(
            format_error(
                f"topk_ids on {ids.device}, topk_weights on {topk_weights.device}, layer on "
                f"{device}",
                "one device",
                "move the routing tensors",
            )
        )
    if validate_ids and ids.numel() and not _tracing(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise InputError(
                format_error(
                    f"topk_ids has values in [{lo}, {hi}]",
                    f"global expert ids are in [0, num_experts={num_experts})",
                    "pass global ids (this layer maps them to the experts it holds)",
                )
            )
    return ids, topk_weights.to(torch.float32)

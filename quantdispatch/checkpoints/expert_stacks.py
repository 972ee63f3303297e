"""Per-expert canonical weights -> the stacked tensors a MoE layer takes.

Stacked layouts (E experts held, gated w13 rows are [gate (I rows); up (I rows)]):

| format | w13 (w2: the same over [E, H, I]) |
|---|---|
| nvfp4 | packed uint8 [E, 2I, H/2], block_scale e4m3 [E, 2I, H/16], global_scale f32 [E] |
| mxfp4 | packed uint8 [E, 2I, H/2], block_scale uint8 e8m0 [E, 2I, H/32] |
| fp8 | weight e4m3 [E, 2I, H], scale f32 [E] / [E, 2I] / [E, nb, kb] (+ the block size) |

Gate and up of an expert merge under ONE per-tensor scale exactly as a fused linear does
(NVFP4: the other half's block scales rescaled, the codes untouched; FP8: differing per-tensor
scales become exact per-channel ones). This is the one stacking path: checkpoint readers
(``moe_shard``) and ``QuantMoE`` built from per-expert weights both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from quantdispatch.checkpoints.reader import LoadedLinear, QuantWeight, merge_shards
from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.formats import Nvfp4Weight, merge_nvfp4_shards
from quantdispatch.request import Scheme

__all__ = ["merge_gate_up", "stack_biases", "stack_experts", "stack_layer"]


def _fail(what: str, rule: str, fix: str) -> CheckpointError:
    return CheckpointError(format_error(what, rule, fix))


def merge_gate_up(gate: QuantWeight, up: QuantWeight, expert: int) -> QuantWeight:
    """One expert's gate and up as one [2I, H] weight under one per-tensor scale (exact)."""
    if type(gate) is not type(up):
        raise _fail(
            f"expert {expert}: gate is {type(gate).__name__} but up is {type(up).__name__}",
            "gate and up of an expert share one format",
            "check the checkpoint",
        )
    if gate.shape != up.shape:
        raise _fail(
            f"expert {expert}: gate has shape {gate.shape} but up {up.shape}",
            "gate and up projections have the same [I, H]",
            "pass the gate and up weights of the same expert",
        )
    if isinstance(gate, Nvfp4Weight):
        return merge_nvfp4_shards([gate, up])  # type: ignore[list-item]
    scheme = Scheme.WEIGHT_ONLY
    merged = merge_shards(
        [LoadedLinear(gate, scheme, None, "moe"), LoadedLinear(up, scheme, None, "moe")]
    )
    return merged.weight


def stack_experts(
    format: str, weights: Sequence[QuantWeight], which: str = "w13"
) -> tuple[list[torch.Tensor], tuple[int, int] | None]:
    """Per-expert weights of one format -> the stacked canonical tensors (+ FP8 block size).

    FP8 scales stack as [E] when all are per-tensor, [E, N] (exact) when any is per-channel,
    [E, nb, kb] when all are block-scaled with one block size."""
    shapes = {w.shape for w in weights}
    if len(shapes) != 1:
        raise _fail(
            f"{which} experts have different shapes {sorted(shapes)}",
            "every expert of a layer has the same [N, K]",
            "pass the experts of one layer",
        )
    ws: Any = weights
    if format == "nvfp4":
        gs = [w.global_scale.reshape(()).to(torch.float32) for w in ws]
        return [
            torch.stack([w.packed for w in ws]),
            torch.stack([w.block_scale for w in ws]),
            torch.stack(gs),
        ], None
    if format == "mxfp4":
        return [torch.stack([w.packed for w in ws]), torch.stack([w.block_scale for w in ws])], None
    kinds = {w.scale_kind for w in ws}
    if "block" in kinds:
        blocks = {w.block_size for w in ws}
        if kinds != {"block"} or len(blocks) != 1:
            raise _fail(
                f"{which} experts mix FP8 scale layouts {sorted(kinds)} / blocks {blocks}",
                "block-scaled experts stack only with block-scaled experts of one block size",
                "re-export the checkpoint with one FP8 scheme for all experts",
            )
        scale, block = torch.stack([w.scale for w in ws]), ws[0].block_size
    elif kinds == {"tensor"}:
        scale, block = torch.stack([w.scale.reshape(()) for w in ws]), None
    else:
        scale, block = torch.stack([w.scale.expand(w.shape[0]) for w in ws]), None
    return [torch.stack([w.weight for w in ws]), scale], block


def stack_layer(
    format: str,
    gate: Sequence[QuantWeight] | None,
    up: Sequence[QuantWeight],
    down: Sequence[QuantWeight],
    expert_ids: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[int, int] | None]:
    """A layer's per-expert weights -> (w13 stacks, w2 stacks, FP8 block size or None).

    ``gate`` None: non-gated experts (w13 is ``up``). Gate and up merge per expert;
    ``expert_ids`` names the experts in errors (default: local positions)."""
    ids = list(range(len(up))) if expert_ids is None else list(expert_ids)
    if gate is not None:
        first = [merge_gate_up(g, u, e) for g, u, e in zip(gate, up, ids, strict=True)]
    else:
        first = list(up)
    w13, b13 = stack_experts(format, first, "w13")
    w2, b2 = stack_experts(format, down, "w2")
    if b13 and b2 and b13 != b2:
        raise _fail(
            f"w13 FP8 blocks {b13} differ from w2 blocks {b2}",
            "one block size per layer",
            "re-export the checkpoint",
        )
    if bool(b13) != bool(b2):
        raise _fail(
            "only one of gate/up and down is block-scaled FP8",
            "both stacks of a layer use one FP8 scale layout family",
            "re-export the checkpoint",
        )
    return w13, w2, b13


def stack_biases(parts: list[list[torch.Tensor | None]], n: int) -> torch.Tensor | None:
    """Per-expert biases of each role (gate, up or down) -> [E, sum N] float32, or None; a
    missing one is zeros of ``n``."""
    if all(b is None for role in parts for b in role):
        return None
    device = next(b for role in parts for b in role if b is not None).device
    rows = []
    for e in range(len(parts[0])):
        pieces = [
            b.to(torch.float32) if b is not None else torch.zeros(n, device=device)
            for b in (role[e] for role in parts)
        ]
        rows.append(torch.cat(pieces))
    return torch.stack(rows)

"""Canonical expert stacks: what every MoE backend takes, built and checked once, at load.

E = experts held, H = hidden, I = intermediate; gated w13 rows are [gate (I rows); up (I rows)]:

| format | w13 (w2: the same over [E, H, I]) |
|---|---|
| nvfp4 | packed uint8 [E, 2I, H/2], block_scale e4m3 [E, 2I, H/16], global_scale f32 [E] |
| mxfp4 | packed uint8 [E, 2I, H/2], block_scale uint8 e8m0 [E, 2I, H/32] |
| fp8 | weight e4m3 [E, 2I, H], scale f32 [E] / [E, 2I] / [E, nb, kb] (meta [0, bn, bk]) |

Per expert, gate and up are merged under ONE per-tensor scale exactly
(:func:`~quantdispatch.formats.merge_nvfp4_shards`: the other shard's block scales are
rescaled, the codes untouched). gpt-oss checkpoints interleave gate and up rows; their reader
(:mod:`quantdispatch.checkpoints.moe_reader`) de-interleaves them, so kernels see one layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from quantdispatch.checkpoints import LoadedLinear, QuantWeight, merge_shards
from quantdispatch.errors import CheckpointError, ConfigurationError, format_error
from quantdispatch.formats import (
    Fp8Weight,
    Mxfp4Weight,
    Nvfp4Weight,
    get_format,
    merge_nvfp4_shards,
)
from quantdispatch.request import Scheme

__all__ = [
    "STACK_NAMES",
    "check_bias",
    "expert_lists",
    "given_stacks",
    "layer_dims",
    "scale_kind",
    "stack_bias",
    "stack_experts",
    "validate_stacked",
]

#: Buffer names of the stacked tensors per format (w13_* then w2_*), in the op's order.
STACK_NAMES = {
    "nvfp4": ("packed", "block_scale", "global_scale"),
    "mxfp4": ("packed", "block_scale"),
    "fp8": ("weight", "scale"),
}


def _fail(what: str, rule: str, fix: str, exc: type[Exception] = ConfigurationError) -> None:
    raise exc(format_error(what, rule, fix))


def _fp8_stack_scales(ws: Sequence[Fp8Weight], which: str) -> tuple[torch.Tensor, tuple | None]:
    """Stack per-expert FP8 scales: [E] if all per-tensor, [E, N] (exact) if any per-channel,
    [E, nb, kb] if all block-scaled with one block size."""
    kinds = {w.scale_kind for w in ws}
    if "block" in kinds:
        blocks = {w.block_size for w in ws}
        if kinds != {"block"} or len(blocks) != 1:
            _fail(
                f"{which} experts mix FP8 scale layouts {sorted(kinds)} / blocks {blocks}",
                "block-scaled experts stack only with block-scaled experts of one block size",
                "re-export the checkpoint with one FP8 scheme for all experts",
                CheckpointError,
            )
        return torch.stack([w.scale for w in ws]), ws[0].block_size
    if kinds == {"tensor"}:
        return torch.stack([w.scale.reshape(()) for w in ws]), None
    return torch.stack([w.scale.expand(w.shape[0]) for w in ws]), None


def _stack(fmt: str, fused: Sequence[QuantWeight], which: str) -> tuple[list[torch.Tensor], tuple]:
    """Stack per-expert weights of one format into the canonical tensors (+ fp8 block size)."""
    shapes = {w.shape for w in fused}
    if len(shapes) != 1:
        _fail(
            f"{which} experts have different shapes {sorted(shapes)}",
            "every expert of a layer has the same [N, K]",
            "pass the experts of one layer",
            CheckpointError,
        )
    if fmt == "nvfp4":
        ws: Any = fused
        return [
            torch.stack([w.packed for w in ws]),
            torch.stack([w.block_scale for w in ws]),
            torch.stack([w.global_scale.reshape(()).to(torch.float32) for w in ws]),
        ], ()
    if fmt == "mxfp4":
        ws = fused
        return [torch.stack([w.packed for w in ws]), torch.stack([w.block_scale for w in ws])], ()
    ws = fused
    scale, block = _fp8_stack_scales(ws, which)
    return [torch.stack([w.weight for w in ws]), scale], (tuple(block) if block else ())


def _merge_gate_up(gate: QuantWeight, up: QuantWeight, e: int) -> QuantWeight:
    """One expert's gate and up as one [2I, H] weight under one per-tensor scale (exact)."""
    if type(gate) is not type(up):
        _fail(
            f"expert {e}: gate is {type(gate).__name__} but up is {type(up).__name__}",
            "gate and up of an expert share one format",
            "check the checkpoint",
            CheckpointError,
        )
    if gate.shape != up.shape:
        _fail(
            f"expert {e}: gate has shape {gate.shape} but up {up.shape}",
            "gate and up projections have the same [I, H]",
            "pass the gate and up weights of the same expert",
            CheckpointError,
        )
    if isinstance(gate, Nvfp4Weight):
        return merge_nvfp4_shards([gate, up])  # type: ignore[list-item]
    scheme = Scheme.WEIGHT_ONLY
    merged = merge_shards(
        [LoadedLinear(gate, scheme, None, "moe"), LoadedLinear(up, scheme, None, "moe")]
    )
    return merged.weight


def given_stacks(
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    fmt: str | None,
    fp8_block_size: tuple[int, int] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], str, tuple, Scheme]:
    """Stacks passed as such: (w13, w2, format name, fp8 block, the scheme they imply)."""
    if fmt is None:
        _fail(
            "stacked tensors without format=",
            "say which format they are",
            "pass format='nvfp4', 'mxfp4' or 'fp8'",
        )
    name = get_format(fmt).name  # type: ignore[arg-type]
    block = tuple(int(v) for v in fp8_block_size) if fp8_block_size else ()
    default = Scheme.WEIGHT_ACT if name == "fp8" else Scheme.WEIGHT_ONLY
    return list(w13), list(w2), name, block, default


def expert_lists(
    gate: Sequence[QuantWeight] | None,
    up: Sequence[QuantWeight] | None,
    down: Sequence[QuantWeight] | None,
    gated: bool,
) -> dict[str, list[QuantWeight]]:
    """Per-expert weights by role ("down", "up", and "gate" when gated), one per expert held."""
    first = up if not gated else gate
    if first is None or down is None or (gated and up is None):
        need = "gate, up and down" if gated else "up and down"
        _fail(
            "QuantMoE got no expert weights",
            f"a {'gated' if gated else 'non-gated'} MoE takes per-expert {need} lists, or "
            "w13 / w2 stacks",
            "pass them, or use QuantMoE.from_checkpoint",
        )
    if not gated and gate is not None:
        _fail(
            "gate weights given for a non-gated activation",
            "non-gated experts have one first projection (pass it as up=)",
            "drop gate=, or pick a gated activation",
        )
    lists = {"down": list(down)}  # type: ignore[arg-type]
    lists["up"] = list(up)  # type: ignore[arg-type]
    if gated:
        lists["gate"] = list(gate)  # type: ignore[arg-type]
    counts = {k: len(v) for k, v in lists.items()}
    if len(set(counts.values())) != 1 or counts["down"] == 0:
        _fail(
            f"expert counts differ or are zero: {counts}",
            "there is one gate, up and down weight per expert held",
            "pass complete per-expert lists",
            CheckpointError,
        )
    return lists


def stack_experts(
    fmt: str, lists: dict[str, list[QuantWeight]], gated: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple, Scheme]:
    """Per-expert weights of one format -> (w13 stacks, w2 stacks, fp8 block, the scheme they
    imply); gate and up merged per expert."""
    if gated:
        fused = [
            _merge_gate_up(g, u, i)
            for i, (g, u) in enumerate(zip(lists["gate"], lists["up"], strict=True))
        ]
    else:
        fused = lists["up"]
    s13, b13 = _stack(fmt, fused, "w13")
    s2, b2 = _stack(fmt, lists["down"], "w2")
    if b13 != b2 and b13 and b2:
        _fail(
            f"w13 FP8 blocks {b13} differ from w2 blocks {b2}",
            "one block size per layer",
            "re-export the checkpoint",
            CheckpointError,
        )
    block = b13 or b2
    if bool(b13) != bool(b2):
        _fail(
            "only one of gate/up and down is block-scaled FP8",
            "both stacks of a layer use one FP8 scale layout family",
            "re-export the checkpoint",
            CheckpointError,
        )
    has_input = any(getattr(w, "input_scale", None) is not None for v in lists.values() for w in v)
    scheme = Scheme.WEIGHT_ACT if (has_input or fmt == "fp8") else Scheme.WEIGHT_ONLY
    return s13, s2, block, scheme


def validate_stacked(fmt: str, w: Sequence[torch.Tensor], which: str, block: tuple) -> None:
    """Dtype / shape / value checks of stacked tensors, in bulk (once, at load)."""
    names = STACK_NAMES[fmt]
    if len(w) != len(names):
        _fail(
            f"{which} has {len(w)} tensors",
            f"stacked {fmt} expert weights are {len(names)} tensors: {', '.join(names)}",
            "pass them in that order",
            CheckpointError,
        )
    codes = w[0]
    if not isinstance(codes, torch.Tensor) or codes.dim() != 3:
        _fail(
            f"{which}[0] has shape {tuple(getattr(codes, 'shape', ()))}",
            "stacked expert weights are 3-D [E, N, K/2] (fp4) or [E, N, K] (fp8)",
            "stack the experts with torch.stack",
            CheckpointError,
        )
    e, n = codes.shape[:2]
    flat_codes = codes.reshape(e * n, codes.shape[2])
    scale = w[1]
    if fmt == "nvfp4":
        if scale.dim() != 3 or scale.shape[:2] != codes.shape[:2]:
            _fail(
                f"{which}[1] has shape {tuple(scale.shape)}",
                "block scales are [E, N, K/16]",
                "stack the experts' scales",
                CheckpointError,
            )
        Nvfp4Weight(flat_codes, scale.reshape(e * n, -1), torch.ones((), device=codes.device))
        gs = w[2]
        if gs.dtype != torch.float32 or tuple(gs.shape) != (e,):
            _fail(
                f"{which}[2] is {gs.dtype} {tuple(gs.shape)}",
                f"NVFP4 global scales are float32 [E] = [{e}] (multipliers)",
                "stack one merged global scale per expert",
                CheckpointError,
            )
        if e and not bool((torch.isfinite(gs) & (gs > 0)).all()):
            _fail(
                f"{which}[2] has non-finite or non-positive values",
                "global scales are finite positive multipliers",
                "convert compressed-tensors weight_global_scale with 1/x",
                CheckpointError,
            )
    elif fmt == "mxfp4":
        if scale.dim() != 3 or scale.shape[:2] != codes.shape[:2]:
            _fail(
                f"{which}[1] has shape {tuple(scale.shape)}",
                "block scales are [E, N, K/32]",
                "stack the experts' scales",
                CheckpointError,
            )
        Mxfp4Weight(flat_codes, scale.reshape(e * n, -1))
    else:
        Fp8Weight(flat_codes, torch.ones((), device=codes.device))
        k = codes.shape[2]
        ok = (scale.dim() == 1 and scale.shape[0] == e) or (
            scale.dim() == 2 and tuple(scale.shape) == (e, n)
        )
        if block:
            bn, bk = block
            ok = tuple(scale.shape) == (e, -(-n // bn), -(-k // bk))
        if not ok or scale.dtype != torch.float32:
            _fail(
                f"{which}[1] is {scale.dtype} {tuple(scale.shape)} (block {block or None})",
                "FP8 expert scales are float32 [E] (tensor), [E, N] (channel) or "
                "[E, ceil(N/bn), ceil(K/bk)] with fp8_block_size=(bn, bk)",
                "pass the stacked scales and the checkpoint's weight_block_size",
                CheckpointError,
            )
        if scale.numel() and not bool((torch.isfinite(scale) & (scale >= 0)).all()):
            _fail(
                f"{which}[1] has NaN/inf or negative values",
                "scales are finite, >= 0",
                "re-export the checkpoint",
                CheckpointError,
            )


def layer_dims(
    fmt: str, w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], gated: bool, activation: str
) -> tuple[int, int, int, int]:
    """(E, w13 rows, H, I) of a layer's two stacks, checked against each other."""
    e, n13, hidden = _dims(fmt, w13)
    e2, n2, k2 = _dims(fmt, w2)
    inter = n13 // 2 if gated else n13
    if e2 != e:
        _fail(
            f"w13 holds {e} experts but w2 holds {e2}",
            "gate/up and down stacks have one entry per expert held",
            "pass the same experts to both",
            CheckpointError,
        )
    if (gated and n13 % 2) or n2 != hidden or k2 != inter:
        _fail(
            f"w13 is [E, {n13}, {hidden}] and w2 is [E, {n2}, {k2}] for a "
            f"{'gated' if gated else 'non-gated'} activation ({activation})",
            "w13 is [E, 2I (gated) or I, H] and w2 is [E, H, I]",
            "check the activation and that down belongs to the same layer",
            CheckpointError,
        )
    return e, n13, hidden, inter


def _dims(fmt: str, w: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    """(E, N, K) of a stacked weight."""
    e, n, kk = w[0].shape
    return e, n, kk if fmt == "fp8" else 2 * kk


def scale_kind(fmt: str, w: Sequence[torch.Tensor]) -> str | None:
    """The FP8 scale kind of a stack (what ``select`` takes); None for the FP4 formats."""
    if fmt != "fp8":
        return None
    return {1: "tensor", 2: "channel", 3: "block"}[w[1].dim()]


def check_bias(
    bias: torch.Tensor | None, shape: tuple[int, int], name: str, target: torch.device
) -> torch.Tensor | None:
    """A stacked bias, checked, as float32 on ``target`` (None stays None)."""
    if bias is None:
        return None
    if tuple(bias.shape) != shape or not bias.is_floating_point():
        _fail(
            f"{name} is {bias.dtype} {tuple(bias.shape)}",
            f"{name} is a float tensor {list(shape)} (gate then up rows for w13)",
            "stack the experts' biases",
            CheckpointError,
        )
    if not bool(torch.isfinite(bias).all()):
        _fail(
            f"{name} contains NaN/inf",
            "biases are finite",
            "check the checkpoint",
            CheckpointError,
        )
    return bias.detach().to(device=target, dtype=torch.float32).contiguous()


def stack_bias(parts: list[list[torch.Tensor | None]], n: int) -> torch.Tensor | None:
    """Per-expert biases of each role (gate, up or down) -> [E, sum N] float32, or None."""
    if all(b is None for role in parts for b in role):
        return None
    experts = len(parts[0])
    device = next(b for role in parts for b in role if b is not None).device
    rows = []
    for e in range(experts):
        pieces = []
        for role in parts:
            b = role[e]
            pieces.append(b.to(torch.float32) if b is not None else torch.zeros(n, device=device))
        rows.append(torch.cat(pieces))
    return torch.stack(rows)

"""Canonical expert stacks: what every MoE backend takes, built and checked once, at load.

The stacked layout (w13 = [gate; up] rows per expert, w2, their scales) and the one stacking
path (gate/up merged under one per-tensor scale, exactly) are
:mod:`quantdispatch.checkpoints.expert_stacks`; this module turns a ``QuantMoE``'s arguments
(per-expert lists or ready stacks) into stacks, checks them in bulk and names their buffers.
FP8 block-scaled stacks carry meta [0, bn, bk].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantdispatch.checkpoints import QuantWeight
from quantdispatch.checkpoints.expert_stacks import stack_layer
from quantdispatch.errors import CheckpointError, ConfigurationError, format_error
from quantdispatch.formats import Fp8Weight, Mxfp4Weight, Nvfp4Weight, get_format
from quantdispatch.request import Scheme

__all__ = [
    "STACK_NAMES",
    "check_bias",
    "expert_lists",
    "given_stacks",
    "layer_dims",
    "scale_kind",
    "stack_expert_lists",
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


def stack_expert_lists(
    fmt: str, lists: dict[str, list[QuantWeight]], gated: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple, Scheme]:
    """Per-expert weights of one format -> (w13 stacks, w2 stacks, fp8 block, the scheme they
    imply); gate and up merged per expert (:func:`~quantdispatch.checkpoints.stack_layer`)."""
    gate = lists["gate"] if gated else None
    s13, s2, block = stack_layer(fmt, gate, lists["up"], lists["down"])
    has_input = any(getattr(w, "input_scale", None) is not None for v in lists.values() for w in v)
    scheme = Scheme.WEIGHT_ACT if (has_input or fmt == "fp8") else Scheme.WEIGHT_ONLY
    return s13, s2, tuple(block) if block else (), scheme


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
    if fmt != "fp8" and (scale.dim() != 3 or scale.shape[:2] != codes.shape[:2]):
        _fail(
            f"{which}[1] has shape {tuple(scale.shape)}",
            f"block scales are [E, N, K/{get_format(fmt).group_size}]",
            "stack the experts' scales",
            CheckpointError,
        )
    if fmt == "nvfp4":
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

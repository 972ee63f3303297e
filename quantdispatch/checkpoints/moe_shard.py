"""A rank's share of a MoE layer's experts, read from a checkpoint: expert parallel (a subset
of the experts) combined with tensor parallel over the intermediate size I.

Each rank holds, for every expert in ``expert_ids``, the I slice [a, b): w13 rows [gate a:b;
up a:b] (the gate and up halves stay paired) and w2 columns a:b. Slices are whole scale groups
of w2's K (16 NVFP4, 32 MXFP4, lcm(bn, bk) with FP8 block scales), as even as possible; w2's
bias goes to tensor-parallel rank 0 only (added once when the ranks' outputs are summed).
Per-tensor scales stay whole, and gate/up merge under one scale exactly as the whole layer
does, so a shard is the matching slice of the whole layer's stacks and the sum over all ranks
(EP x TP) of their outputs is the whole layer.

The result is what ``QuantMoE(w13=..., w2=..., format=...)`` takes (stacked layouts:
``expert_stacks``). Only the rank's slices are read from a SafetensorsStateDict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quantdispatch.checkpoints.config import QuantConfig
from quantdispatch.checkpoints.expert_stacks import stack_biases, stack_layer
from quantdispatch.checkpoints.moe_reader import (
    detect_naming,
    gpt_oss_intermediate,
    has_gpt_oss_experts,
    keys_by_expert,
    read_gpt_oss_experts,
)
from quantdispatch.checkpoints.reader import LoadedLinear, read_linear
from quantdispatch.checkpoints.slices import LayerSlice, linear_geometry
from quantdispatch.checkpoints.split_plan import check_tp, split_range
from quantdispatch.errors import (
    CheckpointError,
    ConfigurationError,
    WeightFormatError,
    format_error,
)
from quantdispatch.formats import FP4_GROUP_SIZES
from quantdispatch.request import Scheme

__all__ = [
    "MoeShard",
    "moe_intermediate_range",
    "moe_shard_sizes",
    "read_moe_shard",
]

_GROUP = FP4_GROUP_SIZES


def _fail(what: str, rule: str, fix: str) -> CheckpointError:
    return CheckpointError(format_error(what, rule, fix))


@dataclass(frozen=True)
class MoeShard:
    """One rank's stacked experts: ``QuantMoE(w13=shard.w13, w2=shard.w2, format=...)``."""

    format: str
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    scheme: Scheme
    expert_ids: tuple[int, ...]
    """Global ids of the experts held, in stack order."""
    intermediate: tuple[int, int]
    """[start, stop) of the layer's intermediate size this rank holds."""
    intermediate_size: int
    """The layer's whole I."""
    fp8_block_size: tuple[int, int] | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None


def _i_unit(format: str, fp8_block: tuple[int, int] | None) -> int:
    if format in _GROUP:
        return _GROUP[format]
    return math.lcm(*fp8_block) if fp8_block else 1


def moe_intermediate_range(
    inter: int,
    format: str,
    tp_rank: int,
    tp_size: int,
    *,
    fp8_block: tuple[int, int] | None = None,
    align: int = 1,
) -> tuple[int, int]:
    """[start, stop) of the intermediate size I that ``tp_rank`` holds: whole scale groups of
    w2's K (16 NVFP4, 32 MXFP4, lcm(bn, bk) FP8 blocks), as even as possible; ``align``: whole
    multiples of it too (64 keeps every rank's I on the triton backend's repacked MoE kernels,
    which need I % 64 == 0: gpt-oss's 2880 over 4 ranks is 768 / 704 / 704 / 704 instead of
    736 / 736 / 704 / 704)."""
    check_tp(tp_rank, tp_size)
    if not isinstance(align, int) or align < 1:
        raise ConfigurationError(
            format_error(f"align={align!r}", "align is a positive integer", "pass e.g. 64")
        )
    group = _i_unit(format, fp8_block)
    unit = math.lcm(group, align)
    label = format.upper() if format in _GROUP else f"FP8 block {fp8_block}"
    if format in _GROUP and inter % group:
        raise WeightFormatError(
            format_error(
                f"intermediate size I = {inter} is not a whole number of {label} scale "
                f"groups of {group}",
                "w2's K is I, a multiple of the scale group",
                "check the intermediate size",
            )
        )
    return split_range(
        inter,
        tp_rank,
        tp_size,
        unit,
        what=f"intermediate size I ({label})",
        unit_name="column" if unit == 1 else "scale group" if align == 1 else "aligned unit",
        partial_last=True,
    )


def moe_shard_sizes(
    inter: int,
    format: str,
    tp_size: int,
    *,
    fp8_block: tuple[int, int] | None = None,
    align: int = 1,
) -> list[int]:
    """Each tensor-parallel rank's I (for ``doctor --moe``)."""
    check_tp(0, tp_size)
    sizes = []
    for r in range(tp_size):
        a, b = moe_intermediate_range(inter, format, r, tp_size, fp8_block=fp8_block, align=align)
        sizes.append(b - a)
    return sizes


# ---------------------------------------------------------------------------------------------
# Reading


def read_moe_shard(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str,
    config: QuantConfig | None = None,
    *,
    num_experts: int,
    expert_ids: Sequence[int] | None = None,
    gated: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    align: int = 1,
) -> MoeShard:
    """The experts ``expert_ids`` (default: all) of the MoE under ``prefix`` (e.g.
    ``model.layers.3.mlp``), cut to ``tp_rank``'s I slice of ``tp_size``.

    Reads per-expert ``{prefix}.experts.{e}.gate_proj/up_proj/down_proj`` (or Mixtral's
    ``w1/w3/w2``) in any convention ``read_linear`` reads, or gpt-oss's fused
    ``{prefix}.experts.gate_up_proj_blocks/_scales/_bias`` (interleaved gate/up rows,
    de-interleaved here) and ``down_proj_blocks/_scales/_bias``. ``gated=False``: experts have
    up and down only. ``config``: the checkpoint's QuantConfig, checked against the tensors.
    ``align``: I slices in whole multiples of it too (see :func:`moe_intermediate_range`).
    """
    check_tp(tp_rank, tp_size)
    prefix = prefix.rstrip(".")
    held = list(range(num_experts)) if expert_ids is None else [int(i) for i in expert_ids]
    bad = [i for i in held if not 0 <= i < num_experts]
    if bad or len(set(held)) != len(held) or not held:
        raise CheckpointError(
            format_error(
                f"expert_ids {held[:8]}{'...' if len(held) > 8 else ''} (out of range: "
                f"{bad[:4]}) for num_experts={num_experts}",
                "distinct global ids in [0, num_experts), at least one",
                "pass this rank's expert ids",
            )
        )
    base = f"{prefix}.experts"
    tp = (tp_rank, tp_size, align)
    if has_gpt_oss_experts(state_dict, base):
        return _gpt_oss_shard(state_dict, base, held, num_experts, config, tp)
    return _per_expert_shard(state_dict, base, held, num_experts, config, gated, tp)


def _gpt_oss_shard(sd, base, held, num_experts, config, tp) -> MoeShard:
    tp_rank, tp_size, align = tp
    inter = gpt_oss_intermediate(sd, base, num_experts, config)
    cut = (0, inter)
    if tp_size > 1:
        cut = moe_intermediate_range(inter, "mxfp4", tp_rank, tp_size, align=align)
    w13, w2, b13, b2 = read_gpt_oss_experts(sd, base, held, cut, down_bias=tp_rank == 0)
    scheme = Scheme.WEIGHT_ONLY
    return MoeShard("mxfp4", w13, w2, scheme, tuple(held), cut, inter, w13_bias=b13, w2_bias=b2)


def _per_expert_shard(sd, base, held, num_experts, config, gated, tp) -> MoeShard:
    tp_rank = tp[0]
    by_expert = keys_by_expert(sd, base)
    gate_n, up_n, down_n = detect_naming(by_expert, base, held, gated)
    roles = (("gate", gate_n), ("up", up_n), ("down", down_n))
    if not gated:
        roles = roles[1:]
    loaded: dict[str, list[LoadedLinear]] = {r: [] for r, _ in roles}
    first_geo: dict[str, Any] = {}
    cut: tuple[int, int] | None = None
    for e in held:
        keys = by_expert.get(str(e), [])
        found = []
        for role, name in roles:
            module = f"{base}.{e}.{name}"
            mine = [k for k in keys if k.startswith(module + ".")]
            if not mine:
                raise _fail(
                    f"missing expert tensors: nothing under '{module}.' (expert {e} of "
                    f"{num_experts}, {role} projection)",
                    f"every expert held has {', '.join(n for _, n in roles)}",
                    "pass the complete state dict (all shards), or the expert_ids this rank "
                    "really holds",
                )
            quant = _layer_quant(config, module)
            geo = linear_geometry(sd, module, quant, keys=mine)
            ref = first_geo.setdefault(role, geo)
            if (geo.format, geo.n, geo.k) != (ref.format, ref.n, ref.k):
                raise _fail(
                    f"expert {e} {role} is {geo.label} [{geo.n}, {geo.k}] but expert "
                    f"{held[0]} {role} is {ref.label} [{ref.n}, {ref.k}]",
                    "every expert of a layer has one format and the same [N, K]",
                    "pass the experts of one layer",
                )
            found.append((role, module, quant, geo))
        if e == held[0]:
            cut = _intermediate_cut(first_geo, roles[0][0], tp)
        for role, module, quant, geo in found:
            if role == "down":
                view = LayerSlice(sd, module, geo, cols=cut, bias=tp_rank == 0)
            else:
                view = LayerSlice(sd, module, geo, rows=None if cut is None else [cut])
            loaded[role].append(read_linear(view, module, quant))
    return _assemble(loaded, gated, held, cut, first_geo["down"].k)


def _span(cut: tuple[int, int] | None, size: int) -> tuple[int, int]:
    return cut if cut is not None else (0, size)


def _intermediate_cut(geos, first_role, tp):
    """The I slice, once the first expert's gate/up and down shapes are known."""
    up, down = geos[first_role], geos["down"]
    if down.k != up.n or down.format != up.format:
        raise _fail(
            f"{first_role} is {up.label} [{up.n}, {up.k}] but down is {down.label} "
            f"[{down.n}, {down.k}]",
            "gate/up are [I, H] and down [H, I], in one format",
            "check that the projections belong to one expert",
        )
    tp_rank, tp_size, align = tp
    if tp_size == 1:
        return None
    block = up.fp8_block or down.fp8_block
    return moe_intermediate_range(up.n, up.format, tp_rank, tp_size, fp8_block=block, align=align)


def _assemble(loaded, gated, held, cut, inter) -> MoeShard:
    schemes = {ld.scheme for v in loaded.values() for ld in v}
    if len(schemes) != 1:
        raise _fail(
            f"experts mix schemes {sorted(s.value for s in schemes)}",
            "one scheme per MoE layer",
            "check the checkpoint",
        )
    fmt = loaded["down"][0].format
    w13, w2, block = stack_layer(
        fmt,
        [g.weight for g in loaded["gate"]] if gated else None,
        [u.weight for u in loaded["up"]],
        [d.weight for d in loaded["down"]],
        held,
    )
    first = "gate" if gated else "up"
    n_first = loaded[first][0].weight.shape[0]
    roles = ("gate", "up") if gated else ("up",)
    bias13 = stack_biases([[ld.bias for ld in loaded[r]] for r in roles], n_first)
    hidden = loaded["down"][0].weight.shape[0]
    bias2 = stack_biases([[ld.bias for ld in loaded["down"]]], hidden)
    scheme = schemes.pop()
    return MoeShard(
        fmt,
        w13,
        w2,
        scheme,
        tuple(held),
        _span(cut, inter),
        inter,
        fp8_block_size=block,
        w13_bias=bias13,
        w2_bias=bias2,
    )


def _layer_quant(config: QuantConfig | None, module: str) -> Any:
    if config is None:
        return None
    quant = config.layer(module)
    if quant is None:
        raise _fail(
            f"{module!r} is not quantized in this checkpoint ({config.producer} config "
            "excludes it or lists no scheme for it)",
            "QuantMoE loads quantized experts only",
            "run these experts with the engine's unquantized MoE",
        )
    return quant

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
from quantdispatch.checkpoints.expert_stacks import merge_gate_up, stack_biases, stack_experts
from quantdispatch.checkpoints.reader import LoadedLinear, read_linear
from quantdispatch.checkpoints.slices import LayerSlice, linear_geometry, read_slice, tensor_info
from quantdispatch.checkpoints.tensor_parallel import check_tp, split_range
from quantdispatch.errors import (
    CheckpointError,
    ConfigurationError,
    WeightFormatError,
    format_error,
)
from quantdispatch.request import Scheme

__all__ = [
    "EXPERT_NAMINGS",
    "MoeShard",
    "moe_intermediate_range",
    "moe_shard_sizes",
    "read_moe_shard",
]

#: Per-expert projection names (gate, up, down) of the checkpoints we read.
EXPERT_NAMINGS = (
    ("gate_proj", "up_proj", "down_proj"),  # Qwen, DeepSeek, most HF MoEs
    ("w1", "w3", "w2"),  # Mixtral: w1 = gate, w3 = up, w2 = down
)

_GROUP = {"nvfp4": 16, "mxfp4": 32}


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
    if f"{base}.gate_up_proj_blocks" in state_dict or f"{base}.down_proj_blocks" in state_dict:
        tp = (tp_rank, tp_size, align)
        return _gpt_oss_shard(state_dict, base, held, num_experts, config, tp)
    tp = (tp_rank, tp_size, align)
    return _per_expert_shard(state_dict, base, held, num_experts, config, gated, tp)


def _per_expert_shard(sd, base, held, num_experts, config, gated, tp) -> MoeShard:
    tp_rank = tp[0]
    by_expert: dict[str, list[str]] = {}
    dot = base + "."
    for key in sd:
        if key.startswith(dot):
            idx, _, _ = key[len(dot) :].partition(".")
            by_expert.setdefault(idx, []).append(key)
    gate_n, up_n, down_n = _naming(by_expert, base, held, gated)
    roles = (
        (("gate", gate_n), ("up", up_n), ("down", down_n))
        if gated
        else (
            ("up", up_n),
            ("down", down_n),
        )
    )
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
    if gated:
        firsts = [
            merge_gate_up(g.weight, u.weight, e)
            for g, u, e in zip(loaded["gate"], loaded["up"], held, strict=True)
        ]
    else:
        firsts = [u.weight for u in loaded["up"]]
    w13, b13 = stack_experts(fmt, firsts, "w13")
    w2, b2 = stack_experts(fmt, [d.weight for d in loaded["down"]], "w2")
    if b13 != b2:
        raise _fail(
            f"w13 FP8 blocks {b13} differ from w2 blocks {b2}",
            "both stacks of a layer use one FP8 scale layout family and block size",
            "re-export the checkpoint",
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
        fp8_block_size=b13,
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


def _naming(by_expert, base, held, gated) -> tuple[str, str, str]:
    """Which per-expert naming this checkpoint uses (from the first expert held)."""
    for e in held:
        keys = by_expert.get(str(e))
        if not keys:
            continue
        names = {k[len(f"{base}.{e}.") :].split(".")[0] for k in keys}
        for naming in EXPERT_NAMINGS:
            if (naming[0] in names and gated) or naming[1] in names or naming[2] in names:
                return naming
        break
    found = sorted(by_expert)[:4]
    raise _fail(
        f"missing expert tensors: found no experts {list(held)[:4]}... under '{base}.' "
        f"(expert indices present: {found or 'none'})",
        "experts are stored as {prefix}.experts.{e}.gate_proj/up_proj/down_proj, "
        ".w1/.w3/.w2 (Mixtral), or gpt-oss's {prefix}.experts.gate_up_proj_blocks",
        "check the prefix (e.g. model.layers.3.mlp, Mixtral: model.layers.3.block_sparse_moe)",
    )


# ---------------------------------------------------------------------------------------------
# gpt-oss: experts stacked in one tensor per projection, gate/up rows interleaved


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ids as [start, stop) runs, in order (one read per run)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


def _gpt_oss_shard(sd, base, held, num_experts, config, tp) -> MoeShard:
    tp_rank, tp_size, align = tp
    if config is not None:
        quant = config.layer(f"{base}.gate_up_proj")
        if quant is not None and quant.format != "mxfp4":
            raise _fail(
                f"the quant config says {base} is {quant.format} but its tensors are gpt-oss "
                "MXFP4 blocks",
                "config and tensors describe one format",
                "pass this checkpoint's config",
            )
    need = [f"{base}.{p}_{s}" for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales")]
    missing = [k for k in need if k not in sd]
    if missing:
        raise _fail(
            f"missing expert tensors {missing}",
            "gpt-oss experts are {prefix}.experts.gate_up_proj_blocks/_scales and "
            "down_proj_blocks/_scales (biases optional)",
            "pass the complete state dict",
        )
    shapes = {}
    for key, ndim in zip(need, (4, 3, 4, 3), strict=True):
        shape, _ = tensor_info(sd, key)
        if len(shape) != ndim or shape[0] != num_experts:
            raise _fail(
                f"{key} has shape {shape}",
                f"gpt-oss stacks experts first: {ndim}-D with {num_experts} experts",
                "check num_experts and the checkpoint",
            )
        shapes[key] = shape
    gu, d = shapes[need[0]], shapes[need[2]]
    if gu[-1] != 16 or d[-1] != 16 or gu[1] % 2 or d[2] * 32 != gu[1] // 2:
        raise _fail(
            f"gate_up_proj_blocks {gu}, down_proj_blocks {d}",
            "gpt-oss blocks are [E, N, K/32, 16] bytes: gate_up [E, 2I, H/32, 16], down "
            "[E, H, I/32, 16]",
            "check the checkpoint",
        )
    inter = gu[1] // 2
    a, b = (0, inter)
    if tp_size > 1:
        a, b = moe_intermediate_range(inter, "mxfp4", tp_rank, tp_size, align=align)
    runs = _runs(held)

    def take(key: str, *index: slice) -> torch.Tensor:
        return torch.cat([read_slice(sd, key, (slice(s, t), *index)) for s, t in runs])

    def deinterleave(t: torch.Tensor) -> torch.Tensor:
        # rows [gate_a, up_a, gate_a+1, up_a+1, ...] -> [gate a:b; up a:b]
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()

    rows, groups = slice(2 * a, 2 * b), slice(a // 32, -(-b // 32))
    e = len(held)
    w13 = [
        deinterleave(take(need[0], rows)).reshape(e, 2 * (b - a), -1),
        deinterleave(take(need[1], rows)),
    ]
    w2 = [
        take(need[2], slice(None), groups).reshape(e, d[1], -1).contiguous(),
        take(need[3], slice(None), groups).contiguous(),
    ]
    b13 = b2 = None
    if f"{base}.gate_up_proj_bias" in sd:
        b13 = deinterleave(take(f"{base}.gate_up_proj_bias", rows)).to(torch.float32)
    if f"{base}.down_proj_bias" in sd and tp_rank == 0:
        b2 = take(f"{base}.down_proj_bias").to(torch.float32)
    return MoeShard(
        "mxfp4", w13, w2, Scheme.WEIGHT_ONLY, tuple(held), (a, b), inter, w13_bias=b13, w2_bias=b2
    )

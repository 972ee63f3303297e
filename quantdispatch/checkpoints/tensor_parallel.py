"""A tensor-parallel rank's shard of a quantized linear layer, read from a checkpoint.

Column parallel (q/k/v, gate/up) splits N; each rank's output columns are gathered. Row
parallel (o, down) splits K; each rank's partial outputs are summed (all-reduce). Only the
rank's slice is read (:class:`~quantdispatch.checkpoints.slices.LayerSlice`), then converted by
the same readers as a whole layer, so the shard equals the matching slice of the whole layer:

- N splits are as even as possible (earlier ranks take the remainder), in rows, or in blocks of
  bn for FP8 block scales. Fused layers split each part on its own: gate and up halves stay
  paired; q/k/v with ``heads=(q heads, kv heads)`` give each rank its q heads and the kv heads
  they attend with (replicated when there are fewer kv heads than ranks).
- K splits take whole scale groups (16 NVFP4, 32 MXFP4, bk for FP8 block scales; FP8 per-tensor
  or per-channel scales: any column), as even as possible in groups.
- ``align`` makes both in whole multiples of a unit too (not with ``heads``). When I does not
  split evenly, an MLP's ranks hold matching gate/up rows and down columns only if gate/up and
  down get the same align, a multiple of down's group (16 is enough for NVFP4; 64 also keeps
  every rank on the mma kernels).
- Per-tensor scales (NVFP4 global, FP8 per-tensor, input scales) stay whole: exact. FP8
  per-channel scales follow N; block scales follow their blocks.
- Bias: column parallel slices it; row parallel gives it to rank 0 only (added once, after the
  all-reduce sum), as engines do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from quantdispatch.checkpoints.config import LayerQuant
from quantdispatch.checkpoints.reader import LoadedLinear, merge_shards, read_linear
from quantdispatch.checkpoints.slices import LayerSlice, linear_geometry
from quantdispatch.errors import ConfigurationError, WeightFormatError, format_error

__all__ = [
    "Parallel",
    "check_tp",
    "column_ranges",
    "linear_shard_shapes",
    "read_linear_shard",
    "split_range",
]

Parallel = Literal["column", "row"]

#: Elements along K per scale group of each FP4 format.
_GROUP = {"nvfp4": 16, "mxfp4": 32}


def check_tp(tp_rank: int, tp_size: int) -> None:
    """Refuse a rank / size pair that names no shard."""
    ok = isinstance(tp_size, int) and isinstance(tp_rank, int)
    if not ok or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigurationError(
            format_error(
                f"tp_rank={tp_rank!r}, tp_size={tp_size!r}",
                "tensor parallelism needs integers with tp_size >= 1 and 0 <= tp_rank < tp_size",
                "pass this process's rank in its tensor-parallel group and the group's size "
                "(torch.distributed.get_rank(group), get_world_size(group))",
            )
        )


def split_range(
    size: int,
    tp_rank: int,
    tp_size: int,
    unit: int = 1,
    *,
    what: str = "size",
    unit_name: str = "unit",
    partial_last: bool = False,
) -> tuple[int, int]:
    """[start, stop) of ``tp_rank``'s share of ``size`` elements in whole ``unit``s, as even
    as possible (earlier ranks take the remainder). ``partial_last``: the last unit may be
    short (FP8 blocks at the edge of a weight)."""
    check_tp(tp_rank, tp_size)
    if not partial_last and size % unit:
        raise WeightFormatError(
            format_error(
                f"{what} = {size} is not a whole number of {unit_name}s of {unit}",
                f"a shard holds whole {unit_name}s",
                "check the shape (a quantized K is a multiple of its scale group)",
            )
        )
    units = -(-size // unit)
    if units < tp_size:
        raise WeightFormatError(
            format_error(
                f"{what} = {size} is {units} {unit_name}(s) of {unit}, which cannot be split "
                f"over {tp_size} ranks",
                f"every rank holds at least one whole {unit_name}",
                f"use tp_size <= {units} for this layer, or replicate it on every rank",
            )
        )
    base, extra = divmod(units, tp_size)
    start = tp_rank * base + min(tp_rank, extra)
    stop = start + base + (1 if tp_rank < extra else 0)
    return start * unit, min(stop * unit, size)


def column_ranges(
    part_rows: Sequence[int],
    tp_rank: int,
    tp_size: int,
    *,
    heads: tuple[int, int] | None = None,
    unit: int = 1,
) -> list[tuple[int, int]]:
    """``tp_rank``'s row range [start, stop) in each part of a column-parallel layer (one part,
    or the parts of a fused layer: q/k/v, gate/up), in the part's own rows.

    ``heads=(q heads, kv heads)`` with parts [q, k, v]: q heads split evenly and each rank gets
    the kv heads of its q heads (one kv head shared by tp_size / kv_heads ranks when there are
    fewer kv heads than ranks). ``unit``: ranges in whole multiples of it (FP8 block rows,
    ``align``)."""
    check_tp(tp_rank, tp_size)
    if heads is None:
        return [
            split_range(
                n,
                tp_rank,
                tp_size,
                unit,
                what=f"N of part {i}",
                unit_name="row" if unit == 1 else "block of rows",
                partial_last=True,
            )
            for i, n in enumerate(part_rows)
        ]
    ranges = _head_ranges(part_rows, tp_rank, tp_size, heads)
    if unit > 1:
        last = len(ranges) - 1
        for i, (a, b) in enumerate(ranges):
            if a % unit or ((b - a) % unit and not (i == last and b == part_rows[i])):
                raise WeightFormatError(
                    format_error(
                        f"rank {tp_rank} of {tp_size} gets rows {a}:{b} of part {i} "
                        f"(heads {heads}, parts {list(part_rows)})",
                        f"block-scaled shards hold whole blocks of {unit} rows",
                        "use a tensor-parallel size whose per-rank heads fill whole blocks",
                    )
                )
    return ranges


def _head_ranges(
    part_rows: Sequence[int], tp_rank: int, tp_size: int, heads: tuple[int, int]
) -> list[tuple[int, int]]:
    hq, hkv = (int(h) for h in heads)
    if len(part_rows) != 3 or hq < 1 or hkv < 1 or hq % hkv:
        raise ConfigurationError(
            format_error(
                f"heads={heads} for {len(part_rows)} part(s) {list(part_rows)}",
                "heads=(q heads, kv heads) describes a fused q/k/v layer: three parts, q heads "
                "a multiple of kv heads",
                "pass the q, k and v prefixes (or segments) with the model's "
                "num_attention_heads and num_key_value_heads",
            )
        )
    nq, nk, nv = part_rows
    d = nq // hq
    if nq % hq or nk != hkv * d or nv != hkv * d:
        raise WeightFormatError(
            format_error(
                f"q/k/v have {nq}/{nk}/{nv} rows for {hq} q heads and {hkv} kv heads",
                "q has q_heads x head_dim rows, k and v kv_heads x head_dim each",
                "check the heads against the model's config",
            )
        )
    if hq % tp_size or (hkv % tp_size and tp_size % hkv):
        raise WeightFormatError(
            format_error(
                f"{hq} q heads and {hkv} kv heads cannot be split over tp_size={tp_size}",
                "each rank holds q_heads / tp_size whole q heads (q_heads divisible by "
                "tp_size) and the kv heads they use (kv_heads divisible by tp_size, or "
                "tp_size by kv_heads to replicate them)",
                "use a tensor-parallel size that divides the q heads",
            )
        )
    per = hq // tp_size
    q = (tp_rank * per * d, (tp_rank + 1) * per * d)
    if hkv % tp_size == 0:
        kv_per = hkv // tp_size
        kv = (tp_rank * kv_per * d, (tp_rank + 1) * kv_per * d)
    else:
        j = tp_rank * hkv // tp_size
        kv = (j * d, (j + 1) * d)
    return [q, kv, kv]


def _normalize(prefix: str) -> str:
    prefix = prefix.rstrip(".")
    return prefix[: -len(".weight")] if prefix.endswith(".weight") else prefix


def _quants(quant: object, count: int) -> list[LayerQuant | None]:
    if isinstance(quant, (list, tuple)):
        if len(quant) != count:
            raise ConfigurationError(
                format_error(
                    f"{len(quant)} quant entries for {count} prefixes",
                    "one LayerQuant (or None) per prefix",
                    "pass them in the prefixes' order",
                )
            )
        return list(quant)
    return [quant] * count  # type: ignore[list-item]


def read_linear_shard(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str | Sequence[str],
    quant: LayerQuant | Sequence[LayerQuant | None] | None = None,
    *,
    tp_rank: int,
    tp_size: int,
    parallel: Parallel = "column",
    heads: tuple[int, int] | None = None,
    segments: Sequence[int] | None = None,
    align: int = 1,
    device: torch.device | str | None = None,
) -> LoadedLinear:
    """``tp_rank``'s shard of the layer at ``prefix``, reading only its slice.

    ``prefix``: one layer, or the parts of a fused column-parallel layer in output order
    ([q, k, v], [gate, up]); ``quant``: one LayerQuant for all, or one per prefix.
    ``segments``: row counts of the parts stacked in ONE tensor (a checkpoint's fused
    ``qkv_proj`` = [q_rows, k_rows, v_rows], ``gate_up_proj`` = [I, I]); each part splits on its
    own. ``heads=(q heads, kv heads)``: the parts are q/k/v, split per head group. ``align``:
    N splits (without heads) and K splits in whole multiples of it too. With ``tp_size=1`` this
    is the whole layer (``read_linear`` + ``merge_shards``).
    """
    check_tp(tp_rank, tp_size)
    if parallel not in ("column", "row"):
        raise ConfigurationError(
            format_error(
                f"parallel={parallel!r}",
                "parallel is 'column' (split N: q/k/v, gate/up) or 'row' (split K: o, down)",
                "pass one of them",
            )
        )
    if not isinstance(align, int) or align < 1:
        raise ConfigurationError(
            format_error(f"align={align!r}", "align is a positive integer", "pass e.g. 16")
        )
    prefixes = [_normalize(p) for p in ([prefix] if isinstance(prefix, str) else prefix)]
    quants = _quants(quant, len(prefixes))
    if segments is not None and len(prefixes) != 1:
        raise ConfigurationError(
            format_error(
                f"segments={list(segments)} with {len(prefixes)} prefixes",
                "segments describe the parts stacked in one tensor (one prefix)",
                "pass either one fused prefix with segments or one prefix per part",
            )
        )
    if tp_size == 1:
        parts = [
            read_linear(state_dict, p, q, device=device)
            for p, q in zip(prefixes, quants, strict=True)
        ]
        return parts[0] if len(parts) == 1 else merge_shards(parts)
    geos = [linear_geometry(state_dict, p, q) for p, q in zip(prefixes, quants, strict=True)]
    if parallel == "row":
        if len(prefixes) != 1 or segments is not None or heads is not None:
            raise ConfigurationError(
                format_error(
                    f"parallel='row' with prefixes {prefixes}, segments {segments}, heads {heads}",
                    "a row-parallel layer (o, down) is one weight split along K",
                    "fused q/k/v or gate/up layers are column parallel",
                )
            )
        (p,), (g,), (q,) = prefixes, geos, quants
        unit = math.lcm(g.group, align)
        a, b = split_range(
            g.k,
            tp_rank,
            tp_size,
            unit,
            what=f"K of {p} ({g.label})",
            unit_name="column" if unit == 1 else "scale group" if align == 1 else "aligned unit",
            partial_last=True,  # a quantized K is whole groups; FP8 blocks may end short
        )
        view = LayerSlice(state_dict, p, g, cols=(a, b), bias=tp_rank == 0)
        return read_linear(view, p, q, device=device)
    if segments is not None:
        (p,), (g,), (q,) = prefixes, geos, quants
        seg = [int(s) for s in segments]
        if sum(seg) != g.n or min(seg) < 1:
            raise WeightFormatError(
                format_error(
                    f"segments {seg} of {p} add up to {sum(seg)} but the weight has N = {g.n}",
                    "segments are the row counts of the parts stacked in the tensor, in order",
                    "pass e.g. [q_heads*head_dim, kv_heads*head_dim, kv_heads*head_dim]",
                )
            )
        unit = g.row_block if heads else math.lcm(g.row_block, align)
        ranges = column_ranges(seg, tp_rank, tp_size, heads=heads, unit=unit)
        starts = [sum(seg[:i]) for i in range(len(seg))]
        rows = [(s + a, s + b) for s, (a, b) in zip(starts, ranges, strict=True)]
        return read_linear(LayerSlice(state_dict, p, g, rows=rows), p, q, device=device)
    unit = max(g.row_block for g in geos)
    unit = unit if heads else math.lcm(unit, align)
    ranges = column_ranges([g.n for g in geos], tp_rank, tp_size, heads=heads, unit=unit)
    parts = [
        read_linear(LayerSlice(state_dict, p, g, rows=[r]), p, q, device=device)
        for p, g, q, r in zip(prefixes, geos, quants, ranges, strict=True)
    ]
    return parts[0] if len(parts) == 1 else merge_shards(parts)


def linear_shard_shapes(
    n: int,
    k: int,
    format: str,
    *,
    tp_size: int,
    parallel: Parallel,
    heads: tuple[int, int] | None = None,
    segments: Sequence[int] | None = None,
    align: int = 1,
    fp8_block: tuple[int, int] | None = None,
) -> list[tuple[int, int]]:
    """Each rank's [N, K] for an N x K weight split ``parallel``-wise over ``tp_size`` ranks,
    by the rules :func:`read_linear_shard` follows (no tensors: for ``doctor --shape``)."""
    check_tp(0, tp_size)
    group = _GROUP.get(format, fp8_block[1] if fp8_block else 1)
    label = format.upper() if format in _GROUP else "FP8"
    unit_name = "column" if group == 1 else "scale group"
    if format in _GROUP and k % group:
        raise WeightFormatError(
            format_error(
                f"K = {k} is not a whole number of {label} scale groups of {group}",
                f"{label} weights have K a multiple of {group}",
                f"check the shape (K = {k // group * group} or {(k // group + 1) * group}?)",
            )
        )
    if parallel == "row":
        unit = math.lcm(group, align)
        out = []
        for r in range(tp_size):
            a, b = split_range(
                k,
                r,
                tp_size,
                unit,
                what=f"K ({label})",
                unit_name=unit_name if align == 1 else "aligned unit",
                partial_last=True,
            )
            out.append((n, b - a))
        return out
    parts = [int(s) for s in segments] if segments is not None else [n]
    if sum(parts) != n:
        raise WeightFormatError(
            format_error(
                f"segments {parts} add up to {sum(parts)}, not N = {n}",
                "segments are the row counts of the fused parts",
                "fix the segments",
            )
        )
    unit = fp8_block[0] if fp8_block else 1
    unit = unit if heads else math.lcm(unit, align)
    return [
        (sum(b - a for a, b in column_ranges(parts, r, tp_size, heads=heads, unit=unit)), k)
        for r in range(tp_size)
    ]

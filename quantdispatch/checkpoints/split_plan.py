"""Which rows and columns of a linear layer a tensor-parallel rank holds: the arithmetic only
(no tensors), shared by the quantized and unquantized shard readers, ``doctor --shape``
(:func:`~quantdispatch.checkpoints.linear_shard_shapes`) and the MoE intermediate split.

N splits are as even as possible (earlier ranks take the remainder), in rows or in blocks of
rows; fused layers split each part on its own (q/k/v by head group); K splits take whole units
(scale groups), as even as possible in units. The rules are spelled out in
:mod:`quantdispatch.checkpoints.tensor_parallel`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from quantdispatch.errors import ConfigurationError, WeightFormatError, format_error

__all__ = [
    "Parallel",
    "Rows",
    "TpSplit",
    "check_tp",
    "column_ranges",
    "plan_split",
    "split_range",
    "tp_of_group",
]

Parallel = Literal["column", "row"]

#: Per part of a column-parallel layer, its row ranges [start, stop) in the part's own rows.
Rows = list[list[tuple[int, int]]]


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


def tp_of_group(
    tp_rank: int | None, tp_size: int | None, process_group: object = None
) -> tuple[int, int]:
    """(tp_rank, tp_size) checked against ``process_group`` (a torch.distributed group: this
    rank's group of tensor-parallel peers), which fills the ones left None; without a group,
    None means rank 0 of 1. Each rank checks itself against the group, with no collective, so
    ranks that disagree fail at load instead of summing wrong shards (or hanging)."""
    if process_group is None:
        return (0 if tp_rank is None else tp_rank), (1 if tp_size is None else tp_size)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigurationError(
            format_error(
                "process_group given but torch.distributed is not initialized",
                "the group says which rank of how many this process is",
                "call torch.distributed.init_process_group first, or pass tp_rank / tp_size only",
            )
        )
    try:
        size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConfigurationError(
            format_error(
                f"process_group {process_group!r} is not a usable group ({exc})",
                "pass the torch.distributed group of this rank's tensor-parallel peers",
                "pass the group made by torch.distributed.new_group",
            )
        ) from None
    if rank < 0:
        raise ConfigurationError(
            format_error(
                "this process is not a member of process_group",
                "a rank loads its shard of its own tensor-parallel group",
                "pass the group this process belongs to",
            )
        )
    for name, given, actual in (("tp_size", tp_size, size), ("tp_rank", tp_rank, rank)):
        if given is not None and given != actual:
            raise ConfigurationError(
                format_error(
                    f"{name}={given!r} but process_group says {actual} (rank {rank} of {size})",
                    "every rank's tp_rank / tp_size are its group's rank and size, or the "
                    "shards it loads do not add up to the layer",
                    "pass the group's values (or leave tp_rank / tp_size out: the group fills "
                    "them)",
                )
            )
    return rank, size


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


@dataclass(frozen=True)
class TpSplit:
    """How a linear layer is split over tensor-parallel ranks, and which rank loads it.

    ``parallel``: "column" splits N (q/k/v, gate/up), "row" splits K (o, down). ``heads=(q heads,
    kv heads)``: fused q/k/v split per head group. ``segments``: row counts of parts stacked in
    one tensor. ``align``: splits in whole multiples of it too (not N with ``heads``).
    Checked at construction."""

    tp_rank: int = 0
    tp_size: int = 1
    parallel: Parallel = "column"
    heads: tuple[int, int] | None = None
    segments: Sequence[int] | None = None
    align: int = 1

    def __post_init__(self) -> None:
        check_tp(self.tp_rank, self.tp_size)
        if self.parallel not in ("column", "row"):
            raise ConfigurationError(
                format_error(
                    f"parallel={self.parallel!r}",
                    "parallel is 'column' (split N: q/k/v, gate/up) or 'row' (split K: o, down)",
                    "pass one of them",
                )
            )
        if not isinstance(self.align, int) or self.align < 1:
            raise ConfigurationError(
                format_error(f"align={self.align!r}", "align is a positive integer", "pass e.g. 16")
            )
        if self.segments is not None:
            object.__setattr__(self, "segments", tuple(int(v) for v in self.segments))

    def check_parts(self, prefixes: int) -> None:
        """Refuse segments with several prefixes (they describe parts stacked in one tensor)."""
        if self.segments is not None and prefixes != 1:
            raise ConfigurationError(
                format_error(
                    f"segments={list(self.segments)} with {prefixes} prefixes",
                    "segments describe the parts stacked in one tensor (one prefix)",
                    "pass either one fused prefix with segments or one prefix per part",
                )
            )


def plan_split(
    split: TpSplit,
    part_rows: Sequence[int],
    k: int,
    *,
    group: int = 1,
    row_block: int = 1,
    name: str | None = None,
    label: str = "",
) -> tuple[Rows | None, tuple[int, int] | None]:
    """What ``split.tp_rank`` holds of a linear made of parts with ``part_rows`` rows each (one
    per prefix) and ``k`` columns: (per part, its row ranges in the part's own rows; or None:
    all rows) and (the column range; or None: all columns). ``group``: K per scale,
    ``row_block``: rows per scale (FP8 blocks); ``name`` and ``label`` go into errors."""
    split.check_parts(len(part_rows))
    rank, size = split.tp_rank, split.tp_size
    heads, segments, align = split.heads, split.segments, split.align
    of = f" of {name}" if name else ""
    if split.parallel == "row":
        if len(part_rows) != 1 or segments is not None or heads is not None:
            raise ConfigurationError(
                format_error(
                    f"parallel='row' with {len(part_rows)} part(s), segments {segments}, "
                    f"heads {heads}",
                    "a row-parallel layer (o, down) is one weight split along K",
                    "fused q/k/v or gate/up layers are column parallel",
                )
            )
        unit = math.lcm(group, align)
        cols = split_range(
            k,
            rank,
            size,
            unit,
            what=f"K{of} ({label})" if label else f"K{of}",
            unit_name="column" if unit == 1 else "scale group" if align == 1 else "aligned unit",
            partial_last=True,  # a quantized K is whole groups; FP8 blocks may end short
        )
        return None, cols
    parts = list(part_rows)
    if segments is not None:
        parts = [int(v) for v in segments]
        if sum(parts) != part_rows[0] or min(parts) < 1:
            raise WeightFormatError(
                format_error(
                    f"segments {parts}{of} add up to {sum(parts)} but the weight has "
                    f"N = {part_rows[0]}",
                    "segments are the row counts of the parts stacked in the tensor, in order",
                    "pass e.g. [q_heads*head_dim, kv_heads*head_dim, kv_heads*head_dim]",
                )
            )
    unit = row_block if heads else math.lcm(row_block, align)
    ranges = column_ranges(parts, rank, size, heads=heads, unit=unit)
    if segments is None:
        return [[r] for r in ranges], None
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return [[(s + a, s + b) for s, (a, b) in zip(starts, ranges, strict=True)]], None

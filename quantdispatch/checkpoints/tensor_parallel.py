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

from collections.abc import Mapping, Sequence

import torch

from quantdispatch.checkpoints.config import LayerQuant
from quantdispatch.checkpoints.reader import LoadedLinear, merge_shards, read_linear
from quantdispatch.checkpoints.slices import LayerSlice, linear_geometry, read_slice, tensor_info
from quantdispatch.checkpoints.split_plan import Parallel, TpSplit, check_tp, plan_split
from quantdispatch.errors import (
    CheckpointError,
    ConfigurationError,
    WeightFormatError,
    format_error,
)
from quantdispatch.formats import FP4_GROUP_SIZES

__all__ = ["linear_shard_shapes", "read_dense_shard", "read_linear_shard", "read_linear_split"]

#: Elements along K per scale group of each FP4 format.
_GROUP = FP4_GROUP_SIZES


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
    split = TpSplit(tp_rank, tp_size, parallel, heads, segments, align)
    return read_linear_split(state_dict, prefix, quant, split, device=device)


def read_linear_split(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str | Sequence[str],
    quant: LayerQuant | Sequence[LayerQuant | None] | None,
    split: TpSplit,
    *,
    device: torch.device | str | None = None,
) -> LoadedLinear:
    """:func:`read_linear_shard` with the split given as a :class:`TpSplit`."""
    prefixes = [_normalize(p) for p in ([prefix] if isinstance(prefix, str) else prefix)]
    split.check_parts(len(prefixes))
    quants = _quants(quant, len(prefixes))
    if split.tp_size == 1:
        parts = [
            read_linear(state_dict, p, q, device=device)
            for p, q in zip(prefixes, quants, strict=True)
        ]
        return parts[0] if len(parts) == 1 else merge_shards(parts)
    geos = [linear_geometry(state_dict, p, q) for p, q in zip(prefixes, quants, strict=True)]
    rows, cols = plan_split(
        split,
        [g.n for g in geos],
        geos[0].k,
        group=geos[0].group,
        row_block=max(g.row_block for g in geos),
        name=prefixes[0] if len(prefixes) == 1 else None,
        label=geos[0].label,
    )
    bias = rows is not None or split.tp_rank == 0  # row parallel: rank 0 adds the bias
    parts = [
        read_linear(
            LayerSlice(state_dict, p, g, rows=rows and rows[i], cols=cols, bias=bias),
            p,
            q,
            device=device,
        )
        for i, (p, g, q) in enumerate(zip(prefixes, geos, quants, strict=True))
    ]
    return parts[0] if len(parts) == 1 else merge_shards(parts)


def read_dense_shard(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str | Sequence[str],
    split: TpSplit,
    *,
    why: str = "",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``split.tp_rank``'s (weight, bias or None) of an unquantized linear
    (``{prefix}.weight`` [N, K], ``{prefix}.bias``), split by the rules of
    :func:`read_linear_shard` (K in any columns: no scale groups), reading only the slice.
    Fused prefixes concatenate along N; a part without a bias gets zeros when another part has
    one. A layer the checkpoint stores quantized (scales beside it, or a weight that is not
    16/32-bit float) is refused: ``why`` says why it was read as unquantized."""
    prefixes = [_normalize(p) for p in ([prefix] if isinstance(prefix, str) else prefix)]
    split.check_parts(len(prefixes))
    shapes = []
    for p in prefixes:
        if f"{p}.weight" not in state_dict:
            raise CheckpointError(
                format_error(
                    f"missing tensor '{p}.weight' of unquantized layer {p!r}",
                    "an unquantized linear has a floating-point weight [N, K]",
                    "pass the complete state dict",
                )
            )
        shape, dtype = tensor_info(state_dict, f"{p}.weight")
        _refuse_quantized(state_dict, p, dtype, why)
        shapes.append(shape)
    if len({s[1:] for s in shapes}) != 1 or len(shapes[0]) != 2:
        raise CheckpointError(
            format_error(
                f"the weights of {prefixes} have shapes {shapes}",
                "an unquantized linear's weight is [N, K]; fused parts share K",
                "pass the parts of one layer",
            )
        )
    rows, cols = None, None
    if split.tp_size > 1:
        name = prefixes[0] if len(prefixes) == 1 else None
        rows, cols = plan_split(split, [s[0] for s in shapes], shapes[0][1], name=name)
    tail = () if cols is None else (slice(*cols),)

    def take(key: str, i: int, index: tuple[slice, ...]) -> torch.Tensor:
        if rows is None:  # whole rows: the whole tensor, or its columns (row parallel)
            return read_slice(state_dict, key, (slice(None), *index) if index else ())
        return torch.cat([read_slice(state_dict, key, (slice(a, b), *index)) for a, b in rows[i]])

    weights, biases = [], []
    for i, p in enumerate(prefixes):
        weights.append(take(f"{p}.weight", i, tail))
        has_bias = f"{p}.bias" in state_dict and (cols is None or split.tp_rank == 0)
        biases.append(take(f"{p}.bias", i, ()) if has_bias else None)
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    if all(b is None for b in biases):
        return weight, None
    like = next(b for b in biases if b is not None)
    pieces = [
        b if b is not None else like.new_zeros(w.shape[0])
        for b, w in zip(biases, weights, strict=True)
    ]
    return weight, pieces[0] if len(pieces) == 1 else torch.cat(pieces)


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
    if format in _GROUP and k % group:
        raise WeightFormatError(
            format_error(
                f"K = {k} is not a whole number of {label} scale groups of {group}",
                f"{label} weights have K a multiple of {group}",
                f"check the shape (K = {k // group * group} or {(k // group + 1) * group}?)",
            )
        )
    row_block = fp8_block[0] if fp8_block else 1
    shapes = []
    for r in range(tp_size):
        split = TpSplit(r, tp_size, parallel, heads, segments, align)
        rows, cols = plan_split(split, [n], k, group=group, row_block=row_block, label=label)
        n_r = n if rows is None else sum(b - a for part in rows for a, b in part)
        shapes.append((n_r, k if cols is None else cols[1] - cols[0]))
    return shapes


#: Tensors beside a weight that only quantized layers have.
_SCALE_LEAVES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale")


def _refuse_quantized(
    state_dict: Mapping[str, torch.Tensor], prefix: str, dtype: torch.dtype, why: str
) -> None:
    scales = [leaf for leaf in _SCALE_LEAVES if f"{prefix}.{leaf}" in state_dict]
    if dtype in (torch.float16, torch.bfloat16, torch.float32) and not scales:
        return
    stored = f"its weight is {dtype}" + (f" with {', '.join(scales)}" if scales else "")
    raise CheckpointError(
        format_error(
            f"{prefix!r} is read as an unquantized linear{f' ({why})' if why else ''}, but the "
            f"checkpoint stores it quantized ({stored})",
            "an unquantized linear has a 16- or 32-bit float weight and no scales; reading "
            "quantized codes as floats gives wrong outputs",
            "fix the config's exclusion list (ignore / exclude_modules) so it does not name "
            "this layer, or load it with QuantLinear.from_checkpoint",
        )
    )

"""Tensor-parallel slicing of canonical weights, without dequantizing.

Column-parallel layers (q/k/v, gate/up) split N; row-parallel layers (o, down) split K. A slice
keeps the per-tensor scale of the whole tensor (it is the same multiplier for every element), so
the shards' outputs concatenate (N) or sum (K) to the full layer exactly. K slices must start on a
scale-group boundary; FP8 block-scaled slices must start on block boundaries. Uneven splits are
allowed (the last ranks get one row / group less), because our kernels take any N: peers' fixed
N % 64 tile rules broke exactly here.
"""

from __future__ import annotations

from typing import Literal

from quantdispatch.checkpoints.reader import QuantWeight
from quantdispatch.checkpoints.split_plan import split_range
from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.formats import (
    MXFP4_GROUP_SIZE,
    NVFP4_GROUP_SIZE,
    Fp8Weight,
    Mxfp4Weight,
    Nvfp4Weight,
)

__all__ = ["shard_bounds", "shard_weight"]


def shard_bounds(
    size: int, rank: int, world_size: int, unit: int = 1, *, partial_last: bool = False
) -> tuple[int, int]:
    """[start, stop) of ``rank``'s share of ``size`` elements, in whole ``unit``s (as even as
    possible, earlier ranks take the remainder; ``partial_last``: the last unit may be short):
    :func:`~.split_plan.split_range` under the rank / world_size names of :func:`shard_weight`."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigurationError(
            format_error(
                f"rank={rank}, world_size={world_size}",
                "0 <= rank < world_size and world_size >= 1",
                "pass this process's tensor-parallel rank and size",
            )
        )
    return split_range(size, rank, world_size, unit, partial_last=partial_last)


def shard_weight(
    weight: QuantWeight, *, dim: Literal["n", "k"], rank: int, world_size: int
) -> QuantWeight:
    """``rank``'s slice of ``weight`` along N (column parallel) or K (row parallel)."""
    if dim not in ("n", "k"):
        raise ConfigurationError(
            format_error(f"dim={dim!r}", "dim is 'n' (column parallel) or 'k' (row parallel)", "")
        )
    n, k = weight.shape
    if isinstance(weight, Fp8Weight):
        return _shard_fp8(weight, dim, rank, world_size)
    group = NVFP4_GROUP_SIZE if isinstance(weight, Nvfp4Weight) else MXFP4_GROUP_SIZE
    if dim == "n":
        a, b = shard_bounds(n, rank, world_size)
        rows = slice(a, b)
        cols_p, cols_s = slice(None), slice(None)
    else:
        a, b = shard_bounds(k, rank, world_size, unit=group)
        rows, cols_p, cols_s = slice(None), slice(a // 2, b // 2), slice(a // group, b // group)
    packed = weight.packed[rows, cols_p].contiguous()
    scale = weight.block_scale[rows, cols_s].contiguous()
    if isinstance(weight, Mxfp4Weight):
        return Mxfp4Weight(packed=packed, block_scale=scale)
    return Nvfp4Weight(
        packed=packed,
        block_scale=scale,
        global_scale=weight.global_scale,
        input_scale=weight.input_scale,
    )


def _shard_fp8(weight: Fp8Weight, dim: str, rank: int, world_size: int) -> Fp8Weight:
    n, k = weight.shape
    kind = weight.scale_kind
    if kind == "block":
        bn, bk = weight.block_size  # type: ignore[misc]
        size, unit = (n, bn) if dim == "n" else (k, bk)
        # whole blocks per rank; the last block may be partial
        a, b = shard_bounds(size, rank, world_size, unit, partial_last=True)
        first, last = a // unit, -(-b // unit)
        if dim == "n":
            w, scale = weight.weight[a:b], weight.scale[first:last]
        else:
            w, scale = weight.weight[:, a:b], weight.scale[:, first:last]
    elif dim == "n":
        a, b = shard_bounds(n, rank, world_size)
        w = weight.weight[a:b]
        scale = weight.scale if kind == "tensor" else weight.scale[a:b]
    else:
        a, b = shard_bounds(k, rank, world_size)
        w, scale = weight.weight[:, a:b], weight.scale
    return Fp8Weight(
        weight=w.contiguous(),
        scale=scale.contiguous(),
        block_size=weight.block_size,
        input_scale=weight.input_scale,
    )

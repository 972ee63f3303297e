"""One linear layer's checkpoint tensors cut to a tensor-parallel rank's rows or columns.

:class:`LayerSlice` is a read-only mapping over the layer's own tensors that hands out each one
already cut (codes, block scales and FP8 scales by their role, per-tensor scales whole, the
bias by the parallel style), reading only that part from a :class:`SafetensorsStateDict`. The
canonical readers (:func:`~quantdispatch.checkpoints.reader.read_linear`) run on it unchanged,
so a shard is validated and converted exactly as the whole layer would be.

:func:`linear_geometry` answers "which format, N and K is the layer at this prefix" from the
tensors' shapes and dtypes alone (the safetensors header), before anything is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from quantdispatch.checkpoints.config import LayerQuant
from quantdispatch.checkpoints.reader import _children, read_linear
from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.formats import FP4_FORMATS

__all__ = ["LayerSlice", "LinearGeometry", "linear_geometry", "read_slice", "tensor_info"]

_GPT_OSS = ("_blocks", "_scales", "_bias")


def tensor_info(sd: Mapping[str, torch.Tensor], key: str) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of ``sd[key]``; read from the file header when ``sd`` can (a
    :class:`SafetensorsStateDict`), from the tensor otherwise."""
    info = getattr(sd, "tensor_info", None)
    if callable(info):
        return info(key)  # type: ignore[no-any-return]
    t = sd[key]
    return tuple(int(v) for v in t.shape), t.dtype


def read_slice(
    sd: Mapping[str, torch.Tensor], key: str, index: tuple[slice | int, ...]
) -> torch.Tensor:
    """``sd[key][index]``, reading only that part where ``sd`` can (``read_slice`` method)."""
    if not index:
        return sd[key]
    reader = getattr(sd, "read_slice", None)
    if callable(reader):
        return reader(key, index)  # type: ignore[no-any-return]
    return sd[key][index].contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LinearGeometry:
    """A quantized linear's format and [N, K], known before its tensors are read."""

    format: str
    n: int
    k: int
    keys: tuple[str, ...]
    """The layer's own keys (``prefix.<name>``, gpt-oss ``prefix_blocks`` ...)."""
    fp8_scale: str | None = None
    """FP8 weights: "tensor", "channel" or "block"."""
    fp8_block: tuple[int, int] | None = None

    @property
    def group(self) -> int:
        """Elements along K per scale: 16 (NVFP4), 32 (MXFP4), bk (FP8 blocks), else 1."""
        if self.format == "nvfp4":
            return 16
        if self.format == "mxfp4":
            return 32
        return self.fp8_block[1] if self.fp8_block else 1

    @property
    def row_block(self) -> int:
        """Rows per scale along N: bn for FP8 block scales, else 1."""
        return self.fp8_block[0] if self.fp8_block else 1

    @property
    def label(self) -> str:
        if self.format == "fp8":
            block = f" {self.fp8_block[0]}x{self.fp8_block[1]}" if self.fp8_block else ""
            return f"FP8 ({self.fp8_scale} scales{block})"
        return self.format.upper()


def _layer_keys(sd: Mapping[str, torch.Tensor], prefix: str, keys: Iterable[str] | None) -> list:
    pool = list(sd.keys()) if keys is None else list(keys)
    own = list(_children(pool, prefix).values())
    members = set(pool) if keys is not None else sd
    own += [prefix + s for s in _GPT_OSS if prefix + s in members]
    return own


def linear_geometry(
    sd: Mapping[str, torch.Tensor],
    prefix: str,
    quant: LayerQuant | None = None,
    *,
    keys: Iterable[str] | None = None,
) -> LinearGeometry:
    """Format, N and K of the quantized linear at ``prefix`` from shapes and dtypes only.

    ``keys`` narrows the search for the layer's tensors (default: every key of ``sd``). A layer
    that ``read_linear`` would refuse raises its error here.
    """
    own = _layer_keys(sd, prefix, keys)
    names = {
        k[len(prefix) + 1 :] if k.startswith(prefix + ".") else k[len(prefix) :]: k for k in own
    }

    def info(name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return tensor_info(sd, names[name])

    geometry = None
    if "_blocks" in names and "_scales" in names:
        shape, _ = info("_blocks")
        if len(shape) == 3 and shape[2] == 16:
            geometry = LinearGeometry("mxfp4", shape[0], shape[1] * 32, tuple(own))
    elif "weight_packed" in names:
        shape, _ = info("weight_packed")
        nv = "weight_global_scale" in names or (
            "weight_scale" in names and info("weight_scale")[1] == torch.float8_e4m3fn
        )
        if len(shape) == 2:
            geometry = LinearGeometry(
                "nvfp4" if nv else "mxfp4", shape[0], shape[1] * 2, tuple(own)
            )
    elif "weight" in names:
        shape, dtype = info("weight")
        if len(shape) == 2 and dtype == torch.uint8:
            geometry = LinearGeometry("nvfp4", shape[0], shape[1] * 2, tuple(own))
        elif len(shape) == 2 and dtype == torch.float8_e4m3fn:
            geometry = _fp8_geometry(names, info, shape[0], shape[1], quant, tuple(own))
    if geometry is None:
        # not a layer we can cut: let the reader say what is wrong with it
        read_linear(sd, prefix, quant)
        raise CheckpointError(
            format_error(
                f"the layer at {prefix!r} has tensors {sorted(names)}",
                "tensor-parallel shards are read from ModelOpt / compressed-tensors NVFP4, "
                "MXFP4, gpt-oss blocks and FP8 layers",
                "load the whole layer and cut it with shard_weight",
            )
        )
    return geometry


def _fp8_geometry(names, info, n, k, quant, own) -> LinearGeometry | None:
    name = "weight_scale_inv" if "weight_scale_inv" in names else "weight_scale"
    if name not in names:
        return None
    shape, _ = info(name)
    numel = 1
    for v in shape:
        numel *= v
    if numel == 1:
        return LinearGeometry("fp8", n, k, own, "tensor")
    if len(shape) in (1, 2) and shape[0] == n and numel == n:
        return LinearGeometry("fp8", n, k, own, "channel")
    block = quant.fp8_block if quant is not None and quant.fp8_block else (128, 128)
    if len(shape) == 2 and shape == (_cdiv(n, block[0]), _cdiv(k, block[1])):
        return LinearGeometry("fp8", n, k, own, "block", block)
    return None


class KeyView(Mapping[str, torch.Tensor]):
    """The tensors of a state dict under ``keys`` (in that order), each read by :meth:`_get`:
    readers scan these keys, not the whole checkpoint."""

    def __init__(self, base: Mapping[str, torch.Tensor], keys: Iterable[str]) -> None:
        self._base = base
        self._keys = list(keys)
        self._set = frozenset(self._keys)

    def _get(self, key: str) -> torch.Tensor:
        return self._base[key]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._set:
            raise KeyError(key)
        return self._get(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._set


class LayerSlice(KeyView):
    """The tensors of the layer at ``prefix`` cut to ``rows`` (ranges of output rows, in
    order, concatenated) and / or ``cols`` (one range of input columns), read on access.

    ``bias=False`` hides the bias (row-parallel ranks other than 0). ``weight_shape`` (the
    compressed-tensors record of [N, K]) is rewritten to the shard's shape.
    """

    def __init__(
        self,
        base: Mapping[str, torch.Tensor],
        prefix: str,
        geometry: LinearGeometry,
        *,
        rows: Sequence[tuple[int, int]] | None = None,
        cols: tuple[int, int] | None = None,
        bias: bool = True,
    ) -> None:
        self._prefix, self._geo = prefix, geometry
        self._rows = None if rows is None else [(int(a), int(b)) for a, b in rows]
        self._cols = None if cols is None else (int(cols[0]), int(cols[1]))
        keys = list(geometry.keys)
        if not bias:
            keys = [k for k in keys if self._name(k) not in ("bias", "_bias")]
        super().__init__(base, keys)
        self._cache: dict[str, torch.Tensor] = {}
        g = geometry
        for a, b in self._rows or []:
            if not (0 <= a < b <= g.n) or a % g.row_block or (b % g.row_block and b != g.n):
                self._bad_range("rows", (a, b), g.n, g.row_block)
        if self._cols is not None:
            a, b = self._cols
            if not (0 <= a < b <= g.k) or a % g.group or (b % g.group and b != g.k):
                self._bad_range("columns", (a, b), g.k, g.group)

    def _bad_range(self, what: str, rng: tuple[int, int], size: int, unit: int) -> None:
        raise CheckpointError(
            format_error(
                f"{self._prefix}: {what} {rng[0]}:{rng[1]} of {size} ({self._geo.label})",
                f"a shard takes whole scale units of {unit} {what}, inside the weight",
                "compute the ranges with the tensor_parallel helpers",
            )
        )

    def _name(self, key: str) -> str:
        p = self._prefix
        return key[len(p) + 1 :] if key.startswith(p + ".") else key[len(p) :]

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K] of the shard."""
        n = self._geo.n if self._rows is None else sum(b - a for a, b in self._rows)
        k = self._geo.k if self._cols is None else self._cols[1] - self._cols[0]
        return n, k

    def _index(self, name: str) -> tuple[int, int, int] | None:
        """(row unit, column unit, which leading dims are cut) of a tensor, None if whole."""
        g = self._geo
        if name in ("bias", "_bias"):
            return (1, 0, 1)
        if g.format in FP4_FORMATS:
            if name in ("weight", "weight_packed"):
                return (1, 2, 2)
            if name in ("weight_scale", "_scales", "_blocks"):
                return (1, 32 if name == "_blocks" else g.group, 2)
            return None
        if name == "weight":
            return (1, 1, 2)
        if name in ("weight_scale", "weight_scale_inv"):
            if g.fp8_scale == "channel":
                return (1, 0, 1)
            if g.fp8_scale == "block":
                bn, bk = g.fp8_block  # type: ignore[misc]
                return (bn, bk, 2)
        return None

    def _read(self, key: str) -> torch.Tensor:
        name = self._name(key)
        if name == "weight_shape":
            t = self._base[key]
            if tuple(int(v) for v in t.tolist()) == (self._geo.n, self._geo.k):
                return torch.tensor(self.shape, dtype=t.dtype)
            return t  # inconsistent: the reader names it
        shape, _ = tensor_info(self._base, key)
        how = self._index(name)
        if how is None or not shape:
            return self._base[key]
        row_unit, col_unit, dims = how
        cols: slice = slice(None)
        if self._cols is not None and col_unit and dims == 2:
            a, b = self._cols
            cols = slice(a // col_unit, _cdiv(b, col_unit))
        elif self._cols is not None and name in ("bias", "_bias"):
            return self._base[key]  # row parallel: the whole bias (rank 0 only)
        rows = self._rows or [(0, self._geo.n)]
        parts = []
        for a, b in rows:
            index: tuple[slice, ...] = (slice(a // row_unit, _cdiv(b, row_unit)),)
            if dims == 2 and len(shape) >= 2:
                index += (cols,)
            whole = self._rows is None and cols == slice(None)
            parts.append(self._base[key] if whole else read_slice(self._base, key, index))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _get(self, key: str) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = self._read(key)
        return self._cache[key]

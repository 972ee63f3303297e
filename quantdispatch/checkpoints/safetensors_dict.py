"""A lazy, read-only state dict over safetensors files (one file, a folder, or a sharded index).

Tensors are read only when asked for, so loading one layer of a 100 GB checkpoint reads that
layer's bytes and nothing else; :meth:`SafetensorsStateDict.read_slice` reads part of a tensor
(a tensor-parallel rank's rows or columns) and :meth:`SafetensorsStateDict.tensor_info` its
shape and dtype, from the file header alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from quantdispatch.checkpoints.shards import dtype_and_shape, guarded, shard_map
from quantdispatch.errors import CheckpointError, format_error

__all__ = ["SafetensorsStateDict"]

#: safetensors dtype names -> torch dtypes (those a quantized checkpoint holds).
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsStateDict(Mapping[str, torch.Tensor]):
    """``Mapping[str, Tensor]`` over ``*.safetensors`` files; tensors load on access, on CPU.

    ``bytes_read`` counts the bytes of every tensor and slice returned so far (what a loader
    really pulled out of the files). Which shard holds each tensor, and the checks on the
    index and the headers: :mod:`quantdispatch.checkpoints.shards`.
    """

    def __init__(self, path: str | Path) -> None:
        self._where, self.files = shard_map(Path(path))
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0

    def _handle(self, key: str) -> tuple[Path, Any]:
        f = self._where[key]
        h = self._handles.get(f)
        if h is None:
            from safetensors import safe_open

            h = self._handles[f] = guarded(f, "open", safe_open, str(f), "pt")
        return f, h

    def __getitem__(self, key: str) -> torch.Tensor:
        f, h = self._handle(key)
        t = guarded(f, f"tensor {key!r}", h.get_tensor, key)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def headers(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{tensor name: (safetensors dtype name, shape)} from the shards' headers."""
        out = {}
        for key in self._where:
            f, h = self._handle(key)
            out[key] = guarded(f, f"header of {key!r}", dtype_and_shape, h, key)
        return out

    def tensor_info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of ``key`` from the file header; no tensor data is read."""
        f, h = self._handle(key)
        name, shape = guarded(f, f"header of {key!r}", dtype_and_shape, h, key)
        if name not in _DTYPES:
            raise CheckpointError(
                format_error(
                    f"{key} has safetensors dtype {name} ({f})",
                    f"quantized checkpoints hold {', '.join(_DTYPES)} tensors",
                    "check the checkpoint",
                )
            )
        return shape, _DTYPES[name]

    def read_slice(self, key: str, index: tuple[slice | int, ...]) -> torch.Tensor:
        """``self[key][index]`` reading only the selected part of the file (basic slices with
        step 1 and integers, one per leading dimension)."""
        f, h = self._handle(key)
        t = guarded(f, f"tensor {key!r}", _read_slice, h, key, index)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def __getstate__(self) -> dict[str, Any]:
        # open file handles stay with this process; a copy (a rank's process) opens its own
        return {**self.__dict__, "_handles": {}}

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where


def _read_slice(handle: Any, key: str, index: tuple[slice | int, ...]) -> torch.Tensor:
    return handle.get_slice(key)[index]

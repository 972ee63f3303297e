"""A lazy, read-only state dict over safetensors files (one file, a folder, or a sharded index).

Tensors are read only when asked for, so loading one layer of a 100 GB checkpoint reads that
layer's bytes and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from quantdispatch.errors import CheckpointError, format_error

__all__ = ["SafetensorsStateDict"]


class SafetensorsStateDict(Mapping[str, torch.Tensor]):
    """``Mapping[str, Tensor]`` over ``*.safetensors`` files; tensors load on access, on CPU."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        p = Path(path)
        if p.is_file():
            files = [p]
        elif (p / "model.safetensors.index.json").is_file():
            index = json.loads((p / "model.safetensors.index.json").read_text(encoding="utf-8"))
            files = sorted({p / f for f in index.get("weight_map", {}).values()})
        elif p.is_dir():
            files = sorted(p.glob("*.safetensors"))
        else:
            files = []
        if not files:
            raise CheckpointError(
                format_error(
                    f"no safetensors files at {str(path)!r}",
                    "a checkpoint is a .safetensors file, or a folder with *.safetensors "
                    "(optionally model.safetensors.index.json)",
                    "check the path",
                )
            )
        self._where: dict[str, Path] = {}
        self._open = safe_open
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._where[k] = f

    def __getitem__(self, key: str) -> torch.Tensor:
        f = self._where[key]
        with self._open(str(f), framework="pt") as h:
            return h.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

"""Which safetensors file holds each tensor of a checkpoint, read from files that came from a
download: ``model.safetensors.index.json`` against a declared schema, every shard's header
through ``safetensors.safe_open`` (which checks its length, JSON, dtypes, shapes and offsets
against the file), each problem one ``CheckpointError`` naming the file and the fix.

* With an index, the index decides where each tensor it lists lives: it must name shards inside
  the checkpoint folder that exist and hold that tensor. A tensor it does not list is taken from
  the one shard that holds it; if several do, that is an error.
* Without an index (a folder of shards), a tensor held by two shards is an error naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, StrictStr

from quantdispatch.checkpoints.config import read_json
from quantdispatch.checkpoints.config_schema import validate
from quantdispatch.errors import CheckpointError, format_error

__all__ = ["INDEX_FILE", "IndexFile", "guarded", "shard_map"]

INDEX_FILE = "model.safetensors.index.json"

T = TypeVar("T")


class IndexFile(BaseModel):
    """``model.safetensors.index.json``: ``weight_map`` {tensor name: shard file name}."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)

    weight_map: dict[StrictStr, StrictStr]


def guarded(shard: Path, what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with the safetensors library's errors as a CheckpointError naming
    ``shard``."""
    from safetensors import SafetensorError

    try:
        return fn(*args)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            format_error(
                f"safetensors file {shard} cannot be read ({what}): {exc}",
                "a shard is a complete safetensors file whose header describes its data",
                "re-download or re-export the file (a partial download leaves a truncated one)",
            )
        ) from None


def _keys(shard: Path) -> list[str]:
    from safetensors import safe_open

    def read() -> list[str]:
        with safe_open(str(shard), framework="pt") as h:
            return list(h.keys())

    return guarded(shard, "header", read)


def _index_files(folder: Path, index: Path) -> dict[str, Path]:
    """{tensor: shard path} as the index states it, every shard checked to be in ``folder``."""
    data = validate(IndexFile, read_json(index), str(index), "")
    root = folder.resolve()
    out: dict[str, Path] = {}
    seen: dict[str, Path] = {}
    for key, name in data.weight_map.items():
        f = seen.get(name)
        if f is None:
            f = (folder / name).resolve()
            if Path(name).is_absolute() or not f.is_relative_to(root):
                raise CheckpointError(
                    format_error(
                        f"{index}: weight_map[{key!r}] = {name!r} points outside the checkpoint "
                        "folder",
                        "an index names shard files inside its own folder",
                        "fix the index (shard names are plain file names)",
                    )
                )
            if not f.is_file():
                raise CheckpointError(
                    format_error(
                        f"{index}: weight_map[{key!r}] names the shard {name!r}, which is not a "
                        f"file in {folder}",
                        "every shard the index names is in the checkpoint folder",
                        "download the missing shard (or the whole checkpoint again)",
                    )
                )
            seen[name] = f
        out[key] = f
    return out


def shard_map(path: Path) -> tuple[dict[str, Path], list[Path]]:
    """({tensor name: its shard}, the shards) of a .safetensors file or a checkpoint folder."""
    if path.is_file():
        files = [path]
        stated: dict[str, Path] = {}
    elif (path / INDEX_FILE).is_file():
        stated = _index_files(path, path / INDEX_FILE)
        files = sorted(set(stated.values()))
    elif path.is_dir():
        files = sorted(f for f in path.glob("*.safetensors") if f.is_file())
        stated = {}
    else:
        files, stated = [], {}
    if not files:
        raise CheckpointError(
            format_error(
                f"no safetensors files at {str(path)!r}",
                "a checkpoint is a .safetensors file, or a folder with *.safetensors "
                "(optionally model.safetensors.index.json)",
                "check the path",
            )
        )
    where: dict[str, Path] = {}
    held: dict[Path, set[str]] = {}
    for f in files:
        keys = _keys(f)
        held[f] = set(keys)
        for k in keys:
            if k in stated:
                continue
            other = where.get(k)
            if other is not None:
                raise CheckpointError(
                    format_error(
                        f"tensor {k!r} is in two shards, {other.name} and {f.name} ({path})",
                        "each tensor is stored once"
                        + ("" if stated else " (or an index says which shard holds it)"),
                        "remove the stale shard (or re-download the checkpoint)",
                    )
                )
            where[k] = f
    for k, f in stated.items():
        if k not in held[f]:
            raise CheckpointError(
                format_error(
                    f"{path / INDEX_FILE} puts tensor {k!r} in {f.name}, which does not hold it",
                    "the index and the shards' headers agree",
                    "re-download the index and the shards together",
                )
            )
        where[k] = f
    return where, files


def dtype_and_shape(handle: Any, key: str) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype name, shape) of ``key`` from an open shard's header."""
    s = handle.get_slice(key)
    return str(s.get_dtype()), tuple(int(v) for v in s.get_shape())

"""Damaged or lying safetensors shards and index files: a CheckpointError naming the file, never
the library's raw error, a MemoryError, a followed path outside the folder or a silent pick."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from quantdispatch.checkpoints import SafetensorsStateDict
from quantdispatch.errors import CheckpointError
from quantdispatch.integrations.transformers.checkpoint import read_headers

INDEX = "model.safetensors.index.json"


def _shard(path, tensors=None):
    tensors = tensors if tensors is not None else {"a.weight": torch.arange(64.0).reshape(8, 8)}
    save_file(tensors, str(path))
    return path


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def _index(folder, weight_map):
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# -- case 11: damaged shards ---------------------------------------------------------------------


@pytest.mark.parametrize("reader", [SafetensorsStateDict, read_headers])
@pytest.mark.parametrize("damage", ["truncated", "offsets", "shape", "length 2**40", "empty"])
def test_a_damaged_shard_is_named(tmp_path, reader, damage):
    f = _shard(tmp_path / "model.safetensors")
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-40])
    elif damage == "offsets":
        _rewrite_header(f, lambda h: h["a.weight"].update(data_offsets=[0, 10**12]))
    elif damage == "shape":
        _rewrite_header(f, lambda h: h["a.weight"].update(shape=[1000, 1000]))
    elif damage == "length 2**40":
        f.write_bytes(struct.pack("<Q", 2**40) + f.read_bytes()[8:])
    else:
        f.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read"):
        reader(tmp_path)


def test_index_problems_are_named(tmp_path):
    _shard(tmp_path / "model-00001.safetensors")
    (tmp_path / INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsStateDict(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": [["a.weight", "x"]]}))
    with pytest.raises(CheckpointError, match=r"index\.json.*weight_map.*mapping"):
        SafetensorsStateDict(tmp_path)
    (tmp_path / INDEX).write_bytes(b'{"weight_map": {"a.weight": "\xff.safetensors"}}')
    with pytest.raises(CheckpointError, match="not UTF-8"):
        SafetensorsStateDict(tmp_path)
    _index(tmp_path, {"a.weight": "model-00002.safetensors"})
    with pytest.raises(CheckpointError, match=r"model-00002\.safetensors.*not a file"):
        SafetensorsStateDict(tmp_path)


@pytest.mark.parametrize("outside", ["absolute", "parent"])
def test_index_paths_outside_the_folder_are_not_followed(tmp_path, outside):
    elsewhere = _shard(tmp_path / "elsewhere.safetensors")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _shard(folder / "model-00001.safetensors", {"b.weight": torch.ones(2, 2)})
    name = str(elsewhere) if outside == "absolute" else "../elsewhere.safetensors"
    _index(folder, {"a.weight": name, "b.weight": "model-00001.safetensors"})
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        SafetensorsStateDict(folder)


# -- case 5: one tensor in two shards ------------------------------------------------------------


def test_a_tensor_in_two_shards_without_an_index_is_an_error(tmp_path):
    _shard(tmp_path / "model-00001.safetensors", {"a.weight": torch.zeros(2, 2)})
    _shard(tmp_path / "model-00002.safetensors", {"a.weight": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match=r"'a\.weight' is in two shards.*00001.*00002"):
        SafetensorsStateDict(tmp_path)


def test_the_index_decides_which_shard_holds_a_tensor(tmp_path):
    _shard(tmp_path / "model-00001.safetensors", {"a.weight": torch.ones(2, 2)})
    _shard(tmp_path / "model-00002.safetensors", {"a.weight": torch.zeros(2, 2)})
    _index(tmp_path, {"a.weight": "model-00001.safetensors"})
    assert torch.equal(SafetensorsStateDict(tmp_path)["a.weight"], torch.ones(2, 2))
    assert read_headers(tmp_path) == {"a.weight": ("F32", (2, 2))}
    _index(tmp_path, {"a.weight": "model-00001.safetensors", "b.weight": "model-00002.safetensors"})
    with pytest.raises(CheckpointError, match=r"'b\.weight' in model-00002.*does not hold it"):
        SafetensorsStateDict(tmp_path)

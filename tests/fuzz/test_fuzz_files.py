"""Fuzzing safetensors headers and index files, policy files, the self-check cache and
environment values: each reader gives its result or one of our exception types."""

from __future__ import annotations

import contextlib
import json
import struct
import tempfile
import threading
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_fuzz_configs import JSON

from quantdispatch.api import load_settings
from quantdispatch.checkpoints import SafetensorsStateDict
from quantdispatch.errors import CheckpointError, ConfigurationError
from quantdispatch.integrations.transformers.checkpoint import read_headers
from quantdispatch.policy import load_policy, parse_policy
from quantdispatch.selfcheck_cache import read_entries, recorded

DTYPES = ["F32", "F16", "BF16", "U8", "I8", "F8_E4M3", "F64", "BOOL", "Q4", "", 7]


def _valid_shard() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "x.safetensors"
        save_file(
            {"a": torch.arange(12.0).reshape(3, 4), "b": torch.zeros(8, dtype=torch.uint8)}, f
        )
        return f.read_bytes()


SHARD = _valid_shard()
(_N,) = struct.unpack("<Q", SHARD[:8])
HEADER = json.loads(SHARD[8 : 8 + _N])
BODY = SHARD[8 + _N :]

INFO = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(DTYPES) | JSON,
        "shape": st.lists(st.integers(-2, 2**40), max_size=3) | JSON,
        "data_offsets": st.lists(st.integers(-2, 2**64), max_size=3) | JSON,
    },
)
HEADERS = st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]), INFO | JSON, max_size=4)


def _read_everything(folder: Path) -> None:
    try:
        sd = SafetensorsStateDict(folder)
        for key in sd:
            sd.tensor_info(key)
            _ = sd[key]
        read_headers(folder)
    except CheckpointError:
        pass


def _shard_bytes(header: object, length: int | None, cut: int) -> bytes:
    body = json.dumps(header).encode()
    size = len(body) if length is None else length
    raw = struct.pack("<Q", size % 2**64) + body + BODY
    return raw[: len(raw) - cut] if cut else raw


@given(
    header=HEADERS.map(lambda h: {**HEADER, **h}),
    length=st.none() | st.integers(0, 2**64 - 1),
    cut=st.integers(0, 64),
)
def test_shards_with_lying_headers(header, length, cut):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model.safetensors").write_bytes(_shard_bytes(header, length, cut))
        _read_everything(Path(d))


@given(raw=st.binary(max_size=120))
def test_shards_of_any_bytes(raw):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model.safetensors").write_bytes(raw)
        _read_everything(Path(d))


WEIGHT_MAPS = st.dictionaries(
    st.sampled_from(["a", "b", "zz"]),
    st.sampled_from(["model.safetensors", "other.safetensors", "../x.safetensors", "/etc/passwd",
                     ".", "", "sub/../model.safetensors"]) | JSON,
    max_size=3,
) | JSON  # fmt: skip


@given(weight_map=WEIGHT_MAPS, extra=st.dictionaries(st.text(max_size=5), JSON, max_size=2))
def test_index_files(weight_map, extra):
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        (folder / "model.safetensors").write_bytes(SHARD)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({**extra, "weight_map": weight_map})
        )
        _read_everything(folder)


POLICY_TEXT = (
    st.text(max_size=200)
    | st.lists(
        st.sampled_from(
            ["[nvfp4]", "[fp8]", "[nope]", 'linear = ["triton", "reference"]', "moe = []",
             'linear = "triton"', "linear = [1, 2]", "version = 1", "version = 2",
             'fp8_compute = "prefill"', 'fp8_compute = "x"', "fp8_compute = 3", "[nvfp4.linear]",
             'linear = ["reference", "reference"]', "a = [[[[[[1]]]]]]", "=", '"\\u0000" = 1']
        ),
        max_size=6,
    ).map("\n".join)
)  # fmt: skip


@given(text=POLICY_TEXT, raw=st.none() | st.binary(max_size=64))
def test_policy_files(text, raw):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "p.toml"
        f.write_bytes(raw if raw is not None else text.encode("utf-8", "surrogatepass"))
        with contextlib.suppress(ConfigurationError):
            load_policy(f)


@given(data=st.dictionaries(st.text(max_size=10), JSON, max_size=5) | JSON)
def test_parsed_policy_tables(data):
    with contextlib.suppress(ConfigurationError):
        parse_policy(data, "fuzz.toml")


ENTRY = st.fixed_dictionaries(
    {},
    optional={
        k: JSON | st.floats() | st.booleans()
        for k in ("backend", "passed", "detail", "worst", "seconds", "date", "digest")
    },
)


@given(
    raw=st.binary(max_size=100)
    | st.builds(
        lambda v, e: json.dumps({"version": v, "entries": e}).encode(),
        st.sampled_from([2, 1, "2", None]),
        st.dictionaries(st.text(max_size=4), st.dictionaries(st.text(max_size=4), ENTRY | JSON))
        | JSON,
    )
)
def test_selfcheck_cache_files(raw):
    warnings: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "selfcheck.json"
        f.write_bytes(raw)
        entries = read_entries(f, warnings.append)
    for env, probes in entries.items():
        for probe in probes:
            result = recorded(entries, env, probe, warnings.append)
            assert result is None or isinstance(result.passed, bool)


ENV_NAMES = st.sampled_from(
    ["QUANTDISPATCH_BACKEND_NVFP4", "QUANTDISPATCH_BACKEND_NVFP4_MOE", "QUANTDISPATCH_BACKEND_X",
     "QUANTDISPATCH_DISABLE", "QUANTDISPATCH_POLICY", "QUANTDISPATCH_DEVICE", "QUANTDISPATCH_PDL",
     "QUANTDISPATCH_SELF_CHECK", "QUANTDISPATCH_FP8_COMPUTE", "QUANTDISPATCH_", "QUANTDISPATCH_Q",
     "SGLANG_FORCE_NVFP4_MARLIN", "PATH"]
)  # fmt: skip
ENV_VALUES = st.sampled_from(
    ["triton", "reference", "marlin", "auto", "", " TRITON ", "h100", "cpu", "0", "1", "yes",
     "once", "off", "always", "prefill", "marlin,torch", ",,", "/dev/zero", "/nonexistent"]
) | st.text(max_size=12)  # fmt: skip


@given(env=st.dictionaries(ENV_NAMES, ENV_VALUES, max_size=4))
def test_environment_values(env):
    result: list[object] = []

    def run() -> None:  # a policy path could name anything: must not block
        try:
            result.append(load_settings(env))
        except ConfigurationError as exc:
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert result, f"load_settings({env}) did not return"

"""Fuzzing quantization configs, module patterns and config files: a config either parses (and
then answers every module name) or is one CheckpointError; nothing else comes out."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from quantdispatch.checkpoints import load_quant_config, parse_quant_config
from quantdispatch.errors import CheckpointError

# JSON values, with the keys and values quantization configs use mixed in
KEYS = st.sampled_from(
    [
        "quantization_config", "quantization", "quant_method", "quant_algo", "group_size",
        "exclude_modules", "ignore", "quantized_layers", "config_groups", "targets", "weights",
        "input_activations", "num_bits", "type", "strategy", "block_structure", "format",
        "weight_block_size", "modules_to_not_convert", "ignored_layers",
    ]
) | st.text(max_size=8)  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.sampled_from(
        [
            "modelopt", "compressed-tensors", "mxfp4", "fp8", "NVFP4", "W4A16_NVFP4", "FP8",
            "MIXED_PRECISION", "float", "block", "nvfp4-pack-quantized", "Linear", "lm_head",
            "*lm_head", "re:.*", "re:(", "re:(a|aa)+$", "re:.*mlp\\..*", 16, 32, 4, 8, 128,
        ]
    )
    | st.text(max_size=12)
)  # fmt: skip
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=25,
)

NAMES = st.sampled_from(
    ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.3.mlp.experts.1.down_proj"]
) | st.text(alphabet="abc._0123456789", max_size=40)

VALID = [
    {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}},
    {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "group_size": 16},
            }
        },
        "ignore": ["re:.*lm_head"],
    },
    {"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]},
    {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
]  # fmt: skip


def _parse_and_ask(cfg: object, names: list[str]) -> None:
    try:
        parsed = parse_quant_config(cfg, "fuzz/config.json")  # type: ignore[arg-type]
    except CheckpointError:
        return
    for name in names:
        try:
            parsed.layer(name)
        except CheckpointError as exc:  # a pattern over its time bound
            assert "took more than" in str(exc)


@given(cfg=JSON, names=st.lists(NAMES, max_size=3))
def test_any_json_value_is_a_config_or_a_checkpoint_error(cfg, names):
    _parse_and_ask(cfg, names)
    _parse_and_ask({"quantization_config": cfg}, names)


def _mutate(data: st.DataObject, node: object) -> object:
    """One random replacement somewhere inside a valid config."""
    if isinstance(node, dict) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node)))
        return {**node, key: _mutate(data, node[key])}
    if isinstance(node, list) and node and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(node) - 1))
        return [*node[:i], _mutate(data, node[i]), *node[i + 1 :]]
    return data.draw(JSON)


@given(data=st.data(), which=st.integers(0, len(VALID) - 1), names=st.lists(NAMES, max_size=3))
def test_valid_configs_with_one_value_replaced(data, which, names):
    _parse_and_ask(_mutate(data, VALID[which]), names)


@given(raw=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_config_files_of_any_bytes(raw):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "config.json"
        f.write_bytes(raw)
        with contextlib.suppress(CheckpointError):
            load_quant_config(d)

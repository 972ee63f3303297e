"""Malformed or hostile quantization configs: one CheckpointError naming the file and the key,
never a foreign exception, never a pattern split into characters, never an unbounded match."""

from __future__ import annotations

import json
import time

import pytest

from quantdispatch.checkpoints import load_quant_config, parse_quant_config
from quantdispatch.errors import CheckpointError

CT_NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 16},
        }
    },
    "ignore": ["lm_head"],
}
CT_FP8_BLOCK = {
    "quant_method": "compressed-tensors",
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "strategy": "block",
                "block_structure": [128, 128],
            },
        }
    },
}


def _with(base: dict, path: tuple, value: object) -> dict:
    cfg = json.loads(json.dumps(base))
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


# -- case 9: malformed values are our error, naming the key ---------------------------------------


@pytest.mark.parametrize("value", ["nvfp4", ["a"], 3])
def test_quantization_config_of_the_wrong_kind(value):
    with pytest.raises(CheckpointError, match="quantization_config"):
        parse_quant_config({"quantization_config": value}, "config.json")


def test_quantization_config_null_is_unquantized_but_not_a_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": None}))
    assert load_quant_config(tmp_path) is None
    with pytest.raises(CheckpointError, match="null"):
        parse_quant_config({"quantization_config": None})


@pytest.mark.parametrize(
    ("base", "path", "value", "key"),
    [
        (CT_NVFP4, ("config_groups", "group_0"), "nvfp4", "config_groups.group_0"),
        (CT_NVFP4, ("config_groups", "group_0", "weights", "group_size"), "sixteen", "group_size"),
        (CT_NVFP4, ("config_groups", "group_0", "weights"), [4], "weights"),
        (CT_FP8_BLOCK, ("config_groups", "g", "weights", "block_structure"), [128], "block_str"),
        (CT_FP8_BLOCK, ("config_groups", "g", "weights", "block_structure"), "abc", "block_str"),
        (CT_FP8_BLOCK, ("config_groups", "g", "weights", "block_structure"), [0, 0], "block_str"),
        ({"quant_method": "fp8"}, ("weight_block_size",), [128], "weight_block_size"),
        ({"quant_method": "fp8"}, ("weight_block_size",), "abc", "weight_block_size"),
        ({"quant_method": "fp8"}, ("weight_block_size",), [0, 0], "weight_block_size"),
        ({"quant_method": "fp8"}, ("weight_block_size",), [True, 1], "weight_block_size"),
        ({"quantization": {"quant_algo": "NVFP4"}}, ("quantization", "group_size"), "16", "group"),
        ({"quantization": {"quant_algo": "NVFP4"}}, ("quantization", "quant_algo"), 4, "quant_alg"),
        ({"quant_method": 7}, ("quant_method",), 7, "quant_method"),
    ],
)
def test_malformed_values_name_the_file_and_key(base, path, value, key):
    cfg = _with(base, path, value)
    with pytest.raises(CheckpointError, match=key) as info:
        parse_quant_config({"quantization_config": cfg}, "ckpt/config.json")
    assert "ckpt/config.json" in str(info.value)


@pytest.mark.parametrize("pattern", ["re:(", "re:[a-", "re:(?P<x", "re:a{2,1}"])
def test_an_invalid_regex_is_refused_when_the_config_is_read(pattern):
    with pytest.raises(CheckpointError, match="not a valid regular expression"):
        parse_quant_config(_with(CT_NVFP4, ("ignore",), [pattern]), "config.json")


def test_files_that_are_not_utf8_json(tmp_path):
    (tmp_path / "hf_quant_config.json").write_bytes(b'{"quantization": {"quant_algo": "\xff"}}')
    with pytest.raises(CheckpointError, match="not UTF-8"):
        load_quant_config(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_quant_config(tmp_path)


# -- case 4: a string where a list belongs is refused, not split into characters -----------------


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (_with(CT_NVFP4, ("ignore",), "*lm_head"), "ignore"),
        (_with(CT_NVFP4, ("config_groups", "group_0", "targets"), "Linear"), "targets"),
        ({"quantization": {"quant_algo": "NVFP4", "exclude_modules": "*lm_head"}}, "exclude"),
        ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "modules_to_not"),
        ({"quant_method": "fp8", "ignored_layers": "lm_head"}, "ignored_layers"),
    ],
)
def test_pattern_lists_given_as_a_string(cfg, key):
    with pytest.raises(CheckpointError, match=f"{key}.*must be a list"):
        parse_quant_config(cfg, "config.json")


def test_lists_of_patterns_still_match_as_before():
    cfg = parse_quant_config(
        _with(CT_NVFP4, ("ignore",), ["lm_head", "re:.*mlp\\.gate$", "model.layers.1.*"])
    )
    assert cfg.layer("model.layers.0.self_attn.q_proj") is not None
    assert cfg.layer("lm_head") is None
    assert cfg.layer("model.layers.0.mlp.gate") is None
    assert cfg.layer("model.layers.1.mlp.up_proj") is None
    assert cfg.excluded_by("model.layers.1.mlp.up_proj") == "model.layers.1.*"
    modelopt = parse_quant_config(
        {"quantization": {"quant_algo": "FP8", "exclude_modules": ["*lm_head"]}}
    )
    assert modelopt.layer("model.lm_head") is None
    assert modelopt.layer("model.layers.0.mlp.down_proj") is not None


# -- case 10: a backtracking pattern is an error within its time bound ---------------------------


def test_a_catastrophic_regex_is_stopped_and_named():
    cfg = parse_quant_config(_with(CT_NVFP4, ("ignore",), ["re:(a|aa)+$"]), "config.json")
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"\(a\|aa\)\+\$.*config\.json.*took more than"):
        cfg.layer("a" * 40 + "b")
    assert time.perf_counter() - start < 5.0


def test_each_module_name_is_matched_once(monkeypatch):
    from quantdispatch.checkpoints import patterns

    cfg = parse_quant_config(_with(CT_NVFP4, ("ignore",), ["re:.*never_here_[0-9]+"]))
    calls = []
    real = patterns._match.__wrapped__

    def counting(pattern, name):
        calls.append(name)
        return real(pattern, name)

    patterns._match.cache_clear()
    monkeypatch.setattr(patterns, "_match", patterns.functools.lru_cache(maxsize=None)(counting))
    for _ in range(3):
        cfg.layer("model.layers.0.mlp.up_proj")
    assert calls == ["model.layers.0.mlp.up_proj"]

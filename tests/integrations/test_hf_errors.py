"""Errors say what, the rule and the fix: unmappable experts, missing tensors, config/tensor
disagreements; the CPU reference-backend warning comes once."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import float_model, make_config, write_checkpoint
from safetensors.torch import load_file, save_file

from quantdispatch.errors import CheckpointError, ConfigurationError
from quantdispatch.integrations.transformers import (
    ReferenceBackendWarning,
    load_model,
    moe_blocks,
    quantize_model,
)
from quantdispatch.integrations.transformers import common as hf_common


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(float_model(make_config("llama")), path, arch="llama")
    return path


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    write_checkpoint(float_model(make_config("qwen3_moe")), path, arch="qwen3_moe")
    return path


def _copy_without(src, dst, drop) -> None:
    """A copy of a checkpoint folder without the tensors ``drop(name)`` selects."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file(
                {k: v for k, v in load_file(str(f)).items() if not drop(k)}, str(dst / f.name)
            )
        else:
            (dst / f.name).write_bytes(f.read_bytes())


def test_unsupported_experts_class_names_it_and_lists_the_supported(qwen_ckpt, monkeypatch):
    model = float_model(make_config("qwen3_moe"), dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    experts.__class__ = type("FancyExperts", (type(experts),), {})
    with pytest.raises(ConfigurationError) as info:
        quantize_model(model, "nvfp4")
    msg = str(info.value)
    assert "FancyExperts" in msg and "model.layers.0.mlp.experts" in msg
    assert "Qwen3MoeExperts" in msg and "MixtralExperts" in msg and "GptOssExperts" in msg
    assert "experts=False" in msg

    monkeypatch.delitem(moe_blocks._BY_CLASS, "Qwen3MoeExperts")
    with pytest.raises(ConfigurationError, match=r"cannot map the MoE experts.*Qwen3MoeExperts"):
        load_model(qwen_ckpt, device="cpu")


@pytest.mark.parametrize(
    ("drop", "fragment"),
    [
        ("model.layers.1.post_attention_layernorm.weight", "'model.layers.1.post_attention_laye"),
        ("model.layers.0.mlp.up_proj.", "'model.layers.0.mlp.up_proj.weight'"),
        ("model.layers.1.self_attn.k_proj.weight_scale_2", "weight_scale_2"),
    ],
)
def test_missing_tensor_is_named(llama_ckpt, tmp_path, drop, fragment):
    broken = tmp_path / "broken"
    _copy_without(llama_ckpt, broken, lambda k: k.startswith(drop))
    with pytest.raises(CheckpointError) as info:
        load_model(broken, device="cpu")
    assert fragment in str(info.value)


def test_missing_expert_tensor_is_named(qwen_ckpt, tmp_path):
    broken = tmp_path / "broken"
    _copy_without(qwen_ckpt, broken, lambda k: k.startswith("model.layers.1.mlp.experts.3.down"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj"):
        load_model(broken, device="cpu")


def test_config_that_disagrees_with_the_tensors(llama_ckpt, tmp_path):
    bad = tmp_path / "bad"
    _copy_without(llama_ckpt, bad, lambda k: False)
    qc = json.loads((bad / "hf_quant_config.json").read_text())
    qc["quantization"]["exclude_modules"].append("model.layers.0.mlp.gate_proj")
    (bad / "hf_quant_config.json").write_text(json.dumps(qc))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.gate_proj' is not quan"):
        load_model(bad, device="cpu")


def test_shape_mismatch_and_missing_config(llama_ckpt, tmp_path):
    bad = tmp_path / "bad"
    _copy_without(llama_ckpt, bad, lambda k: False)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] = 300
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"shape \(256, 64\).*\(300, 64\)"):
        load_model(bad, device="cpu")
    (bad / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(bad, device="cpu")


def test_cpu_reference_backend_warns_once(llama_ckpt, monkeypatch):
    monkeypatch.setattr(hf_common, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(llama_ckpt, device="cpu")
        load_model(llama_ckpt, device="cpu")
    mine = [w for w in caught if issubclass(w.category, ReferenceBackendWarning)]
    assert len(mine) == 1
    text = str(mine[0].message)
    assert "reference backend" in text and "slow" in text and "device='cuda'" in text


def test_a_preset_name_is_not_a_device_and_fp32_activations_are_refused(llama_ckpt):
    with pytest.raises(ConfigurationError, match=r"describe_model\(path, 'h100'\)"):
        load_model(llama_ckpt, device="h100")
    with pytest.raises(ConfigurationError, match=r"act_dtype=torch\.float32.*16-bit"):
        load_model(llama_ckpt, device="cpu", act_dtype=torch.float32)

"""Checkpoints whose layout or config.json disagrees with the model: float q/k/v stored as
separate shards of a fused linear load; a config that lies about the heads is an error naming
the layer at load, not a failure inside attention later."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import assert_matches_reference, float_model, make_config, write_checkpoint
from safetensors.torch import load_file, save_file

from quantdispatch.errors import CheckpointError
from quantdispatch.integrations.transformers import load_model


def _split_float_qkv(path, config) -> None:
    """Rewrite the checkpoint's float fused qkv_proj weights as separate q/k/v shards."""
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    head_dim = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    for key in [k for k in tensors if k.endswith("qkv_proj.weight")]:
        w = tensors.pop(key)
        base = key.removesuffix("qkv_proj.weight")
        parts = {"q_proj": w[:q], "k_proj": w[q : q + kv], "v_proj": w[q + kv :]}
        tensors.update({f"{base}{name}.weight": t.contiguous() for name, t in parts.items()})
    save_file(tensors, str(f))


@pytest.fixture(scope="module")
def phi3_float_qkv(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3-float-qkv")
    config = make_config("phi3")
    exclude = ("lm_head", *(f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)))
    ref = write_checkpoint(float_model(config), path, arch="phi3", exclude=exclude)
    _split_float_qkv(path, config)
    return path, config, ref


def test_float_qkv_shards_of_a_fused_linear_load(phi3_float_qkv):
    from hf_models import reference_model

    path, config, ref = phi3_float_qkv
    model = load_model(path, device="cpu", attn_implementation="eager")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert type(qkv) is torch.nn.Linear and not qkv.weight.is_meta
    assert_matches_reference(model, reference_model(config, ref))


def _lie_about_kv_heads(path, heads: int) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_key_value_heads"] = heads
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_config_that_lies_about_kv_heads_fails_at_load_naming_the_layer(tmp_path, phi3_float_qkv):
    quantized = tmp_path / "llama"
    write_checkpoint(float_model(make_config("llama")), quantized, arch="llama")
    _lie_about_kv_heads(quantized, 1)
    with pytest.raises(CheckpointError, match=r"k_proj.*\[32, 64\].*\[16, 64\].*num_key_value"):
        load_model(quantized, device="cpu", attn_implementation="eager")

    fused_float = tmp_path / "phi3"
    fused_float.mkdir()
    for f in phi3_float_qkv[0].iterdir():
        (fused_float / f.name).write_bytes(f.read_bytes())
    _lie_about_kv_heads(fused_float, 1)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight \+ .*k_proj.*fused weight"):
        load_model(fused_float, device="cpu", attn_implementation="eager")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"exclude": "lm_head"}, "exclude is a list"), ({"experts": "false"}, "experts is true")],
)
def test_from_pretrained_config_values_of_the_wrong_type(kwargs, fragment):
    from quantdispatch.errors import ConfigurationError
    from quantdispatch.integrations.transformers.hf_quantizer import QuantDispatchConfig

    with pytest.raises(ConfigurationError, match=fragment):
        QuantDispatchConfig(**kwargs)
    assert QuantDispatchConfig(exclude=["lm_head"], experts=False).exclude == ["lm_head"]

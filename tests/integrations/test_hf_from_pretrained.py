"""AutoModelForCausalLM.from_pretrained(path, quantization_config=QuantDispatchConfig()): the
registered quantization method takes the load_model path (quantized checkpoints) or the
quantize_model path (float checkpoints)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import float_model, greedy, make_config, write_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from quantdispatch import QuantLinear
from quantdispatch.integrations.transformers import (
    QuantDispatchConfig,
    QuantExperts,
    hf_config,
    load_model,
)


@pytest.mark.parametrize(("arch", "where"), [("llama", "hf_quant_config"), ("mixtral", "config")])
def test_modelopt_checkpoint_takes_the_load_model_path(tmp_path, arch, where):
    write_checkpoint(float_model(make_config(arch)), tmp_path, arch=arch, where=where)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=QuantDispatchConfig()
    )
    assert isinstance(model.model.layers[1].self_attn.o_proj, QuantLinear)
    assert type(model.lm_head) is torch.nn.Linear
    if arch == "mixtral":
        assert isinstance(model.model.layers[0].mlp.experts, QuantExperts)
    assert model.dtype == torch.bfloat16 and not model.training
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    assert greedy(model) == greedy(load_model(tmp_path, device="cpu"))


def test_float_checkpoint_is_quantized_at_load(tmp_path):
    float_model(make_config("qwen3_moe")).save_pretrained(tmp_path)
    config = QuantDispatchConfig("mxfp4", exclude=["lm_head", "re:.*o_proj$"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    layer = model.model.layers[0]
    assert (
        isinstance(layer.self_attn.q_proj, QuantLinear) and layer.self_attn.q_proj.format == "mxfp4"
    )
    assert type(layer.self_attn.o_proj) is torch.nn.Linear
    assert isinstance(layer.mlp.experts, QuantExperts)
    assert len(greedy(model, 4)) == 4


@pytest.mark.parametrize(
    ("producer", "fmt", "where", "claimed"),
    [
        ("ct", "nvfp4", "config", "CompressedTensorsConfig"),
        ("ct", "fp8", "config", "CompressedTensorsConfig"),
        ("modelopt", "nvfp4", "hf_quant_config", None),  # nothing in config.json to drop
    ],
)
def test_hf_config_lets_checkpoints_with_their_own_quantization_config_load(
    tmp_path, producer, fmt, where, claimed
):
    """transformers merges a checkpoint's own known quantization_config with the one passed and
    refuses two classes (the README's path); hf_config(path) drops it and takes our path."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(
        float_model(make_config("llama")), ckpt, arch="llama", producer=producer, fmt=fmt,
        where=where,
    )  # fmt: skip
    if claimed:
        with pytest.raises(ValueError, match=claimed):
            AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=QuantDispatchConfig())
    config = hf_config(ckpt)
    assert getattr(config, "quantization_config", None) is None
    full = AutoConfig.from_pretrained(ckpt).to_dict()
    assert ("quantization_config" in full) == (where == "config")
    full.pop("quantization_config", None)
    assert full == config.to_dict()  # nothing else dropped
    model = AutoModelForCausalLM.from_pretrained(
        ckpt, config=config, quantization_config=QuantDispatchConfig()
    )
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert model.model.layers[0].mlp.down_proj.format == fmt
    assert greedy(model) == greedy(load_model(ckpt, device="cpu"))

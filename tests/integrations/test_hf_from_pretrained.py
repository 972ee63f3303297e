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
from quantdispatch.integrations.transformers import QuantDispatchConfig, QuantExperts, load_model


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


def test_compressed_tensors_config_is_claimed_by_transformers(tmp_path):
    """transformers merges a checkpoint's own known quantization_config with the one passed and
    refuses two classes; passing the config without it takes our path."""
    write_checkpoint(float_model(make_config("llama")), tmp_path, arch="llama", producer="ct")
    with pytest.raises(ValueError, match="CompressedTensorsConfig"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=QuantDispatchConfig())
    config = AutoConfig.from_pretrained(tmp_path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, config=config, quantization_config=QuantDispatchConfig()
    )
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert greedy(model) == greedy(load_model(tmp_path, device="cpu"))

"""load_model builds the class config.json's ``architectures`` names (an encoder, a sequence
classifier, a causal LM), whose outputs match the same class with the decoded float weights;
what it cannot build is one CheckpointError naming the class and why."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from hf_models import float_model, make_config, write_checkpoint

from quantdispatch import QuantLinear
from quantdispatch.errors import CheckpointError, ConfigurationError
from quantdispatch.integrations.transformers import load_model

BERT = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
    vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)  # fmt: skip
TOKENS = torch.tensor([[2, 17, 42, 99, 7, 128, 3]])


def _write(tmp_path, cls, config, **kw):
    """A quantized checkpoint of a random ``cls`` (config.json naming it, as save_pretrained
    writes it) and the same class holding the decoded float weights."""
    torch.manual_seed(0)
    model = cls(config).eval()
    model.config.architectures = [cls.__name__]
    ref_state = write_checkpoint(model, tmp_path, arch="bert", producer="ct", **kw)
    ref = cls(config).eval()
    missing, unexpected = ref.load_state_dict(ref_state, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k], missing
    return ref.to(torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding over two layers; a misloaded weight is off by O(1)."""
    err = float((got.float() - want.float()).abs().max())
    assert err <= 2.0**-4 * float(want.float().abs().max()), err


def test_an_encoder_loads_as_the_class_config_json_names(tmp_path):
    ref = _write(tmp_path, transformers.BertModel, transformers.BertConfig(**BERT))
    model = load_model(tmp_path, device="cpu")
    assert type(model) is transformers.BertModel
    assert len([m for m in model.modules() if isinstance(m, QuantLinear)]) == 2 * 6 + 1
    with torch.no_grad():
        got, want = model(TOKENS).last_hidden_state, ref(TOKENS).last_hidden_state
    _close(got, want)


def test_a_sequence_classifier_loads_with_its_head(tmp_path):
    config = transformers.BertConfig(**BERT, num_labels=3)
    cls = transformers.BertForSequenceClassification
    ref = _write(tmp_path, cls, config, exclude=("classifier",))
    model = load_model(tmp_path, device="cpu")
    assert type(model) is cls and type(model.classifier) is torch.nn.Linear
    with torch.no_grad():
        got, want = model(TOKENS).logits, ref(TOKENS).logits
    assert got.shape == (1, 3)
    _close(got, want)


def test_a_causal_lm_named_in_config_json(tmp_path):
    config = make_config("llama")
    model = float_model(config)
    model.config.architectures = ["LlamaForCausalLM"]
    write_checkpoint(model, tmp_path, arch="llama")
    assert type(load_model(tmp_path, device="cpu")) is transformers.LlamaForCausalLM


def test_model_class_overrides_config_json(tmp_path):
    _write(tmp_path, transformers.BertModel, transformers.BertConfig(**BERT))
    model = load_model(tmp_path, device="cpu", model_class=transformers.AutoModel)
    assert type(model) is transformers.BertModel
    assert type(load_model(tmp_path, device="cpu")) is transformers.BertModel


def _with_architectures(tmp_path, names, **extra):
    _write(tmp_path, transformers.BertModel, transformers.BertConfig(**BERT))
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(architectures=names, **extra)
    cfg_file.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("names", "extra", "words"),
    [
        (["NoSuchModelForAnything"], {}, "defines no class of that name"),
        (["FooModel"], {"auto_map": {"AutoModel": "modeling_foo.FooModel"}}, "auto_map"),
        (["LlamaForCausalLM"], {}, "is built from a LlamaConfig, but config.json's model_type"),
        (["BertConfig"], {}, "is not a transformers model class"),
    ],
)
def test_what_cannot_be_built_is_one_error_naming_it(tmp_path, names, extra, words):
    _with_architectures(tmp_path, names, **extra)
    with pytest.raises(CheckpointError, match=names[0]) as info:
        load_model(tmp_path, device="cpu")
    assert words in str(info.value) and "model_class=" in str(info.value)


def test_the_fix_it_names_works(tmp_path):
    _with_architectures(tmp_path, ["NoSuchModelForAnything"])
    model = load_model(tmp_path, device="cpu", model_class=transformers.BertModel)
    assert type(model) is transformers.BertModel


def test_a_bad_model_class_is_a_configuration_error(tmp_path):
    _write(tmp_path, transformers.BertModel, transformers.BertConfig(**BERT))
    with pytest.raises(ConfigurationError, match="model_class='BertModel' is not a transformers"):
        load_model(tmp_path, device="cpu", model_class="BertModel")

"""load_model: tiny transformers models from quantized checkpoints generate like the same model
with the decoded float weights (CPU, reference backend)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import (
    assert_matches_reference,
    float_model,
    greedy,
    make_config,
    reference_model,
    write_checkpoint,
)

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.integrations.transformers import QuantExperts, load_model

CASES = [
    # arch, producer, format, W4A4/W8A8 (activation scales in the checkpoint), config location
    ("llama", "modelopt", "nvfp4", False, "hf_quant_config"),
    ("llama", "modelopt", "nvfp4", True, "config"),
    ("llama", "modelopt", "fp8", True, "hf_quant_config"),
    ("llama", "ct", "fp8", False, "config"),
    ("qwen3_moe", "modelopt", "nvfp4", False, "config"),
    ("qwen2_moe", "ct", "nvfp4", False, "config"),
    ("mixtral", "ct", "mxfp4", False, "config"),
    ("olmoe", "modelopt", "nvfp4", False, "hf_quant_config"),
    ("deepseek_v3", "modelopt", "fp8", False, "hf_quant_config"),
    ("gpt_oss", "gpt-oss", "mxfp4", False, "config"),
]


def _no_meta(model) -> None:
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftovers, leftovers


@pytest.mark.parametrize(("arch", "producer", "fmt", "w4a4", "where"), CASES)
def test_checkpoint_generates_like_the_decoded_float_model(
    tmp_path, arch, producer, fmt, w4a4, where
):
    config = make_config(arch)
    ref_state = write_checkpoint(
        float_model(config), tmp_path, arch=arch, fmt=fmt, producer=producer, w4a4=w4a4, where=where
    )
    model = load_model(tmp_path, device="cpu", attn_implementation="eager")
    assert not model.training
    _no_meta(model)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert all(m.format == fmt for m in quant)
    assert type(model.lm_head) is torch.nn.Linear  # excluded: stays float
    if arch == "gpt_oss":
        assert not quant  # gpt-oss quantizes its experts only
    else:
        assert len(quant) >= 7 * config.num_hidden_layers - 7
    moe = arch != "llama"
    assert len(experts) == (
        0 if not moe else config.num_hidden_layers - (1 if arch == "deepseek_v3" else 0)
    )
    for e in experts:
        assert isinstance(e.moe, QuantMoE) and e.moe.format == fmt
        assert e.moe.top_k == config.num_experts_per_tok
    if arch == "gpt_oss":
        assert experts[0].moe.activation == "swiglu_oai"
        assert experts[0].moe.w13_bias is not None
    if getattr(config, "tie_word_embeddings", False):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_matches_reference(model, reference_model(config, ref_state))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_static_cache_and_fullgraph_compile_give_the_same_tokens(tmp_path, arch):
    """transformers' static cache and its automatic compile of the decode step: dynamo traces
    the quantized layers and the QuantMoE-backed experts as one graph (no graph break). The
    eager backend keeps this a tracing check on the CPU; tests/gpu runs CUDA graphs."""
    from transformers import CompileConfig

    config = make_config(arch)
    write_checkpoint(float_model(config), tmp_path, arch=arch)
    model = load_model(tmp_path, device="cpu", attn_implementation="sdpa")
    compile_config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    compile_config._compile_all_devices = True  # transformers compiles on GPUs only by default
    eager = greedy(model)
    assert greedy(model, cache_implementation="static") == eager
    assert greedy(model, cache_implementation="static", compile_config=compile_config) == eager


def test_excluded_layers_stay_float_and_ignore_patterns_are_honoured(tmp_path):
    config = make_config("llama", tie_word_embeddings=False)
    exclude = ("lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj")
    ref_state = write_checkpoint(
        float_model(config), tmp_path, arch="llama", producer="ct", exclude=exclude
    )
    model = load_model(tmp_path, device="cpu")
    for name in exclude:
        assert type(model.get_submodule(name)) is torch.nn.Linear, name
        assert model.get_submodule(name).weight.dtype == torch.bfloat16
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert_matches_reference(model, reference_model(config, ref_state))


def test_fused_model_linears_load_from_separate_checkpoint_shards(tmp_path):
    """Phi-3 fuses q/k/v and gate/up in the model; a checkpoint may store the shards."""
    config = make_config("phi3")
    model_f = float_model(config)
    shards = {}
    for name, module in model_f.named_modules():
        if name.endswith(("qkv_proj", "gate_up_proj")):
            parent = name.rpartition(".")[0]
            w = module.weight.detach()
            if name.endswith("qkv_proj"):
                head_dim = config.hidden_size // config.num_attention_heads
                q = config.num_attention_heads * head_dim
                kv = config.num_key_value_heads * head_dim
                parts = {"q_proj": w[:q], "k_proj": w[q : q + kv], "v_proj": w[q + kv :]}
            else:
                half = w.shape[0] // 2
                parts = {"gate_proj": w[:half], "up_proj": w[half:]}
            shards.update({f"{parent}.{k}": v for k, v in parts.items()})
    ref_state = write_checkpoint(model_f, tmp_path, arch="phi3", split=shards)
    model = load_model(tmp_path, device="cpu", attn_implementation="eager")
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert layer.self_attn.qkv_proj.out_features == config.hidden_size + 2 * 2 * 16
    assert_matches_reference(model, reference_model(config, ref_state))


def test_checkpoint_written_by_compressed_tensors_model_compressor(tmp_path):
    """The real producer: compressed-tensors applies an NVFP4A16 scheme, its ModelCompressor
    packs the model and writes the config, transformers' save_pretrained writes the shards. The
    reference is compressed-tensors' own decompression of the same bytes."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    config = make_config("llama", tie_word_embeddings=False)
    model = float_model(config, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, qc)
    for module in model.modules():  # the observer's job (llm-compressor), done here by hand
        if isinstance(module, torch.nn.Linear) and hasattr(module, "quantization_scheme"):
            w = module.weight.detach().float()
            gs = generate_gparam(w.amin(), w.amax())
            blocks = w.reshape(w.shape[0], -1, 16)
            args = module.quantization_scheme.weights
            scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs)
            module.weight_global_scale.data.copy_(gs)
            module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(tmp_path)
    compressor.update_config(str(tmp_path))

    compressor.decompress_model(model)
    ref_state = {
        f"{name}.weight": m.weight.detach().float()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    for name, t in model.state_dict().items():
        if not name.endswith(("weight_scale", "weight_global_scale", "weight_zero_point")):
            ref_state.setdefault(name, t.float())

    loaded = load_model(tmp_path, device="cpu", attn_implementation="eager")
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == 14
    assert type(loaded.lm_head) is torch.nn.Linear
    # decompression rounds the weights to bf16 (the dequantized values are not exact there)
    assert_matches_reference(loaded, reference_model(config, ref_state), exact=False)


def test_fp16_model_keeps_transformers_fp32_modules(tmp_path):
    """gpt-oss lists its norms in _keep_in_fp32_modules: under fp16 they load in fp32, as
    transformers' own loader does."""
    config = make_config("gpt_oss")
    write_checkpoint(float_model(config), tmp_path, arch="gpt_oss")
    model = load_model(tmp_path, device="cpu", act_dtype=torch.float16, attn_implementation="eager")
    assert model.model.norm.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16
    assert model.model.layers[0].mlp.experts.moe.act_dtype == torch.float16
    assert len(greedy(model, 4)) == 4


def test_sharded_checkpoint_with_index(tmp_path):
    """Two shards and a model.safetensors.index.json, as large checkpoints come."""
    import json

    from safetensors.torch import load_file, save_file

    from quantdispatch.integrations.transformers import describe_model

    config = make_config("qwen3_moe")
    ref_state = write_checkpoint(float_model(config), tmp_path, arch="qwen3_moe")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(tmp_path, device="cpu", attn_implementation="eager")
    assert_matches_reference(model, reference_model(config, ref_state))
    assert sum(r["count"] for r in describe_model(tmp_path, "cpu")["layers"]) == 10


def test_float_experts_next_to_quantized_attention(tmp_path):
    """A checkpoint that keeps the experts in bf16 (excluded from quantization): they load into
    the model's own stacked parameters, per-expert tensors stacked (Mixtral's w1/w3/w2 naming)."""
    config = make_config("mixtral")
    ref_state = write_checkpoint(
        float_model(config),
        tmp_path,
        arch="mixtral",
        exclude=("lm_head", "*.experts.*"),
        float_experts=True,
    )
    model = load_model(tmp_path, device="cpu", attn_implementation="eager")
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "MixtralExperts"
    assert experts.gate_up_proj.dtype == torch.bfloat16 and not experts.gate_up_proj.is_meta
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert_matches_reference(model, reference_model(config, ref_state))

"""quantize_model: a float model becomes a weight-only quantized one, in place; the experts of
each supported MoE architecture keep that architecture's routing."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import assert_matches_reference, float_model, make_config

from quantdispatch import QuantLinear
from quantdispatch.formats import (
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
)
from quantdispatch.integrations.transformers import QuantExperts, quantize_model
from quantdispatch.integrations.transformers.common import matches

_Q = {
    "nvfp4": lambda w: dequantize_nvfp4(quantize_nvfp4(w)),
    "mxfp4": lambda w: dequantize_mxfp4(quantize_mxfp4(w)),
    "fp8": lambda w: dequantize_fp8(quantize_fp8(w, kind="channel")),
}


def _roundtrip_reference(model, fmt, exclude=("lm_head",)):
    """A copy whose quantizable weights hold their quantize -> dequantize round trip."""
    ref = copy.deepcopy(model)
    rt = _Q[fmt]
    with torch.no_grad():
        for name, m in ref.named_modules():
            if matches(name, exclude):
                continue
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(rt(m.weight.float()))
            elif type(m).__name__ == "GptOssExperts":
                for p in (m.gate_up_proj, m.down_proj):
                    p.copy_(torch.stack([rt(w.T.float()).T for w in p]))
            elif type(m).__name__.endswith("Experts"):
                inter = m.gate_up_proj.shape[1] // 2
                for e in range(m.gate_up_proj.shape[0]):
                    m.gate_up_proj[e, :inter] = rt(m.gate_up_proj[e, :inter].float())
                    m.gate_up_proj[e, inter:] = rt(m.gate_up_proj[e, inter:].float())
                    m.down_proj[e] = rt(m.down_proj[e].float())
    return ref


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_dense_model_every_linear_but_the_excluded(fmt):
    model = float_model(make_config("llama", tie_word_embeddings=False), dtype=torch.bfloat16)
    ref = _roundtrip_reference(model, fmt)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    out = quantize_model(model, fmt)
    assert out is model
    for name in names:
        layer = model.get_submodule(name)
        if name == "lm_head":
            assert type(layer) is torch.nn.Linear
        else:
            assert isinstance(layer, QuantLinear) and layer.format == fmt
            assert layer.request.scheme.value == "weight_only"
    assert_matches_reference(model, ref, exact=False)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_moe_model_experts_and_routing(arch):
    config = make_config(arch)
    model = float_model(config, dtype=torch.bfloat16)
    ref = _roundtrip_reference(model, "nvfp4")
    quantize_model(model, "nvfp4")
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts and all(e.arch == arch for e in experts)
    assert_matches_reference(model, ref, exact=False)
    _check_routing_parity(model)


def test_gpt_oss_experts_keep_biases_and_clamped_swiglu():
    config = make_config("gpt_oss")
    model = float_model(config, dtype=torch.bfloat16)
    exclude = ("lm_head", "re:.*self_attn.*")
    ref = _roundtrip_reference(model, "mxfp4", exclude)
    quantize_model(model, "mxfp4", exclude=exclude)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    moe = model.model.layers[0].mlp.experts.moe
    assert moe.activation == "swiglu_oai" and moe.w13_bias is not None
    assert moe._params == [pytest.approx(1.702), pytest.approx(7.0)]
    assert_matches_reference(model, ref, exact=False)
    _check_routing_parity(model)


def _check_routing_parity(model) -> None:
    """QuantMoE.route(router logits) picks the experts the model's router picked, with the same
    weights: the QuantMoE carries the architecture's routing options."""
    seen = []

    def hook(module, args, out):
        seen.append((module, out))

    blocks = {
        n.rpartition(".")[0]: m for n, m in model.named_modules() if isinstance(m, QuantExperts)
    }
    handles = []
    for name, module in model.named_modules():
        if name.rpartition(".")[0] in blocks and name.endswith((".gate", ".router")):
            handles.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([[5, 9, 77, 123, 200, 31, 8]]))
    for h in handles:
        h.remove()
    assert seen
    experts = list(blocks.values())
    for (_, (logits, weights, ids)), ex in zip(seen, experts, strict=True):
        bias = getattr(_router_of(model, ex), "e_score_correction_bias", None)
        if bias is not None:
            ex.moe.e_score_correction_bias = bias.float()
        got_ids, got_w = ex.moe.route(logits.float().reshape(-1, logits.shape[-1]))
        order_a, order_b = ids.sort(dim=-1), got_ids.long().sort(dim=-1)
        assert torch.equal(order_a.values, order_b.values)
        w_a = weights.float().gather(1, order_a.indices)
        w_b = got_w.gather(1, order_b.indices)
        torch.testing.assert_close(w_b, w_a, rtol=2**-7, atol=1e-6)


def _router_of(model, experts_module):
    for name, m in model.named_modules():
        if m is experts_module:
            block = model.get_submodule(name.rpartition(".")[0])
            return getattr(block, "gate", None) or getattr(block, "router", None)
    return None


def test_experts_false_and_exclude_patterns():
    model = float_model(make_config("qwen3_moe"), dtype=torch.bfloat16)
    quantize_model(model, "nvfp4", experts=False, exclude=("lm_head", "*.self_attn.o_proj"))
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert type(model.model.layers[1].self_attn.o_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[1].self_attn.q_proj, QuantLinear)


def test_fp32_model_gets_bf16_layers_and_string_exclude_is_refused():
    model = float_model(make_config("llama"))
    with pytest.raises(ValueError, match="exclude is a sequence"):
        quantize_model(model, "nvfp4", exclude="lm_head")
    quantize_model(model.to(torch.bfloat16), "nvfp4", act_dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.up_proj.act_dtype == torch.bfloat16

"""The HF integration's fused ops and decode capture on a real GPU: a quantized Llama / Qwen3 /
Qwen3-MoE (small shapes, random weights) with and without fused ops, eager and compiled; the
captured decode step's greedy tokens equal the eager step's."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def _model(arch: str):
    import transformers as tf

    common = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=1024,
                  max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)  # fmt: skip
    if arch == "llama":
        cfg = tf.LlamaConfig(intermediate_size=1024, **common)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(intermediate_size=1024, **common)
    else:
        cfg = tf.Qwen3MoeConfig(intermediate_size=1024, moe_intermediate_size=256,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                **common)  # fmt: skip
    torch.manual_seed(0)
    with DEV:
        model = tf.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_fused_ops_keep_the_logits(arch):
    from quantdispatch.integrations.transformers import (
        install_fused_ops,
        quantize_model,
        remove_fused_ops,
    )

    gen = torch.Generator(DEV).manual_seed(1)
    ids = torch.randint(0, 1024, (2, 33), device=DEV, generator=gen)
    base = _model(arch)
    fused = copy.deepcopy(base)
    assert install_fused_ops(fused) > 0
    with torch.no_grad():
        want, got = base(ids).logits.double(), fused(ids).logits.double()
    assert float((got - want).norm() / want.norm()) < 1e-2
    q = quantize_model(copy.deepcopy(base), "nvfp4")  # fused ops on by default
    q_plain = copy.deepcopy(q)
    remove_fused_ops(q_plain)
    with torch.no_grad():
        a, b = q(ids).logits.double(), q_plain(ids).logits.double()
    assert float((a - b).norm() / b.norm()) < 1e-2


def test_compiled_fused_model_matches_eager():
    from quantdispatch.integrations.transformers import quantize_model

    model = quantize_model(_model("llama"), "nvfp4")
    ids = torch.randint(0, 1024, (1, 17), device=DEV)
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, fullgraph=False)(ids).logits
    assert float((got.double() - want.double()).norm() / want.double().norm()) < 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("batch", [1, 4])
def test_captured_decode_tokens_equal_eager(arch, batch):
    from quantdispatch.integrations.transformers import capture_decode, quantize_model

    model = quantize_model(_model(arch), "nvfp4")
    gen = torch.Generator(DEV).manual_seed(3)
    ids = torch.randint(0, 1024, (batch, 9), device=DEV, generator=gen)
    graph = capture_decode(model, batch_size=batch, max_len=64)
    eager = capture_decode(model, batch_size=batch, max_len=64, capture=False)
    got = graph.generate(ids, 24)
    assert graph.graph is not None
    assert torch.equal(got, eager.generate(ids, 24))
    assert torch.equal(graph.generate(ids, 24), got)  # replays again from a new prefill


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_rotary_gives_hfs_bits_on_the_gpu(arch):
    """Only the attention layers patched: the fused rotary kernel is HF's formula bit for bit,
    so the logits are equal, prefill and decode-sized."""
    from quantdispatch.integrations.transformers import fused_ops

    base = _model(arch)
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        fused_ops.patch_attention(layer.self_attn)
        assert "forward" in vars(layer.self_attn)
    for shape in ((2, 33), (4, 1)):
        ids = torch.randint(0, 1024, shape, device=DEV)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, base(ids).logits)

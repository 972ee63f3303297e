"""install_fp8_producers on tiny transformers models (CPU): which modules it sets to produce
FP8 activations (Llama-family norms read by q / k / v and gate / up, gated SiLU MLPs), that it
leaves every other module and model alone, and that a patched module runs its own forward where
the fused kernels do not apply (here: the CPU), so the model's output is unchanged. The kernels
and the sharing are checked in tests/numerics/test_fp8_producers.py, on the GPU in
tests/gpu/test_fp8_producers_gpu.py and tests/gpu/test_fp8_logits_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import PROMPT, float_model, make_config

from quantdispatch.integrations.transformers import fp8_handoff, fp8_producers, quantize_model


def _quantized(arch):
    """The tiny model quantized without the fused ops (this file tests the producers alone)."""
    return quantize_model(
        float_model(make_config(arch), dtype=torch.bfloat16), "nvfp4", fused_ops=False
    )


def patched(model) -> list[str]:
    return [n for n, m in model.named_modules() if hasattr(m, fp8_producers.PATCHED)]


@pytest.fixture
def fp8_from_m(monkeypatch):
    """Call it to make every QuantLinear claim FP8 compute from M = 4 (the CPU has none)."""

    def claim():
        monkeypatch.setattr(fp8_producers, "fp8_start", lambda layers: 4 if any(
            isinstance(x, fp8_producers.QuantLinear) for x in layers) else None)  # fmt: skip

    return claim


def test_nothing_patched_without_fp8_compute():
    model = _quantized("llama")
    assert patched(model) == []
    assert fp8_producers.install_fp8_producers(model) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_norms_and_mlp_patched_output_unchanged(arch, fp8_from_m):
    pytest.importorskip("triton")
    base = _quantized(arch)
    model = copy.deepcopy(base)
    fp8_from_m()
    assert fp8_producers.install_fp8_producers(model) == 3 * 2  # 2 decoder layers
    names = patched(model)
    assert {n.split(".")[-1] for n in names} == {
        "input_layernorm", "post_attention_layernorm", "mlp"}  # fmt: skip
    layers = [m for m in model.modules() if hasattr(m, fp8_producers.SCOPED)]
    assert [type(m).__name__ for m in layers] == [f"{type(layers[0]).__name__}"] * 2
    assert type(layers[0]).__name__.endswith("DecoderLayer")
    assert fp8_producers.install_fp8_producers(model) == 0  # already patched
    with torch.no_grad():
        want = base(PROMPT).logits
        got = model(PROMPT).logits
        again = copy.deepcopy(model)(PROMPT).logits  # a copy runs its own weights
    assert torch.equal(got, want) and torch.equal(again, want)
    assert fp8_producers.remove_fp8_producers(model) == 6 and patched(model) == []
    assert not any(hasattr(m, fp8_producers.SCOPED) for m in model.modules())
    assert all("forward" not in vars(m) for m in model.modules())


def test_readers_not_quantized_leave_the_module(fp8_from_m):
    pytest.importorskip("triton")
    fp8_from_m()  # quantize_model installs the producers itself
    model = quantize_model(
        float_model(make_config("llama"), dtype=torch.bfloat16),
        "nvfp4",
        exclude=("lm_head", "re:.*mlp.*"),
    )
    assert {n.split(".")[-1] for n in patched(model)} == {"input_layernorm"}


def test_other_architectures_untouched(fp8_from_m):
    pytest.importorskip("triton")
    fp8_from_m()
    # Phi-3 fuses qkv_proj / gate_up_proj and its MLP is not LlamaMLP's: nothing to patch;
    # a Mixtral layer's post-attention norm feeds a router, not gate / up linears
    for arch in ("phi3", "mixtral"):
        model = _quantized(arch)
        assert all(n.endswith("input_layernorm") for n in patched(model)), (arch, patched(model))


def test_decoder_layer_runs_inside_a_sharing_scope(fp8_from_m):
    """The linears of a scoped layer see an open scope; outside the layer none is open."""
    pytest.importorskip("triton")
    model = _quantized("llama")
    fp8_from_m()
    fp8_producers.install_fp8_producers(model)
    depths = []
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda *a: depths.append(fp8_handoff._local.depth))
    with torch.no_grad():
        model(PROMPT)  # 6 rows: from the claimed M = 4 on
        model(PROMPT[:, :3])  # 3 rows: no FP8 compute, no scope
    assert depths == [1, 0] and fp8_handoff._local.depth == 0

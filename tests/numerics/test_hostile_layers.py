"""Layer inputs and checkpoints that used to give silent wrong answers: an excluded layer stored
quantized, expert ids outside the range, non-finite activations under W4A4 / W8A8 emulation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_moe import layer_of, make_experts, rand_x

from quantdispatch.api import load_settings
from quantdispatch.errors import CheckpointError
from quantdispatch.formats import quantize_fp8, quantize_nvfp4
from quantdispatch.layers import QuantLinear, load_linear

REFERENCE = load_settings({}, backend={"nvfp4": "reference", "fp8": "reference"})

# -- case 2: a layer the config excludes but the checkpoint stores quantized ---------------------


def _fp8_state(prefix: str, n: int = 32, k: int = 64) -> dict[str, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    q = quantize_fp8(w, kind="tensor")
    return {f"{prefix}.weight": q.weight, f"{prefix}.weight_scale": q.scale}


@pytest.mark.parametrize(
    "config",
    [
        {"quant_method": "fp8", "ignored_layers": ["re:.*"]},
        {"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]},
    ],
)
def test_an_excluded_layer_stored_quantized_is_an_error(config):
    prefix = "model.layers.0.mlp.down_proj"
    with pytest.raises(CheckpointError, match=r"down_proj.*config excludes it.*stores it quant"):
        load_linear(_fp8_state(prefix), prefix, config, device="cpu")


def test_an_excluded_float_layer_still_loads_as_nn_linear():
    head = torch.randn(16, 32)
    layer = load_linear(
        {"lm_head.weight": head}, "lm_head", {"quant_method": "fp8", "ignored_layers": ["lm_head"]}
    )
    assert type(layer) is torch.nn.Linear and torch.equal(layer.weight, head.bfloat16())


# -- case 6: expert ids outside [0, num_experts) -------------------------------------------------


@pytest.mark.parametrize("held", [None, [4, 5, 6, 7]], ids=["all-experts", "experts-4-7"])
def test_out_of_range_ids_contribute_nothing_when_not_validated(held):
    ex = make_experts("nvfp4", 8, 64, 32, seed=50)
    if held is None:
        layer = layer_of(ex, top_k=2, num_experts=8, validate_ids=False)
    else:
        def pick(ws):
            return [ws[i] for i in held]

        layer = layer_of(
            dataclasses.replace(ex, gate=pick(ex.gate), up=pick(ex.up), down=pick(ex.down)),
            top_k=2,
            num_experts=8,
            expert_ids=held,
            validate_ids=False,
        )
    x = rand_x(5, 64, torch.bfloat16, seed=51)
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(52))
    good = torch.tensor([[7, 5], [6, 4], [5, 7], [4, 6], [7, 4]])
    bad = torch.tensor([-1, 8, 100, -5, -(2**31)])
    ids = good.clone()
    ids[:, 1] = bad  # every token's second pair is invalid
    expected = layer(x, topk_ids=good, topk_weights=weights * torch.tensor([1.0, 0.0]))
    for dtype in (torch.int32, torch.int64):
        got = layer(x, topk_ids=ids.to(dtype), topk_weights=weights)
        assert torch.equal(got, expected)


def test_out_of_range_ids_are_an_error_when_validated():
    from quantdispatch.errors import InputError

    ex = make_experts("nvfp4", 4, 64, 32, seed=53)
    layer = layer_of(ex, top_k=2, num_experts=4)
    x = rand_x(2, 64, torch.bfloat16, seed=54)
    with pytest.raises(InputError, match=r"topk_ids has values in \[-1, 3\]"):
        layer(x, topk_ids=torch.tensor([[-1, 3], [0, 1]]), topk_weights=torch.ones(2, 2))


# -- case 8: a non-finite activation stays non-finite under activation emulation ----------------


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_emulated_activations_keep_inf_and_nan(fmt, bad):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(60)) * 0.05
    if fmt == "nvfp4":
        q = quantize_nvfp4(w, with_input_scale=0.05)
    else:
        q = dataclasses.replace(quantize_fp8(w, kind="tensor"), input_scale=torch.tensor(0.02))
    layer = QuantLinear(q, device="cpu", emulate_activations=True, settings=REFERENCE)
    x = rand_x(3, 64, torch.bfloat16, seed=61)
    clean = layer(x)
    x[1, 5] = bad
    out = layer(x)
    assert not torch.isfinite(out[1]).any()
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])

"""QuantLinear / QuantMoE forced to marlin, end to end on the CPU, against float64.

The provider here is tests/marlin_fake.py: vLLM 0.33.0's op schemas implemented in torch from
the kernel semantics documented in docs/design/marlin.md. These tests prove our adapter
wiring (preparation, padding, argument order, output slicing, bias, the MoE routing around the
grouped GEMM, routing weights applied once) against those documented semantics. They do not
prove the peer's kernel behaves as documented: tests/gpu/test_marlin_gpu.py does, on a GPU
with vLLM's library. The CPU is let through the backend's GPU rule for these tests only.
"""

from __future__ import annotations

import pytest
import torch
from marlin_fake import fake_ops
from ref64 import (
    mxfp4_weight64,
    nvfp4_weight64,
    random_codes,
    random_e4m3_scales,
    rel_err,
)

from quantdispatch.api import load_settings
from quantdispatch.backends import marlin_contract, marlin_providers
from quantdispatch.backends.marlin import MarlinFacts
from quantdispatch.formats import Mxfp4Weight, Nvfp4Weight
from quantdispatch.layers import QuantLinear, QuantMoE
from quantdispatch.resolver import _resolve

BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setattr(MarlinFacts, "device_reasons", lambda self, request, profile: [])
    monkeypatch.setattr(marlin_providers, "_dist_version", lambda dist: None)
    marlin_providers.reset()
    _resolve.cache_clear()
    with fake_ops():
        marlin_providers.register("vllm", "0.33.0")
        yield
    marlin_providers.reset()
    _resolve.cache_clear()


def _nvfp4(n, k, seed, global_scale=1.0 / 3000):
    g = torch.Generator().manual_seed(seed)
    return Nvfp4Weight(
        random_codes(n, k, g),
        random_e4m3_scales((n, k // 16), g),
        torch.tensor(global_scale, dtype=torch.float32),
    )


def _mxfp4(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return Mxfp4Weight(
        random_codes(n, k, g), torch.randint(112, 124, (n, k // 32), generator=g).to(torch.uint8)
    )


def _forced(fmt, backend="marlin"):
    return load_settings({}, backend={fmt: backend})


@pytest.mark.parametrize(
    ("fmt", "act"),
    [("nvfp4", torch.bfloat16), ("nvfp4", torch.float16), ("mxfp4", torch.bfloat16)],
)
@pytest.mark.parametrize(
    ("n", "k", "m"),
    [(256, 512, 1), (256, 512, 16), (256, 512, 100), (72, 96, 7), (720, 2880, 16)],
    ids=["m1", "m16", "m100", "padded-n-and-k", "tp-shard-720x2880"],
)
def test_quant_linear_on_marlin_matches_float64(fake_vllm, fmt, act, n, k, m):
    w = _nvfp4(n, k, seed=n + k) if fmt == "nvfp4" else _mxfp4(n, k, seed=n + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m))
    layer = QuantLinear(w, bias=bias, act_dtype=act, device="cpu", settings=_forced(fmt))
    assert layer.backend == "marlin"
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(act)
    w64 = (
        nvfp4_weight64(w.packed, w.block_scale, w.global_scale)
        if fmt == "nvfp4"
        else mxfp4_weight64(w.packed, w.block_scale)
    )
    out = layer(x)
    assert out.shape == (m, n) and out.dtype == act
    assert rel_err(out, x.double() @ w64.T + bias.double()) < BOUND[act]


def test_fp16_keeps_small_block_scales_bf16_rescales_them(fake_vllm):
    """A weight whose block scales are all tiny (global scale 1): fp16 reads them exactly,
    bf16 needs the power-of-two rescale (without it every scale would read ~2^-112)."""
    g = torch.Generator().manual_seed(5)
    n, k = 128, 256
    scales = (torch.rand(n, k // 16, generator=g) * 2.0**-7 + 2.0**-9).to(torch.float8_e4m3fn)
    w = Nvfp4Weight(random_codes(n, k, g), scales, torch.tensor(1.0))
    w64 = nvfp4_weight64(w.packed, w.block_scale, w.global_scale)
    for act in (torch.float16, torch.bfloat16):
        layer = QuantLinear(w, act_dtype=act, device="cpu", settings=_forced("nvfp4"))
        x = torch.randn(8, k, generator=g).to(act)
        assert rel_err(layer(x), x.double() @ w64.T) < BOUND[act]


def test_a_wrong_scale_order_is_caught(fake_vllm, monkeypatch):
    """The fake provider is sensitive to the contract: drop the (0, 2, 1, 3) pair swap and
    the product is garbage."""
    w = _nvfp4(256, 512, seed=9)
    good = QuantLinear(w, device="cpu", settings=_forced("nvfp4"))

    def unswapped(groups, n, device=None):
        return (
            torch.arange(groups * n, device=device)
            .reshape(-1, 64)[:, [i + 8 * j for i in range(8) for j in range(8)]]
            .reshape(-1)
        )

    monkeypatch.setattr(marlin_contract, "scale_permutation", unswapped)
    bad = QuantLinear(w, device="cpu", settings=_forced("nvfp4"))
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = x.double() @ nvfp4_weight64(w.packed, w.block_scale, w.global_scale).T
    assert rel_err(good(x), ref) < BOUND[torch.bfloat16]
    assert rel_err(bad(x), ref) > 0.1


def test_empty_batch_and_state_dict_round_trip(fake_vllm):
    w = _nvfp4(720, 2880, seed=3)
    layer = QuantLinear(w, device="cpu", settings=_forced("nvfp4"))
    assert layer(torch.empty(0, 2880, dtype=torch.bfloat16)).shape == (0, 720)
    names = set(dict(layer.named_buffers()))
    assert {"marlin_qweight", "marlin_scales", "marlin_global_scale", "marlin_workspace"} <= names
    assert layer.marlin_qweight.shape == (2880 // 16, 2 * 768)  # N padded 720 -> 768


def _experts(fmt, e, hidden, inter, seed):
    make = _nvfp4 if fmt == "nvfp4" else _mxfp4
    gate = [make(inter, hidden, seed + 3 * i) for i in range(e)]
    up = [make(inter, hidden, seed + 3 * i + 1) for i in range(e)]
    down = [make(hidden, inter, seed + 3 * i + 2) for i in range(e)]
    return gate, up, down


@pytest.mark.parametrize(
    ("fmt", "act", "activation"),
    [
        ("nvfp4", torch.bfloat16, "silu"),
        ("nvfp4", torch.float16, "silu"),
        ("mxfp4", torch.bfloat16, "swiglu_oai"),
    ],
)
def test_quant_moe_on_marlin_matches_the_reference_backend(fake_vllm, fmt, act, activation):
    """8 experts of which this rank holds 6 (pairs routed elsewhere contribute nothing),
    I = 96 padded to 128, biases, renormalized routing with a routed scaling factor of 2.5
    (applied once, by QuantMoE, never by the provider)."""
    e_all, held, hidden, inter, m = 8, [0, 1, 2, 4, 5, 7], 256, 96, 9
    gate, up, down = _experts(fmt, len(held), hidden, inter, seed=11)
    g = torch.Generator().manual_seed(4)
    b13 = torch.randn(len(held), 2 * inter, generator=g) * 0.1
    b2 = torch.randn(len(held), hidden, generator=g) * 0.1
    kw = dict(
        top_k=3,
        num_experts=e_all,
        expert_ids=held,
        activation=activation,
        w13_bias=b13,
        w2_bias=b2,
        renormalize=True,
        routed_scaling_factor=2.5,
        act_dtype=act,
        device="cpu",
    )
    marlin = QuantMoE(gate, up, down, settings=_forced(fmt), **kw)
    ref = QuantMoE(gate, up, down, settings=_forced(fmt, "reference"), **kw)
    assert marlin.backend == "marlin" and marlin.w13_marlin_qweight.shape[0] == len(held)
    x = torch.randn(m, hidden, generator=g).to(act)
    logits = torch.randn(m, e_all, generator=g) * 2
    got, want = marlin(x, logits), ref(x, logits)
    assert rel_err(got, want.double()) < 2 * BOUND[act]
    assert float(want.float().abs().max()) > 0

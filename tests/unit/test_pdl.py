"""The PDL switch (programmatic dependent launches) as an argument: Settings.pdl
(``QUANTDISPATCH_PDL``) -> the Decision -> the layer's op call -> the triton backend's run path
-> the launchers. kernels/common/pdl.py reads no environment and imports no settings."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import quantdispatch.ops  # noqa: F401  (registers torch.ops.quantdispatch.*)
from quantdispatch.api import current_settings, load_settings, select
from quantdispatch.backends import reference as reference_backend
from quantdispatch.backends.base import Layout, Mma16x64Meta, encode_meta
from quantdispatch.backends.triton import run
from quantdispatch.errors import ConfigurationError
from quantdispatch.kernels.common.device_facts import DeviceFacts
from quantdispatch.kernels.mma_layout.moe_plan import SmallMoeConfig, mma_layout_moe_plan

ENV = "QUANTDISPATCH_PDL"
#: What an H200 offers: dependent launches where Triton has grid dependency control.
H200 = DeviceFacts.for_capability((9, 0))


@pytest.mark.parametrize(
    "value, on",
    [(None, True), ("1", True), (" true ", True), ("", True), ("0", False), ("off", False)],
)
def test_the_setting_and_the_decision_follow_the_environment(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert current_settings().pdl is on
    assert current_settings().describe()["pdl"] is on
    assert select("nvfp4", device="h200", n=4096, k=4096).pdl is on


@pytest.mark.parametrize("value", ["yes please", "2", "enabled"])
def test_malformed_value_names_itself_and_the_fix(monkeypatch, value):
    with pytest.raises(ConfigurationError, match=rf"QUANTDISPATCH_PDL='{value}' is not a boolean"):
        load_settings({ENV: value})
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigurationError, match=r"PDL=0 or 1"):
        current_settings()


def test_the_decision_records_the_settings_it_was_made_with():
    assert not select("nvfp4", device="h200", settings=load_settings({}, pdl=False)).pdl
    assert select("nvfp4", device="h200", settings=load_settings({})).pdl


def test_kernels_read_no_environment(monkeypatch):
    """The plan takes pdl as an argument: QUANTDISPATCH_PDL=0 in the environment does not
    reach it directly (it reaches it through the decision)."""
    from quantdispatch.kernels.common import pdl

    monkeypatch.setenv(ENV, "0")
    assert not hasattr(pdl, "pdl_enabled")
    on = mma_layout_moe_plan(1, 8, 128, 768, 2048, H200, pdl=True)
    off = mma_layout_moe_plan(1, 8, 128, 768, 2048, H200, pdl=False)
    assert isinstance(on, SmallMoeConfig) and isinstance(off, SmallMoeConfig)
    assert on.pdl is H200.dependent_launches and not off.pdl
    cpu = DeviceFacts.for_capability(None)
    assert not mma_layout_moe_plan(1, 8, 128, 768, 2048, cpu, pdl=True).pdl  # no GPU: never


@pytest.mark.parametrize("pdl", [True, False])
def test_the_triton_linear_hands_pdl_to_the_wgmma_gemm(monkeypatch, pdl):
    seen: dict = {}

    def fake_gemm(x, words, scales, gs, bias=None, **kw):
        seen.update(kw)
        return x.new_zeros((x.shape[0], words.shape[0] * 16))

    monkeypatch.setattr(run, "device_facts", lambda device: H200)
    monkeypatch.setattr(run, "mma_gemm", fake_gemm)
    n, k, m = 64, 128, 64  # a small weight on SM 9.x: the wgmma GEMM from 33 rows
    words = torch.zeros((n // 16, k // 64, 32, 4), dtype=torch.int32)
    scales = torch.zeros((n // 16, k // 64, 32, 2), dtype=torch.uint8)
    meta = encode_meta(Layout.MMA16X64, Mma16x64Meta(torch.bfloat16))
    x = torch.zeros((m, k), dtype=torch.bfloat16)
    args = (x, [words, scales, torch.ones(1)], None, "triton", "nvfp4", meta, n)
    torch.ops.quantdispatch.linear(*args, pdl)
    assert seen["pdl"] is pdl and seen["facts"] is H200


@pytest.mark.parametrize("pdl", [True, False])
def test_the_triton_moe_plans_and_launches_with_pdl(monkeypatch, pdl):
    seen: dict = {}

    def fake_moe(x, *args, **kw):
        seen.update(kw)
        return torch.zeros_like(x)

    monkeypatch.setattr(run, "device_facts", lambda device: H200)
    monkeypatch.setattr(run, "mma_layout_moe", fake_moe)
    e, inter, hidden, top_k = 128, 768, 2048, 8

    def stack(n: int, k: int) -> list[torch.Tensor]:
        words = torch.zeros((e, n // 16, k // 64, 32, 4), dtype=torch.int32)
        return [words, torch.zeros((e, n // 16, k // 64, 32, 2), dtype=torch.uint8), torch.ones(e)]

    x = torch.zeros((1, hidden), dtype=torch.bfloat16)
    ids = torch.arange(top_k, dtype=torch.int32)[None]
    w = torch.full((1, top_k), 1 / top_k)
    meta = encode_meta(Layout.MMA16X64, Mma16x64Meta(torch.bfloat16))
    w13, w2 = stack(2 * inter, hidden), stack(hidden, inter)
    torch.ops.quantdispatch.moe(x, ids, w, w13, w2, None, None, "triton", "nvfp4", "silu", [],
                                meta, pdl)  # fmt: skip
    assert seen["pdl"] is pdl
    assert isinstance(seen["config"], SmallMoeConfig)
    assert seen["config"].pdl is (pdl and H200.dependent_launches)


@pytest.mark.parametrize("pdl", [True, False])
def test_layers_pass_their_decisions_pdl_to_the_backend(monkeypatch, pdl):
    """QuantLinear and QuantMoE call the op with decision.pdl, which reaches the backend's
    linear binding / MoeCall.pdl (the reference backend here: it runs on the CPU)."""
    from quantdispatch.formats import quantize_nvfp4
    from quantdispatch.layers import QuantLinear, QuantMoE

    seen: list[bool] = []
    real_linear = reference_backend.ReferenceBackend.make_linear
    real_moe = reference_backend.ReferenceBackend.moe

    def linear(self, w):
        seen.append(w.pdl)
        return real_linear(self, w)

    def moe(self, call):
        seen.append(call.pdl)
        return real_moe(self, call)

    monkeypatch.setattr(reference_backend.ReferenceBackend, "make_linear", linear)
    monkeypatch.setattr(reference_backend.ReferenceBackend, "moe", moe)
    settings = load_settings({}, pdl=pdl)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=gen)
    layer = QuantLinear(quantize_nvfp4(w), settings=settings, device="cpu")
    assert layer.decision.pdl is pdl
    layer(torch.randn(3, 64, generator=gen).to(torch.bfloat16))
    experts = [quantize_nvfp4(torch.randn(32, 64, generator=gen)) for _ in range(4)]
    downs = [quantize_nvfp4(torch.randn(64, 32, generator=gen)) for _ in range(4)]
    moe_layer = QuantMoE(
        gate=experts, up=experts, down=downs, top_k=2, settings=settings, device="cpu"
    )
    moe_layer(torch.randn(3, 64, generator=gen).to(torch.bfloat16), torch.randn(3, 4))
    assert seen == [pdl, pdl]

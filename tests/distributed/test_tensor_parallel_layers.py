"""The layer API's tensor-parallel arguments, one process: ``QuantLinear.from_checkpoint`` /
``QuantMoE.from_checkpoint`` build exactly the shard ``read_linear_shard`` / ``read_moe_shard``
read (and with ``tp_size=1`` the whole layer, as without the arguments), ``load_linear`` cuts an
unquantized layer by the same rules reading only its slice, and bad specs are clear errors
through every entry point. Across processes: test_tensor_parallel_dist.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from tp_checkpoints import assert_clear_errors, experts, linear_layer

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.checkpoints import SafetensorsStateDict, read_linear_shard, read_moe_shard
from quantdispatch.errors import CheckpointError, ConfigurationError, WeightFormatError
from quantdispatch.layers import load_linear

P = "model.layers.0.proj"
#: Leaves dense.* unquantized: load_linear gives an nn.Linear for them.
DENSE = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["dense.*"]}}
X = torch.randn(3, 96, generator=torch.Generator().manual_seed(20)).to(torch.bfloat16)


def _lazy(sd, tmp_path) -> SafetensorsStateDict:
    save_file(sd, str(tmp_path / "model.safetensors"))
    return SafetensorsStateDict(tmp_path / "model.safetensors")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a, b) -> bool:
    """The same buffers, bit for bit (FP8 compared as bytes)."""
    ta, tb = a.state_dict(), b.state_dict()
    return ta.keys() == tb.keys() and all(torch.equal(_bits(ta[k]), _bits(tb[k])) for k in ta)


def test_tp_size_one_is_the_whole_layer():
    g = torch.Generator().manual_seed(21)
    sd = linear_layer("ct-nvfp4", P, 48, 96, g)
    one = dict(tp_rank=0, tp_size=1, align=64, device="cpu")
    for parallel in ("column", "row"):
        a = QuantLinear.from_checkpoint(sd, P, parallel=parallel, **one)
        assert _same(a, QuantLinear.from_checkpoint(sd, P, device="cpu"))
    moe = experts("modelopt-nvfp4", "L.mlp", 3, 64, 32, g)
    kw = dict(num_experts=3, top_k=2, device="cpu")
    a = QuantMoE.from_checkpoint(moe, "L.mlp", tp_rank=0, tp_size=1, align=64, **kw)
    assert _same(a, QuantMoE.from_checkpoint(moe, "L.mlp", **kw))


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_quant_linear_from_checkpoint_is_the_rank_shard(parallel, tmp_path):
    """N = 80 over 3 ranks (27 / 27 / 26 rows), K = 96: 6 groups (32 / 32 / 32 columns)."""
    sd = linear_layer("modelopt-nvfp4", P, 80, 96, torch.Generator().manual_seed(22))
    lazy = _lazy(sd, tmp_path)
    for r in range(3):
        before = lazy.bytes_read
        layer = QuantLinear.from_checkpoint(
            lazy, P, tp_rank=r, tp_size=3, parallel=parallel, device="cpu"
        )
        read = lazy.bytes_read - before
        shard = read_linear_shard(sd, P, tp_rank=r, tp_size=3, parallel=parallel)
        assert _same(layer, QuantLinear.from_loaded(shard, device="cpu"))
        assert (layer.out_features, layer.in_features) == tuple(shard.weight.shape)
        assert (layer.bias is None) == (parallel == "row" and r != 0)
        assert read < sum(t.numel() * t.element_size() for t in sd.values()) / 2


def test_quant_moe_from_checkpoint_is_the_rank_shard():
    sd = experts("ct-mxfp4", "L.mlp", 4, 64, 96, torch.Generator().manual_seed(23))
    for tp_rank in range(3):  # I = 96: 3 groups of 32
        layer = QuantMoE.from_checkpoint(
            sd, "L.mlp", num_experts=4, top_k=2, expert_ids=[3, 1], tp_rank=tp_rank, tp_size=3,
            device="cpu",
        )  # fmt: skip
        shard = read_moe_shard(
            sd, "L.mlp", num_experts=4, expert_ids=[3, 1], tp_rank=tp_rank, tp_size=3
        )
        assert layer.intermediate_size == 32 and layer.expert_ids == (3, 1)
        stacks = [getattr(layer, n) for n in (*layer._names13, *layer._names2)]
        assert all(
            torch.equal(_bits(a), _bits(b))
            for a, b in zip(stacks, shard.w13 + shard.w2, strict=True)
        )


def _dense(tmp_path, bias_k=True):
    g = torch.Generator().manual_seed(24)
    sd = {}
    for name, rows in (("q", 64), ("k", 16), ("v", 16), ("o", 48)):  # 4 q heads, 1 kv head
        k = 64 if name == "o" else 96
        sd[f"dense.{name}.weight"] = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        if name != "k" or bias_k:
            sd[f"dense.{name}.bias"] = torch.randn(rows, generator=g).to(torch.bfloat16)
    sd["dense.qkv.weight"] = torch.cat([sd[f"dense.{n}.weight"] for n in "qkv"])
    return sd, _lazy(sd, tmp_path)


def test_load_linear_cuts_unquantized_layers(tmp_path):
    sd, lazy = _dense(tmp_path, bias_k=False)
    qkv = [f"dense.{n}" for n in "qkv"]
    whole = load_linear(sd, qkv, DENSE, device="cpu")
    assert type(whole) is torch.nn.Linear and whole.weight.shape == (96, 96)
    assert torch.equal(whole.bias[64:80], torch.zeros(16, dtype=torch.bfloat16))  # k: no bias
    w, b = whole.weight, whole.bias
    for r in range(2):  # q heads 2 per rank, the one kv head on both
        q, kv = slice(32 * r, 32 * r + 32), [*range(64, 96)]
        rows = torch.tensor([*range(96)[q], *kv])
        for prefix, segments in ((qkv, None), ("dense.qkv", [64, 16, 16])):
            before = lazy.bytes_read
            layer = load_linear(
                lazy, prefix, DENSE, tp_rank=r, tp_size=2, heads=(4, 1), segments=segments,
                device="cpu",
            )  # fmt: skip
            assert lazy.bytes_read - before <= 64 * 96 * 2 + 64 * 2  # its 64 rows (+ bias)
            assert torch.equal(layer.weight, w[rows])
            if segments is None:
                assert torch.equal(layer.bias, b[rows])
            else:
                assert layer.bias is None  # the fused tensor has no bias
    o = sd["dense.o.weight"]
    for r in range(3):  # K = 64 over 3: 22 / 21 / 21 columns
        before = lazy.bytes_read
        layer = load_linear(lazy, "dense.o", DENSE, tp_rank=r, tp_size=3, parallel="row")
        a = [0, 22, 43, 64][r]
        k = layer.in_features
        assert torch.equal(layer.weight, o[:, a : a + k]) and k == [22, 21, 21][r]
        assert (layer.bias is not None) == (r == 0)
        bias = 48 * 2 if r == 0 else 0
        assert lazy.bytes_read - before == 48 * k * 2 + bias  # its columns only
    aligned = [
        load_linear(sd, "dense.o", DENSE, tp_rank=r, tp_size=3, parallel="row", align=16)
        for r in range(3)
    ]
    assert [m.in_features for m in aligned] == [32, 16, 16]


def test_layer_api_bad_specs_are_clear_errors(tmp_path):
    g = torch.Generator().manual_seed(25)
    sd = linear_layer("modelopt-nvfp4", P, 64, 32, g)  # K = 32: two NVFP4 groups
    qkv = {}
    for name, heads in (("q", 12), ("k", 4), ("v", 4)):
        qkv |= linear_layer("modelopt-nvfp4", f"a.{name}", heads * 16, 64, g)
    qkv_p = [f"a.{n}" for n in "qkv"]
    moe = experts("modelopt-nvfp4", "L.mlp", 2, 64, 32, g)  # I = 32: two groups
    dense, _ = _dense(tmp_path)
    dq = [f"dense.{n}" for n in "qkv"]
    moe_kw = dict(num_experts=2, top_k=1, device="cpu")
    cases = [
        (
            lambda: QuantLinear.from_checkpoint(sd, P, tp_rank=2, tp_size=2),
            ConfigurationError,
            r"tp_rank=2, tp_size=2.*0 <= tp_rank < tp_size",
        ),
        (
            lambda: load_linear(dense, "dense.o", DENSE, tp_rank=3, tp_size=2),
            ConfigurationError,
            r"tp_rank=3, tp_size=2",
        ),
        (
            lambda: QuantMoE.from_checkpoint(moe, "L.mlp", tp_rank=1, tp_size=1, **moe_kw),
            ConfigurationError,
            r"tp_rank=1, tp_size=1",
        ),
        (  # heads that do not divide over the ranks
            lambda: QuantLinear.from_checkpoint(qkv, qkv_p, tp_rank=0, tp_size=8, heads=(12, 4)),
            WeightFormatError,
            "12 q heads and 4 kv heads cannot be split over tp_size=8",
        ),
        (
            lambda: load_linear(dense, dq, DENSE, tp_rank=0, tp_size=8, heads=(4, 1)),
            WeightFormatError,
            "4 q heads and 1 kv heads cannot be split over tp_size=8",
        ),
        (
            lambda: QuantLinear.from_checkpoint(sd, P, tp_rank=0, tp_size=128),
            WeightFormatError,
            "64 row.* cannot be split over 128 ranks",
        ),
        (  # K = 32 is two NVFP4 groups: not four ranks' worth of whole groups
            lambda: QuantLinear.from_checkpoint(sd, P, tp_rank=0, tp_size=4, parallel="row"),
            WeightFormatError,
            r"K of .* = 32 is 2 scale group\(s\) of 16.*4 ranks.*tp_size <= 2",
        ),
        (
            lambda: load_linear(sd, P, tp_rank=0, tp_size=4, parallel="row", device="cpu"),
            WeightFormatError,
            r"K of .* = 32 is 2 scale group\(s\) of 16",
        ),
        (
            lambda: QuantMoE.from_checkpoint(moe, "L.mlp", tp_rank=0, tp_size=4, **moe_kw),
            WeightFormatError,
            r"I \(NVFP4\) = 32 is 2 scale group\(s\) of 16.*4 ranks",
        ),
        (
            lambda: QuantMoE.from_checkpoint(moe, "L.mlp", tp_rank=0, tp_size=2, align=0, **moe_kw),
            ConfigurationError,
            "align=0",
        ),
        (
            lambda: QuantLinear.from_checkpoint(sd, P, parallel="rows"),
            ConfigurationError,
            "parallel='rows'",
        ),
        (
            lambda: load_linear(dense, dq, DENSE, tp_rank=0, tp_size=2, parallel="row"),
            ConfigurationError,
            r"a row-parallel layer \(o, down\) is one weight",
        ),
        (
            lambda: load_linear(dense, "dense.qkv", DENSE, tp_rank=0, tp_size=2, segments=[64]),
            WeightFormatError,
            r"segments \[64\] of dense.qkv add up to 64 but the weight has N = 96",
        ),
        (
            lambda: load_linear(dense, ["dense.q", "dense.o"], DENSE, tp_rank=0, tp_size=2),
            CheckpointError,
            "fused parts share K",
        ),
        (
            lambda: load_linear(dense, "dense.x", DENSE, tp_rank=0, tp_size=2),
            CheckpointError,
            "missing tensor 'dense.x.weight' of unquantized layer",
        ),
    ]
    assert_clear_errors(cases)

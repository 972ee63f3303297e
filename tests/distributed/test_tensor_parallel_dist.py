"""Tensor and expert parallelism across processes: torch.distributed with the gloo backend, 2
and 4 ranks spawned here, each building its layers with the layer API's tensor-parallel
arguments (reading only its shards of one safetensors checkpoint) and running them on the
reference backend. Quantized column-parallel outputs all-gathered equal the unsharded layer bit
for bit (unquantized ones within bf16 rounding); row-parallel, MLP and MoE (TP, EP, EP x TP)
outputs all-reduced are within the bf16 rounding of each rank's partial output of the float64
result of the whole layer."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import tp_workers
from launcher import gloo_skip_reason, launch
from tp_checkpoints import silu_glu64, stack64, swiglu_oai64, weight64

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.checkpoints import parse_quant_config, read_linear, read_moe_shard
from quantdispatch.layers import load_linear


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request, tmp_path_factory):
    reason = gloo_skip_reason()
    if reason:
        pytest.skip(reason)
    world = request.param
    folder = tmp_path_factory.mktemp(f"tp{world}")
    sd, cases = tp_workers.write_cases(folder, world)
    launch(tp_workers.run, world, str(folder), timeout=120)
    results = [torch.load(folder / f"rank{r}.pt") for r in range(world)]
    return SimpleNamespace(world=world, sd=sd, cases={c["name"]: c for c in cases}, results=results)


def _of(ranks, kind):
    return [c for c in ranks.cases.values() if c["kind"] == kind]


def _quant(case, prefix):
    cfg = case.get("config")
    return parse_quant_config(cfg).layer(prefix) if cfg else None


def _within_bf16(y, magnitude, ref, slack=2.0**-14):
    """|y - ref| <= 2^-8 (bf16's unit roundoff) x the sum of |each rank's partial output|, plus
    a fp32 accumulation slack: each rank rounds its partial to bf16 once before the sum."""
    bound = 2.0**-8 * magnitude + slack * float(ref.abs().max())
    worst = float(((y - ref).abs() / bound).max())
    return worst <= 1.0, worst


def _layer_bytes(sd, prefix):
    names = [prefix] if isinstance(prefix, str) else prefix
    return sum(
        t.numel() * t.element_size()
        for k, t in sd.items()
        if any(k.startswith(p + ".") or k.startswith(p + "_") for p in names)
    )


def _qkv_columns(world, heads, n):
    """The whole fused layer's output columns in the order the ranks' shards hold them: each
    rank's q heads, then its kv heads' k and v."""
    hq, hkv = heads
    d = n // (hq + 2 * hkv)
    cols = []
    for r in range(world):
        q, kv = hq // world, hkv // world
        cols += range(r * q * d, (r + 1) * q * d)
        cols += range(hq * d + r * kv * d, hq * d + (r + 1) * kv * d)
        cols += range((hq + hkv) * d + r * kv * d, (hq + hkv) * d + (r + 1) * kv * d)
    return torch.tensor(cols)


@contextmanager
def _one_thread():
    """The ranks run one intra-op thread each; CPU BLAS splits K differently with more threads,
    so the whole layer is computed the same way to compare bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_column_parallel_gathers_to_the_whole_layer(ranks):
    for case in _of(ranks, "column"):
        name, prefix = case["name"], case["prefix"]
        full = load_linear(ranks.sd, prefix, case.get("config"), device="cpu")
        with _one_thread():
            want = full(case["x"]).double()
        if case.get("heads"):
            want = want[:, _qkv_columns(ranks.world, case["heads"], full.out_features)]
        got = ranks.results[0][name]["y"]
        if isinstance(full, QuantLinear):
            assert torch.equal(got, want), name
        else:  # nn.Linear in bf16: CPU GEMMs may block K differently for other N
            assert torch.allclose(got, want, rtol=2**-7, atol=2**-7 * float(want.abs().max()))
        rows = [r[name]["shape"][0] for r in ranks.results]
        assert sum(rows) == full.out_features, (name, rows)
        whole = _layer_bytes(ranks.sd, prefix)
        for r, n in zip(ranks.results, rows, strict=True):  # its share, not the whole layer
            assert r[name]["bytes_read"] <= whole * n / full.out_features + 64, name
    gqa = [r["qkv-gqa"]["shape"][0] for r in ranks.results]
    assert gqa == [(32 + 2 * 8) * 64 // ranks.world] * ranks.world  # q heads + their kv heads


def test_row_parallel_all_reduces_to_the_whole_layer(ranks):
    for case in _of(ranks, "row"):
        name, prefix, x = case["name"], case["prefix"], case["x"]
        if name.startswith("dense"):  # unquantized: load_linear gives an nn.Linear
            w, b = ranks.sd[f"{prefix}.weight"].double(), ranks.sd[f"{prefix}.bias"]
        else:
            full = read_linear(ranks.sd, prefix, _quant(case, prefix))
            w, b = weight64(full.weight), full.bias
        ref = x.double() @ w.T + b.double()
        got = ranks.results[0][name]
        ok, worst = _within_bf16(got["y"], got["abs"], ref)
        assert ok, (name, worst)
        assert [r[name]["bias"] for r in ranks.results] == [True] + [False] * (ranks.world - 1)
        cols = [r[name]["shape"][1] for r in ranks.results]
        assert sum(cols) == x.shape[1]
        whole, bias = _layer_bytes(ranks.sd, prefix), b.numel() * 2
        for i, (r, k) in enumerate(zip(ranks.results, cols, strict=True)):
            # its columns' share of the weight and scales; the bias on rank 0 only
            share = (whole - bias) * k / x.shape[1] + (bias if i == 0 else 0)
            assert r[name]["bytes_read"] <= share * 1.15 + 64, (name, i)


def test_mlp_with_uneven_intermediate_sums_to_the_whole_mlp(ranks):
    (case,) = _of(ranks, "mlp")
    sd, x = ranks.sd, case["x"]
    gate_up = QuantLinear.from_checkpoint(sd, ["mlp.gate_proj", "mlp.up_proj"], device="cpu")
    a = silu_glu64(gate_up(x).float()).to(torch.bfloat16)  # what every rank computes, in slices
    down = read_linear(sd, "mlp.down_proj")
    ref = a.double() @ weight64(down.weight).T + down.bias.double()
    got = ranks.results[0][case["name"]]
    ok, worst = _within_bf16(got["y"], got["abs"], ref)
    assert ok, worst


def _moe64(shard, layer, x, logits, activation):
    """The whole MoE layer in float64 from its canonical stacks and its own routing."""
    ids, weights = layer.route(logits)
    w13, w2 = stack64(shard, "w13"), stack64(shard, "w2")
    act = silu_glu64 if activation == "silu" else swiglu_oai64
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double(), strict=True):
            h = x[t].double() @ w13[e].T
            if shard.w13_bias is not None:
                h = h + shard.w13_bias[e].double()
            y = act(h) @ w2[e].T
            if shard.w2_bias is not None:
                y = y + shard.w2_bias[e].double()
            out[t] += w * y
    return out


def test_moe_tensor_expert_parallel_sum_to_the_whole_layer(ranks):
    for case in _of(ranks, "moe"):
        name, prefix = case["name"], case["prefix"]
        kw = dict(num_experts=4, top_k=2, activation=case["activation"])
        full = read_moe_shard(ranks.sd, prefix, num_experts=4)
        layer = QuantMoE.from_checkpoint(ranks.sd, prefix, device="cpu", **kw)
        ref = _moe64(full, layer, case["x"], case["logits"], case["activation"])
        got = ranks.results[0][name]
        ok, worst = _within_bf16(got["y"], got["abs"], ref)
        assert ok, (name, worst)
        slices = dict(r[name]["intermediate"] for r in ranks.results)  # tp rank -> its I
        assert sorted(slices) == list(range(case["tp"]))
        assert sum(slices.values()) == full.intermediate_size


def test_ranks_that_disagree_with_their_process_group_fail_at_load(tmp_path):
    import json

    import tp_group_workers
    from safetensors.torch import save_file
    from tp_checkpoints import linear_layer

    reason = gloo_skip_reason()
    if reason:
        pytest.skip(reason)
    g = torch.Generator().manual_seed(7)
    sd = linear_layer("modelopt-nvfp4", tp_group_workers.PREFIX, 64, 128, g)
    sd["dense.o.weight"] = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    save_file(sd, str(tmp_path / "model.safetensors"))
    launch(tp_group_workers.run, 2, str(tmp_path), timeout=120)
    r0, r1 = (json.loads((tmp_path / f"group{r}.json").read_text()) for r in range(2))
    assert r0["in_features"] == r1["in_features"] == 64  # the group filled tp_rank / tp_size
    assert r0["dense_in"] == r1["dense_in"] == 32
    assert r0["size"] == "ok" and "tp_size=4 but process_group says 2 (rank 1 of 2)" in r1["size"]
    assert r0["rank"] == "ok" and "tp_rank=0 but process_group says 1" in r1["rank"]


def test_a_process_group_without_torch_distributed_is_an_error():
    from quantdispatch.checkpoints.split_plan import tp_of_group
    from quantdispatch.errors import ConfigurationError

    assert tp_of_group(None, None) == (0, 1)
    assert tp_of_group(1, 2) == (1, 2)
    with pytest.raises(ConfigurationError, match="not initialized"):
        tp_of_group(None, 2, object())

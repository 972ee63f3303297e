"""QuantMoE and routing on the reference backend (CPU) against float64 maths written here.

The oracle: weights decoded from their bits by ``ref64`` (never by quantdispatch.formats), the
activations written out below, routing recomputed in float64, and a plain per-token loop over
each token's top-k experts. Outputs are compared in full (normwise relative error; NaN/inf is
a failure).

Bounds, ||out - ref|| / ||ref||: the reference backend computes in fp32 and rounds once to the
activation dtype (rms error of a round-to-nearest ~ u/sqrt(3): bf16 u = 2^-8 -> 2.3e-3,
fp16 u = 2^-11 -> 2.8e-4). Bounds leave ~3x: bf16 7e-3, fp16 1e-3. A routing or scale bug
(scaling factor applied twice, a gate/up merge that skips the block-scale rescale, a wrong
interleave) gives errors of order 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from ref64 import (
    e4m3_from_bits,
    fp8_weight64,
    mxfp4_weight64,
    nvfp4_weight64,
    random_codes,
    random_e4m3_scales,
    rel_err,
)

from quantdispatch.errors import CheckpointError, ConfigurationError, InputError
from quantdispatch.formats import Fp8Weight, Mxfp4Weight, Nvfp4Weight
from quantdispatch.layers import QuantMoE
from quantdispatch.moe import route

BOUND = {torch.bfloat16: 7e-3, torch.float16: 1e-3}
DTYPES = [torch.bfloat16, torch.float16]

# ---- float64 oracle ----------------------------------------------------------------------


def act64(h: torch.Tensor, activation: str, params: Sequence[float] = ()) -> torch.Tensor:
    """The MoE activations in float64, from their definitions (gated: h = [gate | up])."""
    if activation in ("relu2", "silu_nogate"):
        return torch.relu(h) ** 2 if activation == "relu2" else h / (1 + torch.exp(-h))
    i = h.shape[-1] // 2
    g, u = h[..., :i], h[..., i:]
    if activation == "silu":
        return g / (1 + torch.exp(-g)) * u
    if activation == "gelu":
        return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    assert activation == "swiglu_oai"
    alpha, limit = params or (1.702, 7.0)
    g = torch.clamp(g, max=limit)
    u = torch.clamp(u, -limit, limit)
    return g / (1 + torch.exp(-alpha * g)) * (u + 1)


def moe64(x, ids, weights, w13, w2, b13=None, b2=None, activation="silu", params=()):
    """out[t] = sum_j w[t, j] * (act(x[t] @ W13[e].T + b13[e]) @ W2[e].T + b2[e]), e = ids[t, j];
    ids outside [0, E) contribute nothing. w13 [E, N13, H] and w2 [E, H, I] are float64."""
    xs = x.to(torch.float64)
    out = torch.zeros(xs.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(xs.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e] @ xs[t]
            if b13 is not None:
                h = h + b13[e].double()
            y = w2[e] @ act64(h, activation, params)
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(weights[t, j]) * y
    return out


def route64(
    logits,
    top_k,
    *,
    scoring="softmax",
    renormalize=False,
    n_group=None,
    topk_group=None,
    bias=None,
    scale=1.0,
):
    """Routing in float64, token by token (DeepSeek-V3 group rule: sum of each group's top 2
    biased scores; weights are the unbiased scores)."""
    lg = logits.double()
    ids, ws = [], []
    for row in lg:
        s = torch.softmax(row, 0) if scoring == "softmax" else 1 / (1 + torch.exp(-row))
        choice = s + bias.double() if bias is not None else s.clone()
        if n_group:
            groups = choice.view(n_group, -1)
            gscore = groups.topk(2).values.sum(-1) if bias is not None else groups.max(-1).values
            keep = set(gscore.topk(topk_group).indices.tolist())
            per = groups.shape[1]
            for e in range(choice.numel()):
                if e // per not in keep:
                    choice[e] = -math.inf
        sel = choice.topk(top_k).indices
        w = s[sel]
        if renormalize:
            w = w / w.sum()
        ids.append(sel)
        ws.append(w * scale)
    return torch.stack(ids), torch.stack(ws)


# ---- random experts ------------------------------------------------------------------------


@dataclass
class Experts:
    """Per-expert quantized weights (the library's containers) and their float64 values."""

    fmt: str
    gate: list
    up: list
    down: list
    w13: torch.Tensor  # float64 [E, 2I, H] (gate rows, then up rows)
    w2: torch.Tensor  # float64 [E, H, I]


def _nvfp4(n, k, g, gs):
    return Nvfp4Weight(
        random_codes(n, k, g),
        random_e4m3_scales((n, k // 16), g),
        torch.tensor(gs, dtype=torch.float32),
    )


def _mxfp4(n, k, g):
    # exponents around 2^-6 keep e2m1 * scale * sqrt(K) of order one
    return Mxfp4Weight(
        random_codes(n, k, g), torch.randint(117, 124, (n, k // 32), generator=g, dtype=torch.uint8)
    )


def _fp8(n, k, g, kind, block=(32, 32)):
    sign = torch.randint(0, 2, (n, k), generator=g) * 0x80
    mag = torch.randint(0, 0x7F, (n, k), generator=g)  # 0x7F would be NaN
    w = (sign + mag).to(torch.uint8).view(torch.float8_e4m3fn)
    base = 1 / (60 * math.sqrt(k))
    if kind == "tensor":
        return Fp8Weight(w, torch.tensor(base * (0.5 + torch.rand((), generator=g).item())))
    if kind == "channel":
        return Fp8Weight(w, base * (0.5 + torch.rand(n, generator=g)))
    bn, bk = block
    s = base * (0.5 + torch.rand((-(-n // bn), -(-k // bk)), generator=g))
    return Fp8Weight(w, s, block_size=block)


def dense(w) -> torch.Tensor:
    if isinstance(w, Nvfp4Weight):
        return nvfp4_weight64(w.packed, w.block_scale, w.global_scale)
    if isinstance(w, Mxfp4Weight):
        return mxfp4_weight64(w.packed, w.block_scale)
    return fp8_weight64(w.weight, w.scale, w.block_size)


def make_experts(fmt, e, hidden, inter, seed, *, gated=True, fp8_kind="channel"):
    g = torch.Generator().manual_seed(seed)

    def one(n, k, i):
        # gate and up of an expert share a global scale here (their merge is then exact; the
        # merge of differing scales has its own test), experts differ from each other
        if fmt == "nvfp4":
            return _nvfp4(n, k, g, (1.0 + 0.37 * i) / (200 * math.sqrt(k)))
        if fmt == "mxfp4":
            return _mxfp4(n, k, g)
        return _fp8(n, k, g, fp8_kind)

    gate = [one(inter, hidden, i) for i in range(e)] if gated else []
    up = [one(inter, hidden, i) for i in range(e)]
    down = [one(hidden, inter, i + 3) for i in range(e)]
    if gated:
        w13 = torch.stack([torch.cat([dense(a), dense(b)]) for a, b in zip(gate, up, strict=True)])
    else:
        w13 = torch.stack([dense(b) for b in up])
    w2 = torch.stack([dense(d) for d in down])
    return Experts(fmt, gate, up, down, w13, w2)


def rand_x(m, h, dtype, seed):
    return torch.randn(m, h, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rand_logits(m, e, seed):
    return torch.randn(m, e, generator=torch.Generator().manual_seed(seed)) * 2


def layer_of(ex: Experts, **kw) -> QuantMoE:
    kw.setdefault("device", "cpu")
    return QuantMoE(ex.gate or None, ex.up, ex.down, **kw)


# ---- state dicts in the producers' conventions ----------------------------------------------


def modelopt_sd(prefix, w: Nvfp4Weight):
    return {
        f"{prefix}.weight": w.packed,
        f"{prefix}.weight_scale": w.block_scale,
        f"{prefix}.weight_scale_2": w.global_scale.clone(),
    }


def ct_sd(prefix, w: Nvfp4Weight):
    inv = (1.0 / w.global_scale.double()).float().reshape(1)
    return {
        f"{prefix}.weight_packed": w.packed,
        f"{prefix}.weight_scale": w.block_scale,
        f"{prefix}.weight_global_scale": inv,
    }


def fp8_sd(prefix, w: Fp8Weight):
    return {f"{prefix}.weight": w.weight, f"{prefix}.weight_scale": w.scale}


def expert_sd(ex: Experts, prefix, write, names=("gate_proj", "up_proj", "down_proj")):
    sd = {}
    for e in range(len(ex.down)):
        for name, ws in zip(names, (ex.gate, ex.up, ex.down), strict=True):
            sd.update(write(f"{prefix}.experts.{e}.{name}", ws[e]))
    return sd


# ---- numerics --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 37])
def test_nvfp4_layer_matches_float64(dtype, m):
    ex = make_experts("nvfp4", 6, 64, 32, seed=m)
    layer = layer_of(ex, top_k=2, renormalize=True, act_dtype=dtype)
    assert layer.backend == "reference"
    x = rand_x(m, 64, dtype, seed=1)
    logits = rand_logits(m, 6, seed=2)
    ids, w = route64(logits, 2, renormalize=True)
    out = layer(x, logits)
    assert out.dtype == dtype and out.shape == (m, 64)
    assert rel_err(out, moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[dtype]


def test_leading_dims_and_precomputed_routing_match_logits():
    ex = make_experts("nvfp4", 4, 64, 32, seed=3)
    layer = layer_of(ex, top_k=2)
    x = rand_x(6, 64, torch.bfloat16, seed=4)
    logits = rand_logits(6, 4, seed=5)
    ids, w = layer.route(logits)
    a = layer(x.view(2, 3, 64), logits)
    b = layer(x, topk_ids=ids.long(), topk_weights=w)
    assert a.shape == (2, 3, 64)
    assert torch.equal(a.view(6, 64), b)


def test_gate_up_scales_that_differ_are_merged_exactly():
    """gate global scale = 0.75 x up's: the merge must rescale gate's block scales by 0.75.
    Block scales 1.0 / 1.5 x 2^e stay exact under x0.75, so the layer is exact up to the
    output rounding; skipping the rescale would scale every gate output by 4/3."""
    g = torch.Generator().manual_seed(11)
    e, h, i = 3, 64, 32

    def scales(n, k):
        exp = torch.randint(-4, 4, (n, k // 16), generator=g).float()
        mant = 1 + 0.5 * torch.randint(0, 2, (n, k // 16), generator=g).float()
        return (mant * torch.pow(2.0, exp)).to(torch.float8_e4m3fn)

    def w(n, k, gs):
        return Nvfp4Weight(random_codes(n, k, g), scales(n, k), torch.tensor(gs))

    base = 2.0**-10
    gate = [w(i, h, 0.75 * base) for _ in range(e)]
    up = [w(i, h, base) for _ in range(e)]
    down = [w(h, i, base) for _ in range(e)]
    layer = QuantMoE(gate, up, down, top_k=2, act_dtype=torch.float16, device="cpu")
    assert torch.all(layer.w13_global_scale == base)
    w13 = torch.stack([torch.cat([dense(a), dense(b)]) for a, b in zip(gate, up, strict=True)])
    w2 = torch.stack([dense(d) for d in down])
    merged = e4m3_from_bits(layer.w13_block_scale.view(torch.uint8)[:, :i])
    assert torch.equal(
        merged, e4m3_from_bits(torch.stack([a.block_scale for a in gate]).view(torch.uint8)) * 0.75
    )
    x = rand_x(9, h, torch.float16, seed=3)
    logits = rand_logits(9, e, seed=4)
    ids, wts = route64(logits, 2)
    assert rel_err(layer(x, logits), moe64(x, ids, wts, w13, w2)) < BOUND[torch.float16]


def _roundtrips(gs: float) -> bool:
    inv = (1.0 / torch.tensor(gs, dtype=torch.float64)).float()
    return float((1.0 / inv.double()).float()) == gs


def test_modelopt_and_compressed_tensors_checkpoints_give_identical_outputs():
    """Same experts written as ModelOpt (weight_scale_2 = multiplier) and compressed-tensors
    (weight_global_scale = its reciprocal): identical outputs, equal to float64."""
    ex = make_experts("nvfp4", 4, 64, 32, seed=21)
    # global scales whose float32 reciprocal round-trips, so both files hold the same value
    for ws in (ex.gate, ex.up, ex.down):
        for j, w in enumerate(ws):
            gs = float(w.global_scale)
            while not _roundtrips(gs):
                gs = float(torch.tensor(gs * 1.0001, dtype=torch.float32))
            ws[j] = Nvfp4Weight(w.packed, w.block_scale, torch.tensor(gs))
    w13 = torch.stack(
        [torch.cat([dense(g), dense(u)]) for g, u in zip(ex.gate, ex.up, strict=True)]
    )
    w2 = torch.stack([dense(d) for d in ex.down])
    prefix = "model.layers.0.mlp"
    kw = dict(num_experts=4, top_k=2, device="cpu")
    a = QuantMoE.from_checkpoint(expert_sd(ex, prefix, modelopt_sd), prefix, **kw)
    b = QuantMoE.from_checkpoint(expert_sd(ex, prefix, ct_sd), prefix, **kw)
    x = rand_x(7, 64, torch.bfloat16, seed=5)
    logits = rand_logits(7, 4, seed=6)
    out_a, out_b = a(x, logits), b(x, logits)
    assert torch.equal(out_a, out_b)
    ids, w = route64(logits, 2)
    assert rel_err(out_a, moe64(x, ids, w, w13, w2)) < BOUND[torch.bfloat16]


def test_mixtral_names_and_fp8_experts():
    """Mixtral: experts.{e}.w1 (gate), w3 (up), w2 (down); FP8 per-tensor scales that differ
    between gate and up become exact per-channel scales."""
    ex = make_experts("fp8", 4, 64, 48, seed=8, fp8_kind="tensor")
    prefix = "model.layers.1.block_sparse_moe"
    sd = expert_sd(ex, prefix, fp8_sd, names=("w1", "w3", "w2"))
    layer = QuantMoE.from_checkpoint(
        sd, prefix, num_experts=4, top_k=2, renormalize=True, device="cpu"
    )
    assert layer.format == "fp8" and layer.w13_scale.shape == (4, 96)
    assert layer.w2_scale.shape == (4,)
    x = rand_x(5, 64, torch.bfloat16, seed=9)
    logits = rand_logits(5, 4, seed=10)
    ids, w = route64(logits, 2, renormalize=True)
    assert rel_err(layer(x, logits), moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8-block"])
def test_stacked_constructor_mxfp4_and_fp8_block(fmt):
    kind = "block" if fmt == "fp8-block" else "channel"
    name = fmt.split("-")[0]
    ex = make_experts(name, 3, 64, 64, seed=12, fp8_kind=kind)
    layer = layer_of(ex, top_k=3, act_dtype=torch.float16)
    stacked = QuantMoE(
        w13=[getattr(layer, n) for n in layer._names13],
        w2=[getattr(layer, n) for n in layer._names2],
        format=name,
        fp8_block_size=(32, 32) if kind == "block" else None,
        top_k=3,
        act_dtype=torch.float16,
        device="cpu",
    )
    x = rand_x(4, 64, torch.float16, seed=13)
    logits = rand_logits(4, 3, seed=14)
    ids, w = route64(logits, 3)  # top_k == number of experts
    ref = moe64(x, ids, w, ex.w13, ex.w2)
    assert rel_err(layer(x, logits), ref) < BOUND[torch.float16]
    assert torch.equal(layer(x, logits), stacked(x, logits))


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] as [gate; up] -> gpt-oss rows [gate0, up0, gate1, up1, ...]."""
    i = t.shape[1] // 2
    return torch.stack([t[:, :i], t[:, i:]], dim=2).flatten(1, 2)


def gpt_oss_sd(ex: Experts, prefix, b13, b2):
    e, h = len(ex.down), ex.w2.shape[1]
    gu_packed = torch.stack(
        [torch.cat([g.packed, u.packed]) for g, u in zip(ex.gate, ex.up, strict=True)]
    )
    gu_scales = torch.stack(
        [torch.cat([g.block_scale, u.block_scale]) for g, u in zip(ex.gate, ex.up, strict=True)]
    )
    d_packed = torch.stack([d.packed for d in ex.down])
    d_scales = torch.stack([d.block_scale for d in ex.down])
    base = f"{prefix}.experts"
    return {
        f"{base}.gate_up_proj_blocks": _interleave(gu_packed).reshape(
            e, gu_packed.shape[1], -1, 16
        ),
        f"{base}.gate_up_proj_scales": _interleave(gu_scales),
        f"{base}.gate_up_proj_bias": _interleave(b13).to(torch.bfloat16),
        f"{base}.down_proj_blocks": d_packed.reshape(e, h, -1, 16),
        f"{base}.down_proj_scales": d_scales,
        f"{base}.down_proj_bias": b2.to(torch.bfloat16),
    }


def test_gpt_oss_interleaved_experts_swiglu_and_biases():
    e, h, i = 4, 64, 64
    ex = make_experts("mxfp4", e, h, i, seed=15)
    g = torch.Generator().manual_seed(16)
    b13 = torch.randn(e, 2 * i, generator=g).to(torch.bfloat16).float()
    b2 = torch.randn(e, h, generator=g).to(torch.bfloat16).float()
    prefix = "model.layers.0.mlp"
    sd = gpt_oss_sd(ex, prefix, b13, b2)
    layer = QuantMoE.from_checkpoint(
        sd,
        prefix,
        {"quant_method": "mxfp4"},
        num_experts=e,
        top_k=2,
        activation="swiglu_oai",
        renormalize=True,
        activation_params=(1.5, 1.0),
        device="cpu",
    )
    # de-interleaved at load: gate rows then up rows, exactly the experts' own tensors
    want = torch.stack(
        [torch.cat([a.packed, b.packed]) for a, b in zip(ex.gate, ex.up, strict=True)]
    )
    assert torch.equal(layer.w13_packed, want)
    assert torch.equal(layer.w13_bias, b13)
    x = rand_x(8, h, torch.bfloat16, seed=17)
    logits = rand_logits(8, e, seed=18)
    ids, w = route64(logits, 2, renormalize=True)
    ref = moe64(x, ids, w, ex.w13, ex.w2, b13, b2, "swiglu_oai", (1.5, 1.0))
    assert rel_err(layer(x, logits), ref) < BOUND[torch.bfloat16]
    # the params reach the activation: with gpt-oss's defaults (limit 7) the output differs
    assert (
        rel_err(
            layer(x, logits), moe64(x, ids, w, ex.w13, ex.w2, b13, b2, "swiglu_oai", (1.702, 7.0))
        )
        > 10 * BOUND[torch.bfloat16]
    )


@pytest.mark.parametrize("activation", ["gelu", "relu2", "silu_nogate"])
def test_other_activations(activation):
    gated = activation == "gelu"
    ex = make_experts("nvfp4", 3, 64, 32, seed=19, gated=gated)
    layer = layer_of(ex, top_k=2, activation=activation, act_dtype=torch.float16)
    assert layer.activation == activation
    x = rand_x(5, 64, torch.float16, seed=20)
    logits = rand_logits(5, 3, seed=21)
    ids, w = route64(logits, 2)
    ref = moe64(x, ids, w, ex.w13, ex.w2, activation=activation)
    assert rel_err(layer(x, logits), ref) < BOUND[torch.float16]


# ---- routing -------------------------------------------------------------------------------


def test_softmax_routing_matches_float64():
    logits = rand_logits(20, 16, seed=22)
    ids, w = route(logits, 4, renormalize=True)
    rids, rw = route64(logits, 4, renormalize=True)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), rids)
    assert torch.allclose(w.double(), rw, rtol=1e-6, atol=0)


def test_deepseek_grouped_sigmoid_routing_with_correction_bias():
    g = torch.Generator().manual_seed(23)
    logits = torch.randn(30, 32, generator=g)
    bias = torch.randn(32, generator=g) * 0.5
    kw = dict(scoring="sigmoid", renormalize=True, n_group=8, topk_group=3)
    ids, w = route(logits, 6, e_score_correction_bias=bias, routed_scaling_factor=2.5, **kw)
    rids, rw = route64(logits, 6, bias=bias, scale=2.5, **kw)
    assert torch.equal(ids.long(), rids)
    assert torch.allclose(w.double(), rw, rtol=1e-6, atol=0)
    # the bias steers the choice only: weights are unbiased sigmoid scores, renormalized
    s = torch.sigmoid(logits.double()).gather(1, rids)
    assert torch.allclose(rw, 2.5 * s / s.sum(-1, keepdim=True))
    # only experts of 3 groups (of 4 experts each) are chosen per token
    assert all(len(set((row // 4).tolist())) <= 3 for row in ids)


def test_routed_scaling_factor_is_applied_exactly_once():
    ex = make_experts("nvfp4", 8, 64, 32, seed=24)
    kw = dict(
        scoring="sigmoid", renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    layer = layer_of(ex, top_k=3, **kw)
    x = rand_x(6, 64, torch.bfloat16, seed=25)
    logits = rand_logits(6, 8, seed=26)
    ids, w = route64(
        logits, 3, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2, scale=2.5
    )
    out = layer(x, logits)
    once = moe64(x, ids, w, ex.w13, ex.w2)
    assert rel_err(out, once) < BOUND[torch.bfloat16]
    assert rel_err(out, 2.5 * once) > 0.5  # applied twice would be 2.5x off
    # precomputed weights are final: passed through unscaled
    gids, gw = layer.route(logits)
    assert torch.equal(layer(x, topk_ids=gids, topk_weights=gw), out)


# ---- expert parallelism -------------------------------------------------------------------


def test_expert_parallel_shards_sum_to_the_full_layer():
    ex = make_experts("nvfp4", 8, 64, 32, seed=27)
    prefix = "model.layers.2.mlp"
    sd = expert_sd(ex, prefix, modelopt_sd)
    kw = dict(num_experts=8, top_k=3, act_dtype=torch.float16, device="cpu")
    full = QuantMoE.from_checkpoint(sd, prefix, **kw)
    ranks = [[0, 3, 5], [1, 2], [4, 6, 7]]
    shards = [QuantMoE.from_checkpoint(sd, prefix, expert_ids=r, **kw) for r in ranks]
    assert [s.num_local_experts for s in shards] == [3, 2, 3]
    x = rand_x(11, 64, torch.float16, seed=28)
    logits = rand_logits(11, 8, seed=29)
    ids, w = route64(logits, 3)
    ref = moe64(x, ids, w, ex.w13, ex.w2)
    total = sum(s(x, logits).double() for s in shards)
    assert rel_err(full(x, logits), ref) < BOUND[torch.float16]
    assert rel_err(total, ref) < 3 * BOUND[torch.float16]  # three roundings instead of one
    # each shard is exactly its experts' part of the sum
    for s, r in zip(shards, ranks, strict=True):
        mask = torch.isin(ids, torch.tensor(r))
        part = moe64(x, ids, w * mask, ex.w13, ex.w2)
        assert rel_err(s(x, logits), part) < BOUND[torch.float16]


def test_tokens_routed_elsewhere_contribute_exactly_zero():
    ex = make_experts("nvfp4", 4, 64, 32, seed=30)
    shard = QuantMoE(
        ex.gate[:2], ex.up[:2], ex.down[:2], top_k=2, num_experts=4, expert_ids=[0, 1], device="cpu"
    )
    x = rand_x(3, 64, torch.bfloat16, seed=31)
    ids = torch.tensor([[2, 3], [3, 2], [2, 3]])
    out = shard(x, topk_ids=ids, topk_weights=torch.rand(3, 2))
    assert torch.equal(out, torch.zeros_like(out))


# ---- module plumbing -------------------------------------------------------------------------


def test_state_dict_round_trip_and_bytes():
    ex = make_experts("nvfp4", 4, 64, 32, seed=32)
    other = make_experts("nvfp4", 4, 64, 32, seed=33)
    a, b = layer_of(ex, top_k=2), layer_of(other, top_k=2)
    x = rand_x(5, 64, torch.bfloat16, seed=34)
    logits = rand_logits(5, 4, seed=35)
    assert not torch.equal(a(x, logits), b(x, logits))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x, logits), b(x, logits))
    # packed bytes only: 2I*H/2 + 2I*H/16 + H*I/2 + H*I/16 bytes + 2 scales per expert
    per_expert = 64 * 64 // 2 + 64 * 64 // 16 + 64 * 32 // 2 + 64 * 32 // 16 + 8
    assert a.device_bytes() == 4 * per_expert
    text = repr(a)
    assert "experts=4" in text and "format=nvfp4" in text and "backend=reference" in text


def test_preset_device_is_refused():
    ex = make_experts("nvfp4", 2, 64, 32, seed=36)
    with pytest.raises(Exception, match="simulated device"):
        layer_of(ex, top_k=1, device="h100")


# ---- bad input ---------------------------------------------------------------------------------


def test_expert_count_mismatch():
    ex = make_experts("nvfp4", 3, 64, 32, seed=37)
    with pytest.raises(CheckpointError, match="expert counts differ"):
        QuantMoE(ex.gate, ex.up, ex.down[:2], top_k=1, device="cpu")
    with pytest.raises(CheckpointError, match="holds 3 experts but num_experts=5"):
        layer_of(ex, top_k=1, num_experts=5)
    with pytest.raises(CheckpointError, match="expert_ids lists 2 experts"):
        layer_of(ex, top_k=1, num_experts=5, expert_ids=[0, 1])
    lay = layer_of(ex, top_k=1)
    with pytest.raises(CheckpointError, match="w13 holds 3 experts but w2 holds 2"):
        QuantMoE(
            w13=[getattr(lay, n) for n in lay._names13],
            w2=[getattr(lay, n)[:2] for n in lay._names2],
            format="nvfp4",
            top_k=1,
            device="cpu",
        )


def test_shape_mismatch():
    ex = make_experts("nvfp4", 2, 64, 32, seed=38)
    wrong = make_experts("nvfp4", 2, 64, 48, seed=39)
    with pytest.raises(CheckpointError, match="w2 is"):
        QuantMoE(ex.gate, ex.up, wrong.down, top_k=1, device="cpu")
    with pytest.raises(CheckpointError, match="gate has shape"):
        QuantMoE(ex.gate, wrong.up, ex.down, top_k=1, device="cpu")
    layer = layer_of(ex, top_k=1)
    with pytest.raises(InputError, match="hidden_size = 64"):
        layer(rand_x(2, 32, torch.bfloat16, 0), rand_logits(2, 2, 0))
    with pytest.raises(InputError, match="num_experts=2"):
        layer(rand_x(2, 64, torch.bfloat16, 0), rand_logits(2, 3, 0))
    with pytest.raises(InputError, match=r"built for torch\.bfloat16"):
        layer(rand_x(2, 64, torch.float16, 0), rand_logits(2, 2, 0))


def test_fp32_input_error_names_a_cast_that_works():
    ex = make_experts("nvfp4", 2, 64, 32, seed=41)
    layer = layer_of(ex, top_k=1)
    x, logits = rand_x(2, 64, torch.float32, 0), rand_logits(2, 2, 0)
    with pytest.raises(InputError, match=r"cast the input with \.to\(torch\.bfloat16\)") as err:
        layer(x, logits)
    assert "act_dtype=torch.float32" not in str(err.value)
    assert layer(x.to(layer.act_dtype), logits).shape == (2, 64)


def test_top_k_larger_than_experts():
    ex = make_experts("nvfp4", 2, 64, 32, seed=40)
    with pytest.raises(ConfigurationError, match="top_k=3 with 2 experts"):
        layer_of(ex, top_k=3)
    with pytest.raises(ConfigurationError, match="top_k=5 with 4 experts"):
        route(rand_logits(2, 4, 0), 5)
    with pytest.raises(ConfigurationError, match="n_group divides"):
        route(rand_logits(2, 6, 0), 2, n_group=4, topk_group=2)


def test_ids_out_of_range():
    ex = make_experts("nvfp4", 4, 64, 32, seed=41)
    layer = layer_of(ex, top_k=2)
    x = rand_x(2, 64, torch.bfloat16, 0)
    for bad in ([[0, 4], [1, 2]], [[-1, 0], [1, 2]]):
        with pytest.raises(InputError, match=r"topk_ids has values in \[.*num_experts=4"):
            layer(x, topk_ids=torch.tensor(bad), topk_weights=torch.rand(2, 2))
    with pytest.raises(ConfigurationError, match="out-of-range"):
        layer_of(
            make_experts("nvfp4", 2, 64, 32, seed=42), top_k=1, num_experts=4, expert_ids=[1, 4]
        )


def test_missing_expert_tensors():
    ex = make_experts("nvfp4", 3, 64, 32, seed=43)
    prefix = "model.layers.0.mlp"
    sd = expert_sd(ex, prefix, modelopt_sd)
    partial = {k: v for k, v in sd.items() if not k.startswith(f"{prefix}.experts.1.up_proj")}
    with pytest.raises(
        CheckpointError,
        match=r"missing expert tensors: nothing under "
        r"'model.layers.0.mlp.experts.1.up_proj\.'",
    ):
        QuantMoE.from_checkpoint(partial, prefix, num_experts=3, top_k=1, device="cpu")
    with pytest.raises(CheckpointError, match="missing expert tensors"):
        QuantMoE.from_checkpoint(sd, "model.layers.9.mlp", num_experts=3, top_k=1, device="cpu")
    with pytest.raises(CheckpointError, match="missing expert tensors"):
        QuantMoE.from_checkpoint(sd, prefix, num_experts=4, top_k=1, device="cpu")
    oss = gpt_oss_sd(
        make_experts("mxfp4", 2, 64, 64, seed=44), prefix, torch.zeros(2, 128), torch.zeros(2, 64)
    )
    del oss[f"{prefix}.experts.down_proj_scales"]
    with pytest.raises(CheckpointError, match="down_proj_scales"):
        QuantMoE.from_checkpoint(oss, prefix, num_experts=2, top_k=1, device="cpu")


# ---- graph capture friendliness (CPU) -------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager():
    """Routing + the custom op trace as one graph (the op's fake gives the shape)."""
    torch._dynamo.reset()
    ex = make_experts("nvfp4", 6, 64, 32, seed=45)
    layer = layer_of(
        ex,
        top_k=2,
        scoring="sigmoid",
        renormalize=True,
        n_group=3,
        topk_group=2,
        routed_scaling_factor=1.5,
        e_score_correction_bias=torch.randn(6) * 0.1,
    )
    x = rand_x(9, 64, torch.bfloat16, seed=46)
    logits = rand_logits(9, 6, seed=47)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, logits), layer(x, logits))
    ids, w = layer.route(logits)
    assert torch.equal(compiled(x, topk_ids=ids, topk_weights=w), layer(x, logits))


def test_eager_calls_skip_the_op_dispatch_and_give_its_result():
    """As QuantLinear: an eager inference call runs the backend directly, the same bits as the
    op; with autograd recording the op runs."""
    ex = make_experts("nvfp4", 4, 64, 32, seed=51)
    layer = layer_of(ex, top_k=2)
    x = rand_x(5, 64, torch.bfloat16, seed=52)
    logits = rand_logits(5, 4, seed=53)

    def op_calls(fn):
        with torch.autograd.profiler.profile() as prof:
            fn()
        return sum(e.count for e in prof.key_averages() if e.key == "quantdispatch::moe")

    with torch.no_grad():
        assert op_calls(lambda: layer(x, logits)) == 0
        direct = layer(x, logits)
    ids, w = layer.route(logits)
    via_op = torch.ops.quantdispatch.moe(
        x, ids, w, layer._w13(), layer._w2(), None, None, "reference", "nvfp4", "silu", [],
        layer._meta_args,
    )  # fmt: skip
    assert torch.equal(direct, via_op)
    assert op_calls(lambda: layer(x.clone().requires_grad_(True), logits)) == 1


def test_moe_custom_op_passes_opcheck():
    """Fake implementation and autograd/AOT registration (test_schema is left out: its
    mutation check compares inputs with allclose, which torch has no float8 kernel for)."""
    ex = make_experts("nvfp4", 3, 64, 32, seed=48)
    layer = layer_of(ex, top_k=2)
    x = rand_x(4, 64, torch.bfloat16, seed=49)
    ids, w = layer.route(rand_logits(4, 3, seed=50))
    args = (
        x,
        ids,
        w,
        layer._w13(),
        layer._w2(),
        None,
        None,
        "reference",
        "nvfp4",
        "silu",
        [],
        layer._meta_args,
    )
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.quantdispatch.moe.default, args, test_utils=tests)


def test_quant_config_that_excludes_an_expert_is_an_error():
    ex = make_experts("nvfp4", 2, 64, 32, seed=51)
    prefix = "model.layers.0.mlp"
    sd = expert_sd(ex, prefix, modelopt_sd)
    cfg = {"quantization": {"quant_algo": "W4A16_NVFP4", "exclude_modules": ["*experts.1.down*"]}}
    with pytest.raises(CheckpointError, match=r"experts\.1\.down_proj' is not quantized"):
        QuantMoE.from_checkpoint(sd, prefix, cfg, num_experts=2, top_k=1, device="cpu")
    ok = {"quantization": {"quant_algo": "W4A16_NVFP4"}}
    layer = QuantMoE.from_checkpoint(sd, prefix, ok, num_experts=2, top_k=1, device="cpu")
    assert layer.decision.request.scheme_label == "W4A16"


def test_model_dtype_casts_leave_the_experts_alone():
    """model.to(torch.bfloat16) on a model holding a QuantMoE: the e4m3 block scales, fp32
    global scales and fp32 expert biases keep their dtypes; the output is bit-identical."""
    e, h, i = 4, 64, 64
    ex = make_experts("nvfp4", e, h, i, seed=21)
    g = torch.Generator().manual_seed(22)
    w13_bias, w2_bias = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    layer = layer_of(ex, top_k=2, w13_bias=w13_bias, w2_bias=w2_bias)
    x, logits = rand_x(5, h, torch.bfloat16, seed=23), rand_logits(5, e, seed=24)
    before = layer(x, logits)
    dtypes = {n: b.dtype for n, b in layer.named_buffers()}
    assert dtypes["w13_block_scale"] == torch.float8_e4m3fn and dtypes["w2_bias"] == torch.float32
    torch.nn.Sequential(layer).to(torch.bfloat16)
    assert {n: b.dtype for n, b in layer.named_buffers()} == dtypes
    assert torch.equal(layer(x, logits), before)

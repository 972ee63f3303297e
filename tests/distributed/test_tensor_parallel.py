"""Tensor- and expert-parallel shards read from safetensors, one process: every rank's shard is
the matching slice of the whole layer (bit for bit), only its slice is read, the ranks' outputs
concatenate / sum to the whole layer, and bad specs are clear errors. The same shards across
processes (torch.distributed, gloo): test_tensor_parallel_dist.py."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file
from tp_checkpoints import (
    BLOCK,
    CONFIGS,
    LINEAR_KINDS,
    assert_clear_errors,
    canonical_tensors,
    experts,
    gpt_oss_experts,
    linear_layer,
    stack64,
    weight64,
)

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.checkpoints import (
    SafetensorsStateDict,
    column_ranges,
    linear_shard_shapes,
    moe_intermediate_range,
    moe_shard_sizes,
    parse_quant_config,
    read_linear,
    read_linear_shard,
    read_moe_shard,
    split_range,
)
from quantdispatch.errors import CheckpointError, ConfigurationError, WeightFormatError
from quantdispatch.formats import Fp8Weight, Nvfp4Weight

P = "model.layers.0.mlp.proj"
X = torch.randn(3, 448, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _lazy(sd, tmp_path, name="model.safetensors") -> SafetensorsStateDict:
    save_file(sd, str(tmp_path / name))
    return SafetensorsStateDict(tmp_path / name)


def _quant(kind, prefix):
    cfg = CONFIGS.get(kind)
    return parse_quant_config(cfg).layer(prefix) if cfg else None


def _nbytes(loaded) -> int:
    w = loaded.weight
    ts = [*w.tensors().values(), loaded.bias]
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_linear_shards_are_slices_of_the_whole_layer(kind, world, tmp_path):
    n, k = 162, 448  # uneven rows; FP8 blocks of 32 x 64: a short last row block
    sd = linear_layer(kind, P, n, k, torch.Generator().manual_seed(world))
    lazy, quant = _lazy(sd, tmp_path), _quant(kind, P)
    full = read_linear(sd, P, quant)
    w64, unit_n = weight64(full.weight), BLOCK[0] if kind == "fp8-block" else 1
    unit_k = {"fp8-block": BLOCK[1], "fp8-tensor": 1, "fp8-channel": 1}.get(kind, 16)
    unit_k = 32 if kind in ("ct-mxfp4", "gpt-oss") else unit_k
    full_y = QuantLinear.from_loaded(full, device="cpu")(X).double()
    cols, y_row = [], torch.zeros_like(full_y)
    for r in range(world):
        before = lazy.bytes_read
        col = read_linear_shard(lazy, P, quant, tp_rank=r, tp_size=world, parallel="column")
        assert lazy.bytes_read - before <= _nbytes(col) + 16  # its slice (+ weight_shape)
        ((a, b),) = column_ranges([n], r, world, unit=unit_n)
        assert torch.equal(weight64(col.weight), w64[a:b]) and torch.equal(col.bias, full.bias[a:b])
        assert col.scheme == full.scheme and type(col.weight) is type(full.weight)
        cols.append(QuantLinear.from_loaded(col, device="cpu")(X).double())

        before = lazy.bytes_read
        row = read_linear_shard(lazy, P, quant, tp_rank=r, tp_size=world, parallel="row")
        assert lazy.bytes_read - before <= _nbytes(row) + 16
        a, b = split_range(k, r, world, unit_k, partial_last=True)
        assert torch.equal(weight64(row.weight), w64[:, a:b])
        assert (row.bias is None) == (r != 0 or full.bias is None)
        y_row += QuantLinear.from_loaded(row, device="cpu")(X[:, a:b].contiguous()).double()
        if isinstance(full.weight, Nvfp4Weight):  # per-tensor scales stay whole
            assert float(row.weight.global_scale) == float(full.weight.global_scale)
    assert torch.equal(torch.cat(cols, dim=1), full_y)  # the gathered columns, bit for bit
    # partial sums rounded to bf16 per rank: within that rounding of the whole layer
    assert float((y_row - full_y).norm() / full_y.norm()) < 2**-7


def test_only_the_slice_is_read(tmp_path):
    n, k = 1024, 2048
    sd = linear_layer("modelopt-nvfp4", P, n, k, torch.Generator().manual_seed(0))
    lazy = _lazy(sd, tmp_path)
    file_bytes = (tmp_path / "model.safetensors").stat().st_size
    for parallel in ("column", "row"):
        for r in range(4):
            before = lazy.bytes_read
            read_linear_shard(lazy, P, tp_rank=r, tp_size=4, parallel=parallel)
            got = lazy.bytes_read - before
            # codes + block scales of a quarter, the bias share, three scalars
            share = n * k // 2 // 4 + n * k // 16 // 4
            bias = 2 * n // 4 if parallel == "column" else (2 * n if r == 0 else 0)
            assert got == share + bias + 8, (parallel, r, got)
            assert got < file_bytes / 3.9
    # a copy for another process opens its own file handles
    copy = pickle.loads(pickle.dumps(lazy))
    assert torch.equal(copy[f"{P}.weight_scale_2"], sd[f"{P}.weight_scale_2"])


def _qkv(kind, hq, hkv, d, hidden, g, *, bias=True):
    sd = {}
    for i, (name, heads) in enumerate((("q_proj", hq), ("k_proj", hkv), ("v_proj", hkv))):
        sd |= linear_layer(kind, f"a.{name}", heads * d, hidden, g, gs=0.01 * 0.3**i, bias=bias)
    return sd, [f"a.{n}" for n in ("q_proj", "k_proj", "v_proj")]


@pytest.mark.parametrize("kind", ["modelopt-nvfp4", "fp8-block", "ct-mxfp4"])
def test_fused_qkv_grouped_query_heads(kind, tmp_path):
    hq, hkv, d, hidden = 32, 8, 64, 256
    sd, prefixes = _qkv(kind, hq, hkv, d, hidden, torch.Generator().manual_seed(2))
    lazy, quant = _lazy(sd, tmp_path), _quant(kind, "a.q_proj")
    # the whole fused layer (global scales 0.3x apart: its merge re-rounds block scales)
    whole = read_linear_shard(sd, prefixes, quant, tp_rank=0, tp_size=1)
    w64 = weight64(whole.weight)
    for tp in (2, 4, 8, 16):  # 16 > 8 kv heads: each kv head serves two ranks
        seen_kv = []
        for r in range(tp):
            s = read_linear_shard(lazy, prefixes, quant, tp_rank=r, tp_size=tp, heads=(hq, hkv))
            q = range(r * hq // tp * d, (r + 1) * hq // tp * d)
            kv_head = r * hkv // tp
            kv_heads = range(kv_head, kv_head + max(1, hkv // tp))
            kv = [hq * d + h * d + j for h in kv_heads for j in range(d)]
            rows = torch.tensor([*q, *kv, *[i + hkv * d for i in kv]])
            assert torch.equal(weight64(s.weight), w64[rows]), (tp, r)
            assert torch.equal(s.bias, whole.bias[rows])
            # the merged shard's tensors are the whole merged layer's rows, bit for bit
            if not isinstance(whole.weight, Fp8Weight) or whole.weight.scale_kind != "block":
                pairs = zip(
                    canonical_tensors(s.weight), canonical_tensors(whole.weight), strict=True
                )
                for mine, ref in pairs:
                    assert torch.equal(mine, ref if ref.dim() == 0 else ref[rows])
            seen_kv.append(tuple(kv_heads))
        step = max(1, hkv // tp)
        assert sorted(set(seen_kv)) == [tuple(range(h, h + step)) for h in range(0, hkv, step)]


def test_single_tensor_fused_qkv_and_gate_up_segments(tmp_path):
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, hidden = 8, 2, 32, 128
    n = (hq + 2 * hkv) * d
    sd = linear_layer("modelopt-nvfp4", "a.qkv_proj", n, hidden, g)
    sd |= linear_layer("ct-nvfp4", "a.gate_up_proj", 2 * 96, hidden, g)
    lazy = _lazy(sd, tmp_path)
    qkv = weight64(read_linear(sd, "a.qkv_proj").weight)
    gu = weight64(read_linear(sd, "a.gate_up_proj").weight)
    for r in range(2):
        s = read_linear_shard(
            lazy,
            "a.qkv_proj",
            tp_rank=r,
            tp_size=2,
            heads=(hq, hkv),
            segments=[hq * d] + [hkv * d] * 2,
        )
        q, kv = slice(r * 4 * d, (r + 1) * 4 * d), [hq * d + r * d + j for j in range(d)]
        rows = torch.tensor([*range(n)[q], *kv, *[i + hkv * d for i in kv]])
        assert torch.equal(weight64(s.weight), qkv[rows])
        s = read_linear_shard(lazy, "a.gate_up_proj", tp_rank=r, tp_size=2, segments=[96, 96])
        rows = torch.tensor([*range(48 * r, 48 * r + 48), *range(96 + 48 * r, 96 + 48 * r + 48)])
        assert torch.equal(weight64(s.weight), gu[rows])


@pytest.mark.parametrize(("world", "align"), [(2, 16), (4, 16), (2, 64)])
def test_gate_up_and_down_pair_with_align(world, align, tmp_path):
    """I = 144 (9 NVFP4 groups) does not split evenly: with one align on gate/up and down, each
    rank's gate/up rows are exactly its down columns, and the MLP summed over ranks is the
    whole MLP."""
    g = torch.Generator().manual_seed(4)
    inter, hidden = 144, 128
    sd = linear_layer("modelopt-nvfp4", "m.gate_proj", inter, hidden, g, gs=0.01)
    sd |= linear_layer("modelopt-nvfp4", "m.up_proj", inter, hidden, g, gs=0.03)
    sd |= linear_layer("modelopt-nvfp4", "m.down_proj", hidden, inter, g)
    lazy, x = _lazy(sd, tmp_path), X[:, :hidden].contiguous()

    def mlp(gate_up, down, x):
        h = gate_up(x).float()
        i = h.shape[-1] // 2
        return down((torch.nn.functional.silu(h[:, :i]) * h[:, i:]).to(torch.bfloat16)).double()

    full = mlp(
        QuantLinear.from_checkpoint(sd, ["m.gate_proj", "m.up_proj"], device="cpu"),
        QuantLinear.from_checkpoint(sd, "m.down_proj", device="cpu"),
        x,
    )
    total = torch.zeros_like(full)
    for r in range(world):
        gu = read_linear_shard(
            lazy, ["m.gate_proj", "m.up_proj"], tp_rank=r, tp_size=world, align=align
        )
        down = read_linear_shard(
            lazy, "m.down_proj", tp_rank=r, tp_size=world, parallel="row", align=align
        )
        assert gu.weight.shape[0] == 2 * down.weight.shape[1]  # paired
        layers = [QuantLinear.from_loaded(w, device="cpu") for w in (gu, down)]
        total += mlp(*layers, x)
    assert float((total - full).norm() / full.norm()) < 2**-7
    # without align the halves split by rows (72 / 72) but down by groups (80 / 64): refused
    # pairing is the caller's job, so show the mismatch the docstring warns about
    gu0 = read_linear_shard(lazy, ["m.gate_proj", "m.up_proj"], tp_rank=0, tp_size=2)
    down0 = read_linear_shard(lazy, "m.down_proj", tp_rank=0, tp_size=2, parallel="row")
    assert gu0.weight.shape[0] // 2 != down0.weight.shape[1]


# -- MoE ------------------------------------------------------------------------------------------


def _moe(shard, **kw):
    return QuantMoE.from_shard(shard, device="cpu", **kw)


@pytest.mark.parametrize(
    "kind", ["modelopt-nvfp4", "ct-nvfp4", "ct-mxfp4", "fp8-tensor", "fp8-channel", "fp8-block"]
)
def test_moe_tensor_and_expert_parallel_shards(kind, tmp_path):
    e, hidden, inter, top_k = 4, 64, 320, 2  # I: 20 NVFP4 / 10 MXFP4 groups, 5 FP8 blocks
    naming = ("w1", "w3", "w2") if kind == "ct-nvfp4" else None  # Mixtral names too
    sd = experts(kind, "L.mlp", e, hidden, inter, torch.Generator().manual_seed(5), naming=naming)
    cfg = parse_quant_config(CONFIGS[kind]) if kind in CONFIGS else None
    lazy = _lazy(sd, tmp_path)
    x = X[:, :hidden].contiguous()
    logits = torch.randn(3, e, generator=torch.Generator().manual_seed(6))
    full = read_moe_shard(lazy, "L.mlp", cfg, num_experts=e)
    # the whole layer read here is the layer QuantMoE.from_checkpoint builds
    ref_layer = QuantMoE.from_checkpoint(sd, "L.mlp", cfg, num_experts=e, top_k=top_k, device="cpu")
    y_full = _moe(full, top_k=top_k, num_experts=e)(x, logits)
    assert torch.equal(y_full, ref_layer(x, logits))
    w13, w2 = stack64(full, "w13"), stack64(full, "w2")
    for tp, ep in ((3, 1), (4, 1), (2, 2)):
        total = torch.zeros(3, hidden, dtype=torch.float64)
        for ep_rank in range(ep):
            ids = list(range(ep_rank, e, ep))  # strided: not contiguous
            for r in range(tp):
                s = read_moe_shard(
                    lazy, "L.mlp", cfg, num_experts=e, expert_ids=ids, tp_rank=r, tp_size=tp
                )
                a, b = s.intermediate
                unit = {"nvfp4": 16, "mxfp4": 32}.get(s.format, 64 if kind == "fp8-block" else 1)
                block = BLOCK if kind == "fp8-block" else None
                assert (a, b) == moe_intermediate_range(inter, s.format, r, tp, fp8_block=block)
                assert a % unit == 0 and s.expert_ids == tuple(ids)
                rows = torch.tensor([*range(a, b), *range(inter + a, inter + b)])
                assert torch.equal(stack64(s, "w13"), w13[ids][:, rows]), (tp, ep, r)
                assert torch.equal(stack64(s, "w2"), w2[ids][:, :, a:b])
                total += _moe(s, top_k=top_k, num_experts=e)(x, logits).double()
        err = float((total - y_full.double()).norm() / y_full.double().norm())
        assert err < 2**-7, (tp, ep, err)


def test_non_gated_experts_split_up_and_down(tmp_path):
    e, hidden, inter = 3, 64, 96
    sd = experts("ct-mxfp4", "L.mlp", e, hidden, inter, torch.Generator().manual_seed(12))
    lazy = _lazy(sd, tmp_path)
    kw = dict(top_k=2, num_experts=e, activation="relu2")
    x = X[:, :hidden].contiguous()
    logits = torch.randn(3, e, generator=torch.Generator().manual_seed(13))
    y_full = QuantMoE.from_checkpoint(sd, "L.mlp", device="cpu", **kw)(x, logits).double()
    total = torch.zeros_like(y_full)
    for r in range(3):  # I = 3 groups of 32
        s = read_moe_shard(lazy, "L.mlp", num_experts=e, gated=False, tp_rank=r, tp_size=3)
        assert s.w13[0].shape[1] == 32 and s.w2[0].shape[2] * 2 == 32
        total += _moe(s, **kw)(x, logits).double()
    assert float((total - y_full).norm() / y_full.norm()) < 2**-7


@pytest.mark.parametrize(("tp", "align"), [(1, 1), (2, 1), (4, 1), (2, 64)])
def test_gpt_oss_fused_experts_shards(tp, align, tmp_path):
    """I = 160: 5 groups of 32, uneven over 2 and 4 ranks; aligned to 64: 128 + 32."""
    e, hidden, inter = 5, 64, 160  # I = 5 groups of 32: uneven over 2 and 4 ranks
    sd = gpt_oss_experts("L.mlp", e, hidden, inter, torch.Generator().manual_seed(7))
    lazy = _lazy(sd, tmp_path)
    cfg = parse_quant_config({"quant_method": "mxfp4"})
    full = read_moe_shard(sd, "L.mlp", cfg, num_experts=e)
    kw = dict(top_k=2, num_experts=e, activation="swiglu_oai")
    x = X[:, :hidden].contiguous()
    logits = torch.randn(3, e, generator=torch.Generator().manual_seed(8))
    y_full = _moe(full, **kw)(x, logits)
    ref_layer = QuantMoE.from_checkpoint(sd, "L.mlp", cfg, device="cpu", **kw)
    assert torch.equal(y_full, ref_layer(x, logits))
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    w13, w2 = stack64(full, "w13"), stack64(full, "w2")
    total = torch.zeros(3, hidden, dtype=torch.float64)
    for ids in ([4, 0, 1], [2, 3]):  # expert parallel: two ranks, runs 4 | 0-1 and 2-3
        for r in range(tp):
            before = lazy.bytes_read
            s = read_moe_shard(
                lazy,
                "L.mlp",
                cfg,
                num_experts=e,
                expert_ids=ids,
                tp_rank=r,
                tp_size=tp,
                align=align,
            )
            a, b = s.intermediate
            assert a % align == 0 and (b % align == 0 or b == inter)
            # this rank's experts and I slice (plus the whole down bias on rank 0)
            share = len(ids) / e * (b - a) / inter
            assert lazy.bytes_read - before <= nbytes * share + (r == 0) * 2 * hidden * len(ids)
            rows = torch.tensor([*range(a, b), *range(inter + a, inter + b)])
            assert torch.equal(stack64(s, "w13"), w13[ids][:, rows])
            assert torch.equal(stack64(s, "w2"), w2[ids][:, :, a:b])
            assert torch.equal(s.w13_bias, full.w13_bias[ids][:, rows])
            assert (s.w2_bias is None) == (r != 0)
            total += _moe(s, **kw)(x, logits).double()
    assert float((total - y_full.double()).norm() / y_full.double().norm()) < 2**-7


# -- shapes for doctor, and bad specs -------------------------------------------------------------


def test_shard_shapes_of_real_models():
    qkv = linear_shard_shapes(
        10240,
        8192,
        "nvfp4",
        tp_size=8,
        parallel="column",
        heads=(64, 8),
        segments=(8192, 1024, 1024),
    )
    assert qkv == [(1280, 8192)] * 8
    assert linear_shard_shapes(8192, 8192, "nvfp4", tp_size=4, parallel="row") == [(8192, 2048)] * 4
    gate_up = linear_shard_shapes(
        57344, 8192, "nvfp4", tp_size=8, parallel="column", segments=(28672, 28672)
    )
    assert gate_up == [(7168, 8192)] * 8
    assert (
        linear_shard_shapes(8192, 28672, "nvfp4", tp_size=8, parallel="row") == [(8192, 3584)] * 8
    )
    assert moe_shard_sizes(2880, "mxfp4", 4) == [736, 736, 704, 704]  # gpt-oss: 90 groups of 32
    assert moe_shard_sizes(2880, "mxfp4", 2) == [1440, 1440]
    # align=64: every rank's I on the repacked MoE kernels (I % 64 == 0)
    assert moe_shard_sizes(2880, "mxfp4", 4, align=64) == [768, 704, 704, 704]
    assert moe_shard_sizes(2880, "nvfp4", 4) == [720] * 4
    assert moe_shard_sizes(2048, "fp8", 8, fp8_block=(128, 128)) == [256] * 8
    assert linear_shard_shapes(162, 448, "fp8", tp_size=4, parallel="column", fp8_block=BLOCK) == [
        (64, 448),
        (64, 448),
        (32, 448),
        (2, 448),
    ]


def test_bad_specs_are_clear_errors():
    sd = linear_layer("modelopt-nvfp4", P, 64, 32, torch.Generator().manual_seed(9))
    qkv, prefixes = _qkv("modelopt-nvfp4", 12, 4, 16, 64, torch.Generator().manual_seed(10))
    moe = experts("modelopt-nvfp4", "L.mlp", 2, 64, 32, torch.Generator().manual_seed(11))
    cases = [
        (
            lambda: read_linear_shard(sd, P, tp_rank=2, tp_size=2),
            ConfigurationError,
            r"tp_rank=2, tp_size=2.*0 <= tp_rank < tp_size",
        ),
        (lambda: read_linear_shard(sd, P, tp_rank=0, tp_size=0), ConfigurationError, "tp_size=0"),
        (
            lambda: read_linear_shard(sd, P, tp_rank=0, tp_size=2, parallel="rows"),
            ConfigurationError,
            "parallel='rows'",
        ),
        (  # K = 32 is two NVFP4 groups: not four ranks' worth
            lambda: read_linear_shard(sd, P, tp_rank=0, tp_size=4, parallel="row"),
            WeightFormatError,
            r"K of .* = 32 is 2 scale group\(s\) of 16.*4 ranks.*tp_size <= 2",
        ),
        (
            lambda: linear_shard_shapes(64, 40, "nvfp4", tp_size=2, parallel="row"),
            WeightFormatError,
            "K = 40 is not a whole number of NVFP4 scale groups of 16",
        ),
        (
            lambda: read_linear_shard(sd, P, tp_rank=0, tp_size=128),
            WeightFormatError,
            "64 row.* cannot be split over 128 ranks",
        ),
        (
            lambda: read_linear_shard(qkv, prefixes, tp_rank=0, tp_size=8, heads=(12, 4)),
            WeightFormatError,
            "12 q heads and 4 kv heads cannot be split over tp_size=8",
        ),
        (
            lambda: read_linear_shard(qkv, prefixes, tp_rank=0, tp_size=2, heads=(12, 2)),
            WeightFormatError,
            "q/k/v have 192/64/64 rows for 12 q heads and 2 kv",
        ),
        (
            lambda: read_linear_shard(qkv, prefixes, tp_rank=0, tp_size=2, parallel="row"),
            ConfigurationError,
            r"a row-parallel layer \(o, down\) is one weight",
        ),
        (
            lambda: read_linear_shard(sd, P, tp_rank=0, tp_size=2, segments=[100]),
            WeightFormatError,
            r"segments \[100\] .* N = 64",
        ),
        (
            lambda: moe_intermediate_range(100, "nvfp4", 0, 2),
            WeightFormatError,
            "I = 100 is not a whole number of NVFP4 scale groups of 16",
        ),
        (
            lambda: moe_shard_sizes(64, "mxfp4", 4),
            WeightFormatError,
            r"I \(MXFP4\) = 64 is 2 scale group\(s\) of 32.*4 ranks",
        ),
        (
            lambda: read_moe_shard(moe, "L.mlp", num_experts=2, tp_rank=1, tp_size=4),
            WeightFormatError,
            "cannot be split over 4 ranks",
        ),
        (
            lambda: read_moe_shard(moe, "L.mlp", num_experts=2, expert_ids=[0, 2]),
            CheckpointError,
            r"expert_ids \[0, 2\]",
        ),
        (
            lambda: read_linear_shard(sd, "nope", tp_rank=0, tp_size=2),
            CheckpointError,
            "no quantized weight under 'nope'",
        ),
    ]
    assert_clear_errors(cases)

"""Tensor-parallel shard shapes on a real GPU: every shard a rank gets of Llama-3-70B at TP 2/4/8
(q/k/v fused per head group, o, gate/up fused, down), gpt-oss-120b's experts at TP 2/4 (NVFP4
and MXFP4) and DeepSeek-V3's experts at TP 8, each built at its shard shape (one random weight
per distinct shape, no processes) and run through the triton backend against float64 at
M = 1, 16, 100, 1024.

    python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py -q

The shapes come from the helpers the checkpoint loaders split by (``linear_shard_shapes``,
``moe_shard_sizes``), so every shape a rank loads is a shape run here; shards of uneven I
(gpt-oss MXFP4 at TP 4: 736 and 704) and N / K that are not multiples of a kernel tile are among
them. Bounds (normwise, bf16 outputs): 1e-2 for a linear, 1.5e-2 for a MoE layer (as the other
GPU tests: a few bf16 roundings of u = 2^-8 each, with margin).
"""

from __future__ import annotations

import math

import pytest
import torch

from quantdispatch import QuantLinear, QuantMoE
from quantdispatch.api import load_settings
from quantdispatch.checkpoints import linear_shard_shapes, moe_shard_sizes
from quantdispatch.formats import Mxfp4Weight, Nvfp4Weight, dequantize_mxfp4, dequantize_nvfp4

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
MS = (1, 16, 100, 1024)
LINEAR_BOUND, MOE_BOUND = 1e-2, 1.5e-2

# Llama-3-70B: hidden 8192, intermediate 28672, 64 q heads / 8 kv heads of 128
HIDDEN, INTER, HQ, HKV, D = 8192, 28672, 64, 8, 128


def _llama_shards() -> dict[tuple[int, int], list[str]]:
    """Distinct (N, K) of every rank's shard -> which layers and TP sizes give it."""
    layers = (
        ("qkv", (HQ + 2 * HKV) * D, HIDDEN, "column", {"heads": (HQ, HKV),
                                                        "segments": (HQ * D, HKV * D, HKV * D)}),
        ("o", HIDDEN, HQ * D, "row", {}),
        ("gate_up", 2 * INTER, HIDDEN, "column", {"segments": (INTER, INTER)}),
        ("down", HIDDEN, INTER, "row", {}),
    )  # fmt: skip
    shapes: dict[tuple[int, int], list[str]] = {}
    for tp in (2, 4, 8):
        for name, n, k, parallel, kw in layers:
            for shape in set(
                linear_shard_shapes(n, k, "nvfp4", tp_size=tp, parallel=parallel, **kw)
            ):
                shapes.setdefault(shape, []).append(f"{name}@tp{tp}")
    return shapes


LLAMA = _llama_shards()


def _fp4(fmt: str, n: int, k: int, gen: torch.Generator, lead: tuple[int, ...] = ()) -> list:
    """Random codes and scales putting |W| ~ 1/sqrt(K); [*lead, N, ...] tensors."""
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, device=DEV, dtype=torch.uint8)
    if fmt == "mxfp4":
        lo = 127 - 3 - round(math.log2(math.sqrt(k)))
        s = torch.randint(lo - 2, lo + 2, (*lead, n, k // 32), generator=gen, device=DEV)
        return [packed, s.to(torch.uint8)]
    bits = torch.randint(0x28, 0x48, (*lead, n, k // 16), generator=gen, device=DEV)
    e = lead[0] if lead else 1
    gs = (0.5 + torch.rand(e, generator=gen, device=DEV)) / (3 * math.sqrt(k))
    return [packed, bits.to(torch.uint8).view(torch.float8_e4m3fn), gs if lead else gs[0]]


def _weight(fmt: str, t: list) -> Nvfp4Weight | Mxfp4Weight:
    return Nvfp4Weight(t[0], t[1], t[2]) if fmt == "nvfp4" else Mxfp4Weight(t[0], t[1])


def _w64(fmt: str, t: list) -> torch.Tensor:
    w = _weight(fmt, t)
    if fmt == "nvfp4":
        return dequantize_nvfp4(w, dtype=torch.float64)
    return dequantize_mxfp4(w, dtype=torch.float64)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out.double() - ref).norm() / ref.norm())


def _forced(fmt: str):
    return load_settings({}, backend={fmt: "triton"})


@pytest.mark.parametrize(
    "shape", sorted(LLAMA), ids=[f"{n}x{k}-{'+'.join(LLAMA[(n, k)])}" for n, k in sorted(LLAMA)]
)
def test_llama3_70b_shards_match_float64(shape):
    n, k = shape
    gen = torch.Generator(device=DEV).manual_seed(n + k)
    t = _fp4("nvfp4", n, k, gen)
    bias = torch.randn(n, generator=gen, device=DEV) * 0.1
    layer = QuantLinear(_weight("nvfp4", t), bias=bias, device=DEV, settings=_forced("nvfp4"))
    assert layer.backend == "triton", layer.decision.explain()
    w64 = _w64("nvfp4", t)
    for m in MS:
        x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
        ref = x.double() @ w64.T + bias.double()
        assert _rel(layer(x), ref) < LINEAR_BOUND, (shape, m)
    del w64


def _gated64(h: torch.Tensor, activation: str) -> torch.Tensor:
    i = h.shape[-1] // 2
    g, u = h[:, :i], h[:, i:]
    if activation == "silu":
        return g * torch.sigmoid(g) * u
    g = g.clamp(max=7.0)  # gpt-oss: alpha 1.702, limit 7
    return g * torch.sigmoid(1.702 * g) * (u.clamp(-7.0, 7.0) + 1)


def _moe_case(fmt, hidden, inter, activation, bias, seed):
    """Two experts at one rank's shard shape, each token routed to both."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w13 = _fp4(fmt, 2 * inter, hidden, gen, lead=(2,))
    w2 = _fp4(fmt, hidden, inter, gen, lead=(2,))
    b13 = torch.randn(2, 2 * inter, generator=gen, device=DEV) * 0.1 if bias else None
    b2 = torch.randn(2, hidden, generator=gen, device=DEV) * 0.1 if bias else None
    layer = QuantMoE(
        w13=w13, w2=w2, format=fmt, top_k=2, num_experts=2, activation=activation,
        w13_bias=b13, w2_bias=b2, device=DEV, settings=_forced(fmt),
    )  # fmt: skip
    assert layer.backend == "triton", layer.decision.explain()
    dense13 = [_w64(fmt, [t[e] for t in w13]) for e in range(2)]
    dense2 = [_w64(fmt, [t[e] for t in w2]) for e in range(2)]
    for m in MS:
        x = torch.randn(m, hidden, generator=gen, device=DEV).to(torch.bfloat16)
        logits = torch.randn(m, 2, generator=gen, device=DEV)
        ids, weights = layer.route(logits)
        ref = torch.zeros(m, hidden, dtype=torch.float64, device=DEV)
        for slot in range(2):
            for e in range(2):
                rows = ids[:, slot] == e
                if not bool(rows.any()):
                    continue
                h = x[rows].double() @ dense13[e].T + (b13[e].double() if bias else 0)
                y = _gated64(h, activation) @ dense2[e].T + (b2[e].double() if bias else 0)
                ref[rows] += weights[rows, slot].double()[:, None] * y
        assert _rel(layer(x, logits), ref) < MOE_BOUND, (fmt, hidden, inter, m)


GPT_OSS = sorted(
    {(f, i, tp) for f in ("nvfp4", "mxfp4") for tp in (2, 4) for i in moe_shard_sizes(2880, f, tp)}
)


@pytest.mark.parametrize(
    ("fmt", "inter", "tp"), GPT_OSS, ids=[f"{f}-I{i}-tp{t}" for f, i, t in GPT_OSS]
)
def test_gpt_oss_120b_expert_shards_match_float64(fmt, inter, tp):
    # hidden 2880, I 2880 per expert: a rank's experts are [2I_r, 2880] and [2880, I_r]
    _moe_case(fmt, 2880, inter, "swiglu_oai", bias=True, seed=inter + tp)


def test_deepseek_v3_expert_shards_at_tp8_match_float64():
    (inter,) = set(moe_shard_sizes(2048, "nvfp4", 8))  # hidden 7168, I 2048 -> 256 per rank
    _moe_case("nvfp4", 7168, inter, "silu", bias=False, seed=8)


def test_the_shard_shapes_are_the_real_ones():
    assert sorted(LLAMA) == sorted(
        [(1280, 8192), (2560, 8192), (5120, 8192), (8192, 1024), (8192, 2048), (8192, 4096),
         (7168, 8192), (14336, 8192), (28672, 8192), (8192, 3584), (8192, 7168), (8192, 14336)]
    )  # fmt: skip
    assert {i for f, i, _ in GPT_OSS if f == "mxfp4"} == {1440, 736, 704}
    assert {i for f, i, _ in GPT_OSS if f == "nvfp4"} == {1440, 720}

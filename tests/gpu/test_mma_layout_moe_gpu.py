"""NVFP4 MoE on repacked (mma16x64) experts on a real GPU: every regime against float64.

    python3 -m pytest tests/gpu/test_mma_layout_moe_gpu.py -q

Regimes of kernels/mma_layout/ (moe_gemm, moe_pairs), each forced by its config: the mma.sync
kernels (single pairs, 8- and 16-pair blocks), the grouped tl.dot GEMM (16 / 32 / 64-pair blocks,
64- and 128-row tiles) and dequantize + torch._grouped_mm. Buffers the call allocates are
NaN-poisoned, so an element that is not written fails. Oracle and bounds from test_moe_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_moe_gpu import BOUND, DEV, inputs, layer_and_weights, moe64, rel, stacks

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")

from quantdispatch.backends.base import Mma16x64Meta  # noqa: E402
from quantdispatch.kernels.checkpoint_layout.moe import fused_moe  # noqa: E402
from quantdispatch.kernels.common import checks  # noqa: E402
from quantdispatch.kernels.common.device_facts import device_facts  # noqa: E402
from quantdispatch.kernels.common.moe_plan import (  # noqa: E402
    DequantMoeConfig,
    MmaMoeConfig,
    grouped_mm_capable,
    mma_moe_config,
)
from quantdispatch.kernels.mma_layout.moe_gemm import mma_layout_moe  # noqa: E402
from quantdispatch.kernels.mma_layout.moe_plan import (  # noqa: E402
    MoeGemmTile,
    SmallMoeConfig,
    mma_layout_moe_plan,
)
from quantdispatch.kernels.mma_layout.moe_stacks import repack_experts, repack_experts_mx  # noqa: E402
from quantdispatch.layers import QuantMoE  # noqa: E402


@pytest.fixture
def nan_empty(monkeypatch):
    def empty(shape, dtype, device):
        if dtype.is_floating_point:
            return torch.full(shape, math.nan, dtype=dtype, device=device)
        return torch.zeros(shape, dtype=dtype, device=device)

    monkeypatch.setattr(checks, "empty", empty)  # every MoE buffer comes from checks.empty


def _repacked(fmt, w, dtype):
    """One stacked weight in the mma16x64 layout (NVFP4 keeps its global scales)."""
    if fmt == "nvfp4":
        return [*repack_experts(w[0], w[1], dtype), w[2]]
    return [*repack_experts_mx(w[0], w[1], dtype)]


def experts(e, h, i, seed, dtype, fmt="nvfp4"):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w13, w2 = stacks(fmt, e, 2 * i, h, gen), stacks(fmt, e, h, i, gen)
    return w13, w2, _repacked(fmt, w13, dtype), _repacked(fmt, w2, dtype), gen


def routing(m, e, top_k, gen):
    scores = torch.rand(m, e, generator=gen, device=DEV)
    w, ids = scores.topk(top_k, dim=1)
    return ids.to(torch.int32), (w + 0.1).float()


def call(r13, r2, x, ids, w, cfg, **kw):
    kw.setdefault("activation", "silu")
    kw.setdefault("params", [])
    return mma_layout_moe(x, ids, w, r13, r2, kw.pop("b13", None), kw.pop("b2", None),
                          packed_for=x.dtype, config=cfg, **kw)  # fmt: skip


E, TOP_K, H, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B
REGIMES = [
    ("mma-direct", lambda m: mma_moe_config(m * TOP_K, E, INTER, H, direct=True)),
    ("mma-nt1", lambda m: mma_moe_config(m * TOP_K, E, INTER, H, direct=False)),
    ("mma-nt2", lambda m: mma_moe_config(m * TOP_K, E, INTER, H, direct=False, nt=2)),
    ("gemm16", lambda m: MoeGemmTile(16)),
    ("gemm32", lambda m: MoeGemmTile(32)),
    ("gemm64", lambda m: MoeGemmTile(64, stages=3)),
    ("gemm64-n128", lambda m: MoeGemmTile(64, block_n=128, warps=8, stages=3)),
    ("dequant", lambda m: DequantMoeConfig()),
    ("topk-sum", lambda m: SmallMoeConfig()),
    ("topk-sum-w4", lambda m: SmallMoeConfig(4, 2, 4, 2)),
    ("topk-sum-w16", lambda m: SmallMoeConfig(2, 1, 16, 1)),
    ("topk-sum-pdl", lambda m: SmallMoeConfig(8, 1, 16, 2, pdl=True, prefetch=6)),  # 6 of 12
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("regime", REGIMES, ids=[r[0] for r in REGIMES])
@pytest.mark.parametrize("m", [1, 37, 300])
def test_every_regime_matches_float64(nan_empty, m, regime, dtype):
    """Qwen3-30B-A3B sizes; a quarter of the experts live on another rank (ids -> -1)."""
    if regime[0] == "dequant" and not grouped_mm_capable(device_facts(DEV)):
        pytest.skip("torch._grouped_mm needs SM 9.0+")
    if regime[0].endswith("-pdl") and not device_facts(DEV).dependent_launches:
        pytest.skip("a programmatic dependent launch needs SM 9.0+")
    w13, w2, r13, r2, gen = experts(E, H, INTER, seed=m, dtype=dtype)
    ids, w = routing(m, E, TOP_K, gen)
    ids = torch.where(ids % 4 == 3, -1, ids)  # foreign experts: contribute nothing
    x = torch.randn(m, H, generator=gen, device=DEV).to(dtype)
    out = call(r13, r2, x, ids, w, regime[1](m))
    keep = ids >= 0
    ref = moe64("nvfp4", x, torch.where(keep, ids, 0), torch.where(keep, w, 0.0), w13, w2)
    assert rel(out, ref) < BOUND[dtype]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpt_oss_sizes_clamped_swiglu_with_biases(nan_empty, fmt):
    """gpt-oss-like experts: 32, top 4, H = I = 2880 (45 chunks: not a multiple of the 2-chunk
    K step), clamped SwiGLU and biases, at every M the heuristic meets (single pairs, 8-pair
    blocks, grouped GEMM, dequantize) against float64."""
    gen = torch.Generator(device=DEV).manual_seed(61 if fmt == "mxfp4" else 5)
    w13, w2 = stacks(fmt, 32, 5760, 2880, gen), stacks(fmt, 32, 2880, 2880, gen)
    r13, r2 = _repacked(fmt, w13, torch.bfloat16), _repacked(fmt, w2, torch.bfloat16)
    b13 = torch.randn(32, 5760, generator=gen, device=DEV)
    b2 = torch.randn(32, 2880, generator=gen, device=DEV)
    params = [1.702, 7.0]
    # 3 and 16: 8-pair blocks, K split 4 ways (few programs); 1100: 128-pair blocks on 64-row
    # tiles with 4 warps (128 does not divide 2880)
    for m in (1, 3, 16, 90, 700, 1100):
        ids, w = routing(m, 32, 4, gen)
        x = torch.randn(m, 2880, generator=gen, device=DEV).to(torch.bfloat16)
        ref = moe64(fmt, x, ids, w, w13, w2, b13, b2, "swiglu_oai", params)
        cfg = mma_layout_moe_plan(m, 4, 32, 2880, 2880, device_facts(DEV))
        out = call(r13, r2, x, ids, w, cfg, activation="swiglu_oai", params=params, b13=b13,
                   b2=b2)  # fmt: skip
        assert rel(out, ref) < BOUND[torch.bfloat16], cfg


@pytest.mark.parametrize("m", [4, 5, 8, 9])
def test_the_plan_between_single_pairs_and_blocks_matches_float64(nan_empty, m):
    """Qwen3-30B-A3B at the plan's picks around 0.5 tokens per expert: single pairs (M=4), one
    8-row block per pair without the expert sort (M = 5..8, small experts), 8-pair blocks
    (M=9)."""
    w13, w2, r13, r2, gen = experts(E, H, INTER, seed=40 + m, dtype=torch.bfloat16)
    ids, w = routing(m, E, TOP_K, gen)
    x = torch.randn(m, H, generator=gen, device=DEV).to(torch.bfloat16)
    cfg = mma_layout_moe_plan(m, TOP_K, E, INTER, H, device_facts(DEV))
    assert isinstance(cfg, SmallMoeConfig if m == 4 else MmaMoeConfig)
    assert m == 4 or cfg.direct == (m <= 8)
    out = call(r13, r2, x, ids, w, cfg)
    ref = moe64("nvfp4", x, ids, w, w13, w2)
    assert rel(out, ref) < BOUND[torch.bfloat16], cfg


def test_agrees_with_the_checkpoint_layout_kernels():
    """Same experts, both layouts, at the heuristic's choice for M = 1, 16, 256."""
    w13, w2, r13, r2, gen = experts(E, H, INTER, seed=9, dtype=torch.bfloat16)
    for m in (1, 16, 256):
        ids, w = routing(m, E, TOP_K, gen)
        x = torch.randn(m, H, generator=gen, device=DEV).to(torch.bfloat16)
        new = call(r13, r2, x, ids, w, None)
        old = fused_moe(x, ids, w, w13, w2, None, None, fmt="nvfp4", activation="silu",
                           params=[])  # fmt: skip
        assert rel(new, old.double()) < 1e-2


def test_quant_moe_repacks_on_the_gpu_and_round_trips_its_state_dict():
    layer, w13, w2, gen = layer_and_weights("nvfp4", 16, 2, 1024, 512, seed=13)
    names = dict(layer.named_buffers())
    assert "w13_mma_words" in names and "w13_packed" not in names
    canonical = sum(t.numel() * t.element_size() for t in (*w13, *w2))
    assert layer.device_bytes() == canonical  # same bytes as the checkpoint's stacks
    assert "repacked" in layer.decision.explain()
    x, logits = inputs(24, 1024, 16, gen, torch.bfloat16)
    ids, w = layer.route(logits)
    out = layer(x, logits)
    assert rel(out, moe64("nvfp4", x, ids, w, w13, w2)) < BOUND[torch.bfloat16]
    other = torch.Generator(device=DEV).manual_seed(99)  # a layer with other weights
    twin = QuantMoE(w13=stacks("nvfp4", 16, 1024, 1024, other),
                    w2=stacks("nvfp4", 16, 1024, 512, other), format="nvfp4", top_k=2,
                    device=DEV)  # fmt: skip
    assert not torch.equal(twin(x, logits), out)
    twin.load_state_dict(layer.state_dict())
    assert torch.equal(twin(x, logits), out)


def test_fp16_layer_runs_its_fp16_layout():
    layer, w13, w2, gen = layer_and_weights("nvfp4", 8, 2, 512, 256, seed=14, dtype=torch.float16)
    assert layer._meta == Mma16x64Meta(torch.float16)  # repacked for fp16
    x, logits = inputs(4, 512, 8, gen, torch.float16)
    ids, w = layer.route(logits)
    assert isinstance(mma_layout_moe_plan(4, 2, 8, 256, 512, device_facts(DEV)), MmaMoeConfig)
    assert rel(layer(x, logits), moe64("nvfp4", x, ids, w, w13, w2)) < BOUND[torch.float16]


@pytest.mark.parametrize(
    "cfg",
    [SmallMoeConfig(), SmallMoeConfig(8, 1, 16, 1), SmallMoeConfig(4, 2, 8, 2, True, 45),
     SmallMoeConfig(8, 1, 4, 2, True, 0)],
    ids=["default", "w16", "pdl-prefetch-all", "pdl-no-prefetch"],
)  # fmt: skip
def test_single_pair_kernels_biases_uneven_chunks_graphs_and_determinism(nan_empty, cfg):
    """gpt-oss-like (45 chunks per row: not a multiple of the warps' K step; biases; clamped
    SwiGLU; subnormal and 448 block scales) against float64; a CUDA graph replay equals eager bit
    for bit, and so do repeated calls (the top-k sum has a fixed order). With a programmatic
    dependent launch too (captured as a programmatic edge of the graph)."""
    if cfg.pdl and not device_facts(DEV).dependent_launches:
        pytest.skip("a programmatic dependent launch needs SM 9.0+")
    w13, w2, r13, r2, gen = experts(32, 2880, 2880, seed=21, dtype=torch.bfloat16)
    for w in (w13, w2):  # the largest E4M3 block scale (448) on some rows, the weights kept small
        w[1].view(torch.uint8)[:, 16:32] = 0x7E
        w[2] /= 448.0
    r13, r2 = _repacked("nvfp4", w13, torch.bfloat16), _repacked("nvfp4", w2, torch.bfloat16)
    b13 = torch.randn(32, 5760, generator=gen, device=DEV)
    b2 = torch.randn(32, 2880, generator=gen, device=DEV)
    params = [1.702, 7.0]
    kw = dict(activation="swiglu_oai", params=params, b13=b13, b2=b2)
    for m in (1, 5):
        ids, w = routing(m, 32, 4, gen)
        x = torch.randn(m, 2880, generator=gen, device=DEV).to(torch.bfloat16)
        ref = moe64("nvfp4", x, ids, w, w13, w2, b13, b2, "swiglu_oai", params)
        out = call(r13, r2, x, ids, w, cfg, **dict(kw))
        assert rel(out, ref) < BOUND[torch.bfloat16]
        assert torch.equal(call(r13, r2, x, ids, w, cfg, **dict(kw)), out)
    x_static = x.clone()
    graph = torch.cuda.CUDAGraph()
    call(r13, r2, x_static, ids, w, cfg, **dict(kw))  # compile outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        replayed = call(r13, r2, x_static, ids, w, cfg, **dict(kw))
    x_static.copy_(torch.randn(5, 2880, generator=gen, device=DEV).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, call(r13, r2, x_static, ids, w, cfg, **dict(kw)))


# ---- MXFP4 experts on the same layout (scale pairs shared by lane pairs, per-expert global) ----


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("regime", REGIMES, ids=[r[0] for r in REGIMES])
@pytest.mark.parametrize("m", [1, 37])
def test_mxfp4_every_regime_matches_float64(nan_empty, m, regime, dtype):
    if regime[0] == "dequant" and not grouped_mm_capable(device_facts(DEV)):
        pytest.skip("torch._grouped_mm needs SM 9.0+")
    if regime[0].endswith("-pdl") and not device_facts(DEV).dependent_launches:
        pytest.skip("a programmatic dependent launch needs SM 9.0+")
    w13, w2, r13, r2, gen = experts(E, H, INTER, seed=m + 50, dtype=dtype, fmt="mxfp4")
    ids, w = routing(m, E, TOP_K, gen)
    ids = torch.where(ids % 4 == 3, -1, ids)
    x = torch.randn(m, H, generator=gen, device=DEV).to(dtype)
    out = call(r13, r2, x, ids, w, regime[1](m))
    keep = ids >= 0
    ref = moe64("mxfp4", x, torch.where(keep, ids, 0), torch.where(keep, w, 0.0), w13, w2)
    assert rel(out, ref) < BOUND[dtype]


def test_mxfp4_quant_moe_holds_the_repacked_layout():
    layer, w13, w2, gen = layer_and_weights("mxfp4", 16, 2, 1024, 512, seed=62)
    names = dict(layer.named_buffers())
    assert "w13_mma_words" in names and "w13_packed" not in names
    assert "18 binades" in layer.decision.explain()
    x, logits = inputs(24, 1024, 16, gen, torch.bfloat16)
    ids, w = layer.route(logits)
    ref = moe64("mxfp4", x, ids, w, w13, w2)
    assert rel(layer(x, logits), ref) < BOUND[torch.bfloat16]

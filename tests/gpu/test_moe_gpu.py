"""QuantMoE / the Triton fused MoE on a real GPU: real sizes against float64, CUDA graphs,
torch.compile(fullgraph=True).

    python3 -m pytest tests/gpu/test_moe_gpu.py -q

Float64 oracle: weights decoded from their bits (bit formulas written here), one expert at a
time over the tokens routed to it. Bound 1.5e-2 (normwise, bf16): three round-to-nearest
roundings to bf16 (intermediate, per-slot rows, the sum), rms ~ u/sqrt(3) each with
u = 2^-8 (~4e-3 together), ~3.5x margin; fp16 4e-3.
"""

from __future__ import annotations

import math

import pytest
import torch

from quantdispatch.layers import QuantMoE

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
BOUND = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}


# ---- float64 decoders (format definitions) -------------------------------------------------


def e2m1_64(codes: torch.Tensor) -> torch.Tensor:
    c = codes.long()
    e, m = (c >> 1) & 3, (c & 1).double()
    mag = torch.where(e == 0, m * 0.5, torch.pow(2.0, (e - 1).double()) * (1 + m / 2))
    return torch.where((c & 8) != 0, -mag, mag)


def e4m3_64(bits: torch.Tensor) -> torch.Tensor:
    b = bits.long()
    e, m = (b >> 3) & 15, (b & 7).double()
    mag = torch.where(e == 0, m / 8 * 2.0**-6, torch.pow(2.0, (e - 7).double()) * (1 + m / 8))
    return torch.where((b & 0x80) != 0, -mag, mag)


def unpack(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 0xF, p >> 4], -1).flatten(-2)


def dense64(fmt: str, w: list[torch.Tensor], e: int, block=(128, 128)) -> torch.Tensor:
    """Expert ``e`` of stacked canonical tensors as float64 [N, K]."""
    if fmt in ("nvfp4", "mxfp4"):
        v = e2m1_64(unpack(w[0][e]))
        group = 16 if fmt == "nvfp4" else 32
        bits = w[1][e].view(torch.uint8)
        s = e4m3_64(bits) if fmt == "nvfp4" else torch.pow(2.0, bits.double() - 127)
        v = v * s.repeat_interleave(group, -1)
        return v * float(w[2][e]) if fmt == "nvfp4" else v
    v = e4m3_64(w[0][e].view(torch.uint8))
    s = w[1][e].double()
    if s.dim() == 0:
        return v * s
    if s.dim() == 1:
        return v * s[:, None]
    n, k = v.shape
    return v * s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]


def act64(h, activation, params):
    i = h.shape[-1] // 2
    g, u = h[:, :i], h[:, i:]
    if activation == "silu":
        return g / (1 + torch.exp(-g)) * u
    alpha, limit = params
    g = g.clamp(max=limit)
    return g / (1 + torch.exp(-alpha * g)) * (u.clamp(-limit, limit) + 1)


def moe64(fmt, x, ids, w, w13, w2, b13=None, b2=None, activation="silu", params=()):
    """Per expert: its tokens through float64 weights; weighted sum into [M, H]."""
    m, k = ids.shape
    out = torch.zeros(m, x.shape[1], dtype=torch.float64, device=x.device)
    flat = ids.flatten().long()
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).flatten()
        t = pairs // k
        h = x[t].double() @ dense64(fmt, w13, e).T
        if b13 is not None:
            h = h + b13[e].double()
        y = act64(h, activation, params) @ dense64(fmt, w2, e).T
        if b2 is not None:
            y = y + b2[e].double()
        out.index_add_(0, t, y * w.flatten()[pairs].double()[:, None])
    return out


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out.double() - ref).norm() / ref.norm())


# ---- random stacked experts ------------------------------------------------------------------


def stacks(fmt: str, e: int, n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random codes; scales putting |W| ~ 1/sqrt(K); some subnormal e4m3 block scales."""
    if fmt == "fp8":
        mag = torch.randint(0, 0x7F, (e, n, k), generator=gen, device=DEV)
        sign = torch.randint(0, 2, (e, n, k), generator=gen, device=DEV) * 0x80
        w = (mag + sign).to(torch.uint8).view(torch.float8_e4m3fn)
        nb, kb = -(-n // 128), -(-k // 128)
        s = (0.5 + torch.rand(e, nb, kb, generator=gen, device=DEV)) / (60 * math.sqrt(k))
        return [w, s]
    packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, device=DEV, dtype=torch.uint8)
    if fmt == "mxfp4":
        lo = 127 - 3 - round(math.log2(math.sqrt(k)))
        s = torch.randint(lo - 2, lo + 2, (e, n, k // 32), generator=gen, device=DEV)
        return [packed, s.to(torch.uint8)]
    bits = torch.randint(0x28, 0x48, (e, n, k // 16), generator=gen, device=DEV)
    bits[:, : max(1, n // 64)] = torch.randint(1, 8, (1,), generator=gen, device=DEV)  # subnormal
    gs = (0.5 + torch.rand(e, generator=gen, device=DEV)) / (3 * math.sqrt(k))
    return [packed, bits.to(torch.uint8).view(torch.float8_e4m3fn), gs.float()]


def layer_and_weights(fmt, e, top_k, h, i, seed, dtype=torch.bfloat16, **kw):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w13 = stacks(fmt, e, 2 * i, h, gen)
    w2 = stacks(fmt, e, h, i, gen)
    block = (128, 128) if fmt == "fp8" else None
    layer = QuantMoE(w13=w13, w2=w2, format=fmt, fp8_block_size=block, top_k=top_k,
                     act_dtype=dtype, device=DEV, **kw)  # fmt: skip
    assert layer.backend == "triton", layer.decision.explain()
    return layer, w13, w2, gen


def inputs(m, h, e, gen, dtype):
    x = torch.randn(m, h, generator=gen, device=DEV).to(dtype)
    logits = torch.randn(m, e, generator=gen, device=DEV) * 2
    return x, logits


# ---- numerics at real sizes ----------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 5, 64, 600, 3000])
def test_qwen3_30b_a3b_layer_matches_float64(m):
    """128 experts, top 8, hidden 2048, intermediate 768: M = 1, 5 (direct path), 64 (16-row
    blocks), 600 (32), 3000 (128)."""
    layer, w13, w2, gen = layer_and_weights("nvfp4", 128, 8, 2048, 768, seed=m, renormalize=True)
    x, logits = inputs(m, 2048, 128, gen, torch.bfloat16)
    ids, w = layer.route(logits)
    out = layer(x, logits)
    assert rel(out, moe64("nvfp4", x, ids, w, w13, w2)) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 33, 700])
def test_mixtral_like_slice_matches_float64(m, dtype):
    """8 experts, top 2, hidden 1024, intermediate 3584 (a slice of Mixtral-8x7B)."""
    layer, w13, w2, gen = layer_and_weights("nvfp4", 8, 2, 1024, 3584, seed=7 + m, dtype=dtype,
                                            renormalize=True)  # fmt: skip
    x, logits = inputs(m, 1024, 8, gen, dtype)
    ids, w = layer.route(logits)
    assert rel(layer(x, logits), moe64("nvfp4", x, ids, w, w13, w2)) < BOUND[dtype]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_many_tokens_per_expert_regimes(fmt):
    """8 experts, top 2, M = 4200 (1050 tokens per expert): on SM 9.0+ the checkpoint layout's
    heuristic (from 512 per expert) dequantizes each GEMM's experts and runs
    torch._grouped_mm; the repacked layer keeps its grouped GEMM for experts this small (it
    dequantizes only 2^25+ element experts, whose forced regime test_mma_layout_moe_gpu.py runs);
    checked against float64."""
    from quantdispatch.kernels.checkpoint_layout import moe_plan
    from quantdispatch.kernels.common.device_facts import device_facts
    from quantdispatch.kernels.common.moe_plan import DequantMoeConfig
    from quantdispatch.kernels.mma_layout.moe_plan import MoeGemmTile, mma_layout_moe_plan

    m = 4200
    facts = device_facts(DEV)
    cfg = moe_plan.checkpoint_layout_moe_plan(m, 2, 8, 1792, 1024, fmt, facts)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert isinstance(cfg, DequantMoeConfig), cfg
        repacked = mma_layout_moe_plan(m, 2, 8, 1792, 1024, facts)
        assert isinstance(repacked, MoeGemmTile), repacked
        big = mma_layout_moe_plan(3072, 2, 8, 14336, 4096, facts)  # Mixtral, 768 per expert
        assert isinstance(big, DequantMoeConfig), big
    layer, w13, w2, gen = layer_and_weights(fmt, 8, 2, 1024, 1792, seed=21, renormalize=True)
    x, logits = inputs(m, 1024, 8, gen, torch.bfloat16)
    ids, w = layer.route(logits)
    assert rel(layer(x, logits), moe64(fmt, x, ids, w, w13, w2)) < BOUND[torch.bfloat16]


def test_mxfp4_swiglu_biases_and_fp8_block_scales():
    """gpt-oss-like: 32 experts, top 4, hidden = intermediate = 2880, biases, clamped SwiGLU;
    then FP8 with 128x128 block scales and an intermediate (640) that is not a block multiple."""
    g = torch.Generator(device=DEV).manual_seed(2)
    b13 = torch.randn(32, 5760, generator=g, device=DEV)
    b2 = torch.randn(32, 2880, generator=g, device=DEV)
    layer, w13, w2, gen = layer_and_weights("mxfp4", 32, 4, 2880, 2880, seed=3,
                                            activation="swiglu_oai", renormalize=True,
                                            w13_bias=b13, w2_bias=b2)  # fmt: skip
    x, logits = inputs(77, 2880, 32, gen, torch.bfloat16)
    ids, w = layer.route(logits)
    ref = moe64("mxfp4", x, ids, w, w13, w2, b13, b2, "swiglu_oai", (1.702, 7.0))
    assert rel(layer(x, logits), ref) < BOUND[torch.bfloat16]

    layer, w13, w2, gen = layer_and_weights("fp8", 16, 4, 1024, 640, seed=4)
    x, logits = inputs(50, 1024, 16, gen, torch.bfloat16)
    ids, w = layer.route(logits)
    assert rel(layer(x, logits), moe64("fp8", x, ids, w, w13, w2)) < BOUND[torch.bfloat16]


# ---- graphs and compile --------------------------------------------------------------------


def test_cuda_graph_capture_and_replay_equal_eager():
    layer, _, _, gen = layer_and_weights("nvfp4", 128, 8, 2048, 768, seed=11, renormalize=True)
    for m in (1, 16, 256):
        x, logits = inputs(m, 2048, 128, gen, torch.bfloat16)
        sx, sl = x.clone(), logits.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(sx, sl)  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = layer(sx, sl)
        x2, l2 = inputs(m, 2048, 128, gen, torch.bfloat16)
        sx.copy_(x2)
        sl.copy_(l2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, layer(x2, l2))


def test_torch_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    layer, _, _, gen = layer_and_weights("nvfp4", 64, 4, 1024, 512, seed=12, renormalize=True,
                                         expert_ids=list(range(64)), num_experts=64)  # fmt: skip
    x, logits = inputs(40, 1024, 64, gen, torch.bfloat16)
    ids, w = layer.route(logits)
    compiled = torch.compile(layer, fullgraph=True)
    # precomputed routing: the custom op alone, bit-equal
    assert torch.equal(
        compiled(x, topk_ids=ids, topk_weights=w), layer(x, topk_ids=ids, topk_weights=w)
    )
    # router logits: routing compiled by inductor too (same ids; weights to float32 rounding)
    out = compiled(x, logits)
    assert rel(out, layer(x, logits).double()) < 2e-3

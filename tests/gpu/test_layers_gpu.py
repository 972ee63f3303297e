"""QuantLinear on a real GPU: the decision, numerics at real sizes, CUDA graphs, torch.compile."""

from __future__ import annotations

import pytest
import torch

from quantdispatch import select
from quantdispatch.api import load_settings
from quantdispatch.formats import quantize_fp8, quantize_mxfp4, quantize_nvfp4
from quantdispatch.layers import QuantLinear

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def _w(n, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=DEV) * 0.02
    w[: n // 64] *= 1e-3  # subnormal block scales on some rows
    return w


def _ref(layer_weight64: torch.Tensor, x: torch.Tensor, bias=None) -> torch.Tensor:
    y = x.double() @ layer_weight64.T
    return y + bias.double() if bias is not None else y


def _w64(fmt, q):
    from quantdispatch.formats import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4

    f = {"nvfp4": dequantize_nvfp4, "mxfp4": dequantize_mxfp4, "fp8": dequantize_fp8}[fmt]
    return f(q, dtype=torch.float64)


def _quant(fmt, w):
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    return quantize_fp8(w, kind="channel")


def test_real_gpu_profile_and_decision():
    d = select("nvfp4")
    assert not d.device.simulated and d.device.kind == "cuda"
    assert d.device.sources.name.value in ("nvml", "torch")
    cc = torch.cuda.get_device_capability()
    if cc in ((8, 0), (8, 6), (8, 9), (9, 0)):
        assert d.backend == "triton", d.explain()
    if cc >= (8, 9) and cc < (10, 0):
        assert select("fp8").backend == "torch"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (2048, 768)])
@pytest.mark.parametrize("m", [1, 7, 33, 300])
def test_quant_linear_triton_matches_float64(fmt, n, k, m):
    q = _quant(fmt, _w(n, k, seed=n + k))
    forced = load_settings({}, backend={fmt: "triton"})
    bias = torch.randn(n, device=DEV)
    layer = QuantLinear(q, bias=bias, device=DEV, settings=forced)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    out = layer(x)
    ref = _ref(_w64(fmt, q), x, bias)
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_fp8_native_torch_backend_matches_emulated_reference():
    q = quantize_fp8(_w(4096, 4096, seed=3), kind="channel")
    layer = QuantLinear(q, device=DEV)
    assert layer.backend == "torch"
    x = torch.randn(16, 4096, device=DEV).to(torch.bfloat16)
    from quantdispatch.backends.reference import fake_quantize_fp8_activations

    ref = _ref(_w64("fp8", q), fake_quantize_fp8_activations(x, None))
    assert float((layer(x).double() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("m", [8, 200, 600], ids=["mma", "gemm", "dequant"])
def test_cuda_graph_replay_equals_eager(m):
    """Each path QuantLinear runs on this GPU (the mma kernel, the mid-M GEMM with its
    permuted activations and K-split workspace, dequantized slabs + cuBLAS): captured, replayed
    over a poisoned output and after new inputs, bit-equal to eager."""
    cap = torch.cuda.get_device_capability()
    expected = {8: "mma GEMV", 200: "wgmma GEMM", 600: "dequantize + cuBLAS"}[m]
    if cap < (9, 0) and m == 200:
        pytest.skip("the mid-M GEMM runs on SM 9.x only")
    layer = QuantLinear(quantize_nvfp4(_w(4096, 4096, seed=4)), device=DEV)
    if cap >= (9, 0):
        assert layer.decision.kernel_for(m).family == expected
    x = torch.randn(m, 4096, device=DEV).to(torch.bfloat16)
    eager = layer(x)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    static_out.fill_(float("nan"))  # poison: replay must rewrite every element
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    assert torch.equal(static_out, layer(static_x))


@pytest.mark.parametrize(  # 3 x tokens rows: the mma kernel, the mid-M GEMM, dequantized slabs
    "tokens", [5, 40, 200], ids=["mma", "gemm", "dequant"]
)
def test_torch_compile_fullgraph_equals_eager(tokens):
    torch._dynamo.reset()
    a = QuantLinear(quantize_nvfp4(_w(2048, 1024, seed=5)), device=DEV)
    b = QuantLinear(quantize_mxfp4(_w(1024, 2048, seed=6)), device=DEV)
    model = torch.nn.Sequential(a, torch.nn.SiLU(), b)
    x = torch.randn(3, tokens, 1024, device=DEV).to(torch.bfloat16)
    assert torch.equal(torch.compile(model, fullgraph=True)(x), model(x))


def test_reference_backend_on_gpu_keeps_memory_bounded():
    q = quantize_nvfp4(_w(14336, 4096, seed=7))
    layer = QuantLinear(q, device=DEV, settings=load_settings({}, backend={"nvfp4": "reference"}))
    assert layer.device_bytes() <= 0.5625 * 14336 * 4096 + 64
    x = torch.randn(4, 4096, device=DEV).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    layer(x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 64 * 2**20, f"{extra / 2**20:.1f} MiB"  # a full fp32 copy would be 235 MB


@pytest.mark.parametrize(("m", "k"), [(1, 4096), (7, 14336), (33, 1000)])
def test_fused_per_token_fp8_quantization_matches_the_torch_maths(m, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native FP8 (and this kernel) needs SM89+")
    from quantdispatch.kernels.native.fp8_quant import quantize_per_token_fp8
    from quantdispatch.kernels.native.scaled_mm import _quantize_per_token

    x = (torch.randn(m, k, device=DEV) * 3).to(torch.bfloat16)
    x[0, 0] = 0.0
    q, s = quantize_per_token_fp8(x)
    q_ref, s_ref = _quantize_per_token(x)
    # torch divides by the scalar 448 through a reciprocal multiply: scales agree to an ulp.
    # x / s of bf16 inputs lands exactly on e4m3 midpoints often, so a one-ulp scale difference
    # flips ~0.5% of codes (measured on the H200): both are correct roundings of their scale.
    assert torch.allclose(s, s_ref, rtol=2.0**-22, atol=0)
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.98
    # every code is x / s rounded to e4m3: within half a step (2^-4 relative, 2^-10 * s below)
    deq, xf = q.float() * s, x.float()
    assert bool(
        ((deq - xf).abs() <= torch.maximum(xf.abs() * 2.0**-4, s * 2.0**-10) * 1.0001).all()
    )


@pytest.mark.parametrize("m", [1, 16, 100, 300])
def test_mxfp4_takes_the_mma_layout_unless_its_scales_span_too_wide(m):
    """On SM 8.0+ an MXFP4 weight is repacked to mma16x64 (same bytes) when its block scales
    span <= 18 binades; one whose scales span more keeps the checkpoint layout. Both match
    float64 on every path (GEMV, GEMM, dequantize)."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the mma16x64 layout needs SM 8.0+")
    forced = load_settings({}, backend={"mxfp4": "triton"})
    narrow = quantize_mxfp4(_w(4096, 4096, seed=31))
    w = _w(4096, 4096, seed=32)
    w[100:116] *= 2.0**-30  # 16 rows 30 binades below the rest
    wide = quantize_mxfp4(w)
    for q, layout in ((narrow, "mma_words"), (wide, "packed")):
        layer = QuantLinear(q, device=DEV, settings=forced)
        names = {name for name, _ in layer.named_buffers()}
        assert layout in names, names
        x = torch.randn(m, 4096, device=DEV).to(torch.bfloat16)
        ref = _ref(_w64("mxfp4", q), x)
        assert float((layer(x).double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("m", [5, 40, 600])
def test_mxfp4_fp16_scales_outside_fp16(m):
    """MXFP4 scales 2^-27 .. 2^18 (46 binades: too wide for the mma layout, so the checkpoint
    layout, whose kernels round the decoded weight to fp16): prepare rebases the codes, the
    fused kernels' fp32 epilogue applies 2^d, at every M (M=600 would otherwise take the
    dequantized fp16 slabs). Without it 2^14+ scales gave inf."""
    from quantdispatch.formats.mxfp4 import Mxfp4Weight

    n, k = 4096, 4096
    g = torch.Generator(device=DEV).manual_seed(31)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, device=DEV, dtype=torch.uint8)
    e8 = torch.randint(100, 146, (n, k // 32), generator=g, device=DEV, dtype=torch.uint8)
    q = Mxfp4Weight(packed=packed, block_scale=e8)
    layer = QuantLinear(q, act_dtype=torch.float16, device=DEV)
    assert layer.backend == "triton" and layer._meta.fp16_rebased, layer._meta
    x = (torch.randn(m, k, generator=g, device=DEV) * 2.0**-16).to(torch.float16)
    out = layer(x)
    ref = x.double() @ _w64("mxfp4", q).T
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).norm() / ref.norm()) < 4e-3

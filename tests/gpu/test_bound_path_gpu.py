"""The bound call path on a real GPU: every kernel family of every layout, the second call on
the direct launch (quantdispatch.kernels.common.launch), bit-equal with the custom op and
within bounds of float64; capture in a CUDA graph; the direct launch reuses exactly the kernel
Triton picks."""

from __future__ import annotations

import pytest
import torch

from quantdispatch.api import load_settings
from quantdispatch.formats import (
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_nvfp4,
)
from quantdispatch.layers import QuantLinear

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
QUANT = {"nvfp4": quantize_nvfp4, "mxfp4": quantize_mxfp4, "fp8": quantize_fp8}
DEQUANT = {"nvfp4": dequantize_nvfp4, "mxfp4": dequantize_mxfp4, "fp8": dequantize_fp8}


def _layer(
    fmt: str, n: int, k: int, *, bias: bool, dtype=torch.bfloat16, backend: str | None = None
) -> QuantLinear:
    g = torch.Generator(device=DEV).manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g, device=DEV) * 0.02
    w[: max(1, n // 64)] *= 1e-3  # subnormal block scales on some rows
    q = QUANT[fmt](w)
    b = torch.randn(n, generator=g, device=DEV) if bias else None
    settings = load_settings({}, **({"backend": {fmt: backend}} if backend else {}))
    layer = QuantLinear(q, bias=b, act_dtype=dtype, settings=settings, device=DEV)
    layer.w64 = DEQUANT[fmt](q, dtype=torch.float64)
    layer.b64 = None if b is None else b.double()
    return layer


def _op(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantdispatch.linear(
        x, layer._tensors(), layer.bias, layer.backend, layer.format, layer._meta_args,
        layer.out_features, layer.decision.pdl,
    )  # fmt: skip


# (format, N, K): the mma16x64 layout (NVFP4 / MXFP4, N and K multiples of 64), the checkpoint
# layout (N not a multiple of 64 keeps it), FP8; M covers GEMV, wgmma GEMM and dequantize.
CASES = [
    ("nvfp4", 6144, 4096), ("nvfp4", 4096, 14336), ("mxfp4", 2048, 1024),
    ("nvfp4", 1000, 512), ("mxfp4", 1000, 512), ("fp8", 1536, 1024),
]  # fmt: skip
#: FP8 runs W8A8 on torch._scaled_mm by default here (activations quantized: a looser bound);
#: forced to triton it is weight-only.
BOUND = {"torch": 6e-2, "triton": 1e-2, "reference": 1e-2}
MS = [1, 5, 16, 33, 64, 200, 256, 513, 1100]


@pytest.mark.parametrize(("fmt", "n", "k", "backend"), [
    *((f, n, k, None) for f, n, k in CASES), ("fp8", 1536, 1024, "triton")])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_bound_path_equals_the_op_and_float64(fmt, n, k, backend, bias):
    layer = _layer(fmt, n, k, bias=bias, backend=backend)
    bound = layer.bound()
    for m in MS:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        first, second = layer(x), layer(x)  # the second runs the direct launch
        op = _op(layer, x)
        assert torch.equal(first, op) and torch.equal(second, op), (fmt, n, k, m)
        want = x.double() @ layer.w64.T + (0 if layer.b64 is None else layer.b64)
        err = float((second.double() - want).norm() / want.norm())
        assert err < BOUND[layer.backend], (fmt, n, k, m, bound.family_for(m), err)
    if layer.backend == "triton":  # the regime table's steps: several families by M
        assert len(set(bound.families)) >= 2, bound.families


def test_bound_path_with_3d_input_and_fp16():
    layer = _layer("nvfp4", 2048, 1024, bias=True, dtype=torch.float16)
    x = torch.randn(3, 5, 1024, device=DEV, dtype=torch.float16)
    y = layer(x)
    assert y.shape == (3, 5, 2048)
    assert torch.equal(y.reshape(15, 2048), _op(layer, x.reshape(15, 1024)))


@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_bound_path_in_a_cuda_graph_replays_eagers_bits(m):
    layer = _layer("nvfp4", 6144, 4096, bias=False)
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    want = layer(x)
    layer(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer(x))
    assert not torch.equal(out, want)  # the replay read the new input


def test_moving_the_layer_rebinds():
    layer = _layer("nvfp4", 2048, 1024, bias=False)
    x = torch.randn(4, 1024, device=DEV, dtype=torch.bfloat16)
    y = layer(x)
    first = layer.bound()
    layer.cpu()
    assert layer._bound is None
    layer.to(DEV)
    assert layer.bound() is not first
    assert torch.equal(layer(x), y)


def test_direct_launch_gives_the_bits_of_tritons_own_launch():
    """Launch keys never coarser than Triton's: after calls that fill the direct-launch cache
    (M == 1, M % 16 == 0, odd M, 16-byte aligned x and not), each direct launch gives the bits
    of a fresh launcher's first call, which goes through ``kernel[grid]``."""
    from quantdispatch.kernels.common import launch
    from quantdispatch.kernels.mma_layout.gemv import MmaGemv

    if not launch.direct_launch_available():
        pytest.skip("this Triton launches through kernel[grid] only")
    layer = _layer("nvfp4", 2048, 1024, bias=False)
    words, scales, gs = (getattr(layer, n) for n in layer._names[:3])
    gemv = MmaGemv(words, scales, gs)
    big = torch.randn(70 * 1024 + 8, device=DEV, dtype=torch.bfloat16)
    cases = [(m, off) for m in (1, 2, 16, 17, 32) for off in (0, 8)]
    for m, off in cases:
        gemv(big[off : off + m * 1024].view(m, 1024))
    for m, off in cases:
        x = big[off : off + m * 1024].view(m, 1024)
        launcher = gemv._plans[(m, True)][0]
        assert launcher._cache, (m, off)  # the direct launch is armed
        assert torch.equal(gemv(x), MmaGemv(words, scales, gs)(x)), (m, off)


@pytest.mark.parametrize(("fmt", "inter", "hidden"), [("nvfp4", 768, 2048), ("nvfp4", 1008, 512),
                                                     ("mxfp4", 512, 1024), ("fp8", 256, 512)])
def test_bound_moe_equals_the_op(fmt, inter, hidden):
    """QuantMoE's eager (bound) call against its custom op: the mma16x64 layout's regimes
    (single pairs, pair blocks, grouped GEMM) and the checkpoint layout (I not a multiple of
    64, FP8), every M twice (the second reuses the plan and the direct launches)."""
    from quantdispatch.layers import QuantMoE

    e, top_k = 16, 4
    g = torch.Generator(device=DEV).manual_seed(inter)

    def experts(n, k):
        return [QUANT[fmt](torch.randn(n, k, device=DEV, generator=g) * 0.02) for _ in range(e)]

    moe = QuantMoE(experts(inter, hidden), experts(inter, hidden), experts(hidden, inter),
                   top_k=top_k, settings=load_settings({}), device=DEV)  # fmt: skip
    for m in (1, 3, 16, 64, 700):
        x = torch.randn(m, hidden, device=DEV, dtype=torch.bfloat16)
        weights, ids = torch.topk(torch.softmax(torch.randn(m, e, device=DEV), -1), top_k)
        ids = ids.to(torch.int32)
        first = moe(x, topk_ids=ids, topk_weights=weights)
        second = moe(x, topk_ids=ids, topk_weights=weights)
        op = torch.ops.quantdispatch.moe(
            x, ids, weights.float(), moe._w13(), moe._w2(), moe.w13_bias, moe.w2_bias,
            moe.backend, moe.format, moe.activation, moe._params, moe._meta_args,
            moe.decision.pdl,
        )  # fmt: skip
        assert torch.equal(first, op) and torch.equal(second, op), (fmt, m)

"""GPU tests of the mma16x64 NVFP4 kernels (quantdispatch.kernels.mma_layout.gemv,
.dequant): GEMV / small-M
GEMM and the layout's dequantize pass, against float64 from the format definitions.

Bounds are test_linear_kernels_gpu.py's, through its ``check`` (bf16 1e-2, fp16 2e-3: the decode is
exact, only the output cast rounds). Outputs are NaN-poisoned so an unwritten element fails.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from tests.gpu.test_linear_kernels_gpu import check, fp4_w64, gen, nvfp4_weights, poison_torch_empty

pytestmark = pytest.mark.gpu

LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
OTHER = [(4096, 2048), (2048, 768), (2880, 2880), (48, 192)]  # Qwen3, gpt-oss, tiny (N != K)
MS = [1, 2, 7, 8, 9, 16, 31, 33, 64, 65, 100]  # 9..32: DEPTH 2 configs


@pytest.fixture(scope="module")
def mma():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run tests/gpu in its own process")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the mma16x64 kernels need SM 8.0+ (mma.sync m16n8k16 bf16)")
    from quantdispatch.kernels.mma_layout import dequant, gemv, layout

    return SimpleNamespace(
        mma_linear=gemv.mma_linear,
        mma_dequant_rows=dequant.mma_dequant_rows,
        repack=layout.repack,
        repack_mx=layout.repack_mx,
    )


@pytest.fixture(autouse=True)
def poisoned(monkeypatch, request):
    if "mma" in request.fixturenames:
        poison_torch_empty(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", LLAMA + OTHER, ids=lambda s: f"{s[0]}x{s[1]}")
def test_mma_linear_real_shapes(mma, shape, dtype):
    n, kk = shape
    g = gen(n + kk)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    w64 = fp4_w64(packed, sbits, 16, False, 2.5e-3)
    words, scales = mma.repack(packed, sbits, dtype)
    bias = torch.randn(n, generator=g, device="cuda")
    for m in MS:
        x = torch.randn(m, kk, generator=g, device="cuda").to(dtype)
        out = mma.mma_linear(x, words, scales, gs)
        check(out, x.double() @ w64.T, dtype)
        out = mma.mma_linear(x, words, scales, gs, bias)
        check(out, x.double() @ w64.T + bias.double(), dtype)


@pytest.mark.parametrize(
    "cfg",
    [
        (1, 1, 1, 1),
        (1, 1, 4, 4),
        (2, 2, 8, 2),
        (8, 4, 2, 1),
        (4, 1, 2, 4),
        (2, 8, 1, 2),
        (2, 4, 1, 1, 4),
        (1, 1, 8, 2, 2),
        (8, 4, 2, 1, 2),
        (4, 2, 2, 2, 4),
        (1, 2, 2, 2),  # the heuristic's gate_up config at M <= 8 (session 11)
        (2, 2, 2, 2, 2),  # and at M 9..16
        (1, 1, 8, 4, 1, 2),  # DEPTH 2: two steps of weight loads in flight, uneven K split
        (2, 1, 8, 2, 1, 2),
        (1, 2, 2, 2, 1, 2),
        (2, 1, 2, 1, 1, 2),  # DEPTH 2 with a step that divides the 46 chunks (no predicates)
        (1, 2, 2, 2, 2, 2),  # DEPTH 2 with R tiles
    ],
)
def test_every_config_and_uneven_k_split(mma, cfg):
    """Configs whose K split does not divide the chunks (predicated tail), M tiles past M, and
    R tiles per warp sharing the activation fragments."""
    n, kk = 2048, 2880 + 64  # 46 chunks
    g = gen(5)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    w64 = fp4_w64(packed, sbits, 16, False, 2.5e-3)
    words, scales = mma.repack(packed, sbits, torch.bfloat16)
    for m in (1, 5, 8 * cfg[0] + 3):
        x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        check(mma.mma_linear(x, words, scales, gs, config=cfg), x.double() @ w64.T, torch.bfloat16)


def test_strided_and_misaligned_activations(mma):
    n, kk = 4096, 4096
    g = gen(6)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    w64 = fp4_w64(packed, sbits, 16, False, 2.5e-3)
    words, scales = mma.repack(packed, sbits, torch.bfloat16)
    big = torch.randn(5, kk + 3, generator=g, device="cuda").to(torch.bfloat16)
    for x in (big[:, :kk], big[:, 1 : kk + 1], big.view(-1)[1 : 1 + 4 * kk].view(4, kk)):
        check(mma.mma_linear(x, words, scales, gs), x.double() @ w64.T, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dequant_rows_is_the_rounded_reference(mma, dtype):
    """The large-M slab: every weight exactly float64(w) rounded once to 16-bit."""
    n, kk = 1024, 2880 + 64
    g = gen(7)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    w64 = fp4_w64(packed, sbits, 16, False, 2.5e-3)
    words, scales = mma.repack(packed, sbits, dtype)
    out = torch.full((n - 32, kk), math.nan, dtype=dtype, device="cuda")
    mma.mma_dequant_rows(words, scales, gs, 16, n - 16, out)
    assert torch.equal(out, w64[16 : n - 16].to(dtype))


@pytest.mark.parametrize("warps", [2, 4, 8, 16])
def test_dequant_warp_counts_are_exact(mma, warps):
    """Every warp count the sweep tries, NVFP4 bf16 / fp16 and MXFP4 (two lanes per scale pair)
    through the pair stores: 46 chunks per row leave a ragged last program for all of them;
    rows 16.. only (tile0 > 0)."""
    from quantdispatch.kernels.mma_layout.dequant import MmaDequantRows

    n, kk = 256, 2880 + 64
    g = gen(17)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    w64 = fp4_w64(packed, sbits, 16, False, 2.5e-3)
    for dtype in (torch.bfloat16, torch.float16):
        words, scales = mma.repack(packed, sbits, dtype)
        out = torch.full((n - 32, kk), math.nan, dtype=dtype, device="cuda")
        MmaDequantRows(words, scales, gs, warps=warps)(16, n - 16, out)
        assert torch.equal(out, w64[16 : n - 16].to(dtype)), dtype
    packed, e8m0 = mx_weights(n, kk, g)
    w64 = fp4_w64(packed, e8m0, 32, True, None)
    words, scales, gs = mma.repack_mx(packed, e8m0, torch.bfloat16)
    out = torch.full((n - 32, kk), math.nan, dtype=torch.bfloat16, device="cuda")
    MmaDequantRows(words, scales, gs, warps=warps)(16, n - 16, out)
    assert torch.equal(out, w64[16 : n - 16].to(torch.bfloat16)), "mxfp4"


def test_cuda_graph_replay_equals_eager(mma):
    n, kk = 4096, 4096
    g = gen(8)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    words, scales = mma.repack(packed, sbits, torch.bfloat16)
    for m in (1, 16, 64):
        static_x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        mma.mma_linear(static_x, words, scales, gs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = mma.mma_linear(static_x, words, scales, gs)
        for _ in range(2):
            static_x.copy_(torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16))
            gs.mul_(1.5)  # the global scale is read on the device
            graph.replay()
            torch.testing.assert_close(
                static_out, mma.mma_linear(static_x, words, scales, gs), rtol=0, atol=0
            )


# ---- MXFP4 on the same layout (layout.repack_mx: scale pairs shared by lane pairs) ----


def mx_weights(n, kk, g, low=110, high=127):
    """Random codes, E8M0 bytes low..high (the layout holds 18 binades), the edges present."""
    u8 = {"generator": g, "dtype": torch.uint8, "device": "cuda"}
    packed = torch.randint(0, 256, (n, kk // 2), **u8)
    e8m0 = torch.randint(low, high + 1, (n, kk // 32), **u8)
    e8m0[0, 0], e8m0[min(1, n - 1), 0] = low, high
    return packed, e8m0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", LLAMA + OTHER, ids=lambda s: f"{s[0]}x{s[1]}")
def test_mx_mma_linear_real_shapes(mma, shape, dtype):
    n, kk = shape
    g = gen(3 * n + kk)
    packed, e8m0 = mx_weights(n, kk, g)
    w64 = fp4_w64(packed, e8m0, 32, True, None)
    words, scales, gs = mma.repack_mx(packed, e8m0, dtype)
    assert scales.shape[2] == 16
    bias = torch.randn(n, generator=g, device="cuda")
    for m in MS:
        x = torch.randn(m, kk, generator=g, device="cuda").to(dtype)
        check(mma.mma_linear(x, words, scales, gs), x.double() @ w64.T, dtype)
        out = mma.mma_linear(x, words, scales, gs, bias)
        check(out, x.double() @ w64.T + bias.double(), dtype)


@pytest.mark.parametrize(
    ("dtype", "low", "high"),
    [
        (torch.bfloat16, 14, 31),  # 2^-113 .. 2^-96: products stay normal bf16 / fp32
        (torch.bfloat16, 220, 237),  # .. 2^110: outputs stay finite
        (torch.float16, 100, 117),
        (torch.float16, 113, 130),
    ],
    ids=["bf16-small", "bf16-large", "fp16-small", "fp16-large"],
)
def test_mx_scale_spans_and_every_config(mma, dtype, low, high):
    """Full 18-binade spans far from 2^0 (the global scale carries the rest), through configs
    with R tiles, DEPTH 2 and an uneven K split (46 chunks), and the dequantize pass, exactly."""
    n, kk = 2048, 2944
    g = gen(low + 7)
    packed, e8m0 = mx_weights(n, kk, g, low, high)
    w64 = fp4_w64(packed, e8m0, 32, True, None)
    words, scales, gs = mma.repack_mx(packed, e8m0, dtype)
    for cfg in [(1, 1, 8, 4, 1, 2), (2, 2, 2, 2, 2), (1, 2, 2, 2), (4, 1, 4, 2, 2, 2)]:
        for m in (1, 8 * cfg[0] + 3):
            x = torch.randn(m, kk, generator=g, device="cuda").to(dtype)
            check(mma.mma_linear(x, words, scales, gs, config=cfg), x.double() @ w64.T, dtype)
    out = torch.full((256, kk), float("nan"), dtype=dtype, device="cuda")
    mma.mma_dequant_rows(words, scales, gs, 512, 768, out)
    assert torch.equal(out.double(), w64[512:768].to(dtype).double())

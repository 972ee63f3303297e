"""GPU tests of the tl.dot GEMM on the mma16x64 layout (quantdispatch.kernels.mma_layout.gemm):
the mid-M NVFP4 path on SM 9.x, against float64 from the format definitions.

Bounds are test_linear_kernels_gpu.py's, through its ``check`` (bf16 1e-2, fp16 2e-3). Every float
buffer the kernel allocates (the output and the K-range workspace) starts as NaN.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from tests.gpu.test_linear_kernels_gpu import check, fp4_w64, gen, nvfp4_weights, poison_torch_empty

pytestmark = pytest.mark.gpu

LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
OTHER = [(4096, 2048), (2048, 768), (2880, 2880)]  # Qwen3, gpt-oss (45 chunks: a half step)
MS = [17, 33, 64, 65, 100, 128, 150, 192, 200, 256, 300, 512]  # odd M: padded token tiles


@pytest.fixture(scope="module")
def mg():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run tests/gpu in its own process")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the mma16x64 layout needs SM 8.0+")
    from quantdispatch.kernels.mma_layout import activation_order, gemm, gemm_tiles

    return SimpleNamespace(
        GemmTile=gemm_tiles.GemmTile,
        mma_gemm_config=gemm_tiles.mma_gemm_config,
        kappa_order=activation_order.kappa_order,
        kappa_order_torch=activation_order.kappa_order_torch,
        mma_gemm=gemm.mma_gemm,
    )


@pytest.fixture(autouse=True)
def poisoned(monkeypatch, request):
    if "mg" in request.fixturenames:
        poison_torch_empty(monkeypatch)


def _weights(n, kk, dtype, seed):
    from quantdispatch.kernels.mma_layout import layout

    g = gen(seed)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    w64 = fp4_w64(packed, sbits, 16, False, 2.5e-3)
    words, scales = layout.repack(packed, sbits, dtype)
    return g, words, scales, gs, w64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", LLAMA + OTHER, ids=lambda s: f"{s[0]}x{s[1]}")
def test_real_shapes_heuristic_tiles(mg, shape, dtype):
    n, kk = shape
    g, words, scales, gs, w64 = _weights(n, kk, dtype, n + kk)
    bias = torch.randn(n, generator=g, device="cuda")
    for m in MS:
        x = torch.randn(m, kk, generator=g, device="cuda").to(dtype)
        check(mg.mma_gemm(x, words, scales, gs), x.double() @ w64.T, dtype)
        check(mg.mma_gemm(x, words, scales, gs, bias), x.double() @ w64.T + bias.double(), dtype)


@pytest.mark.parametrize(
    ("m", "k", "pad", "rows"),
    [(1, 4096, 0, None), (37, 14336, 0, None), (256, 2880, 64, None), (37, 4096, 0, 128)],
)
def test_the_permutation_kernel_equals_the_torch_copy(mg, m, k, pad, rows):
    """Also padded to whole token tiles (rows past M zero, written over NaN poison)."""
    x = torch.randn(m, k + pad, device="cuda").to(torch.bfloat16)[:, :k]
    torch.empty((rows or m) * k, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
    got = mg.kappa_order(x, rows=rows)
    assert got.is_contiguous() and torch.equal(got, mg.kappa_order_torch(x, rows))


@pytest.mark.parametrize(
    "tile",
    [(64, 32, 2, 4, 4, 4, None, True), (64, 64, 1, 4, 3, 3), (64, 128, 2, 4, 3, 4, None, True)],
    ids=["k4-tma", "k3", "64x128-k4-tma"],
)
def test_split_sums_are_deterministic_and_graph_safe(mg, tile):
    """K-split tiles (partial sums, then the split-sum launch, a programmatic-dependent chain on
    SM 9.0+): the same bits every call, and in a CUDA graph."""
    tile = mg.GemmTile(*tile)
    _needs_tma(mg, tile)
    n, kk = 2048, 2880
    g, words, scales, gs, w64 = _weights(n, kk, torch.bfloat16, 5)
    x = torch.randn(37, kk, generator=g, device="cuda").to(torch.bfloat16)
    first = mg.mma_gemm(x, words, scales, gs, tile=tile)
    check(first, x.double() @ w64.T, torch.bfloat16)
    for _ in range(10):
        assert torch.equal(mg.mma_gemm(x, words, scales, gs, tile=tile), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = mg.mma_gemm(x, words, scales, gs, tile=tile)
    for _ in range(3):
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, first)


TILES = [
    (64, 32, 2, 4, 4, 4),
    (128, 32, 2, 4, 4, 2),
    (64, 64, 2, 4, 4, 1),
    (128, 64, 2, 8, 3, 2),
    (128, 128, 2, 8, 3, 1),
    (128, 128, 2, 8, 3, 3),  # 45 chunks in ranges of 16, 16, 13
    (64, 128, 1, 4, 3, 5),
    (64, 64, 2, 4, 1, 1),
    # activations by TMA (rows past M and the half step past K arrive as zeros), with and
    # without a register cap
    (128, 128, 2, 8, 3, 1, None, True),
    (128, 128, 2, 8, 2, 3, 128, True),
    (64, 32, 2, 4, 4, 4, None, True),
    (128, 64, 1, 8, 3, 2, None, True),
]


def _needs_tma(mg, tile) -> None:
    if tile.tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA tiles need SM 9.0+ (mma_gemm refuses them elsewhere)")


@pytest.mark.parametrize(
    "tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}x{t[2]}x{t[3]}x{t[4]}-" + "-".join(map(str, t[5:]))
)
def test_every_tile_and_uneven_ranges(mg, tile):
    tile = mg.GemmTile(*tile)
    _needs_tma(mg, tile)
    n, kk = 2048, 2880  # 45 chunks: a half step, uneven K ranges
    g, words, scales, gs, w64 = _weights(n, kk, torch.bfloat16, 11)
    for m in (1, 31, 64, 129):
        x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        out = mg.mma_gemm(x, words, scales, gs, tile=tile)
        check(out, x.double() @ w64.T, torch.bfloat16)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_cuda_graph_replay_equals_eager(mg, tma):
    n, kk = 4096, 4096
    g, words, scales, gs, _ = _weights(n, kk, torch.bfloat16, 12)
    for m in (33, 64, 300):  # one K range; two (o at M <= 64: split 4); 128-token tiles
        tile = mg.mma_gemm_config(n, kk, m)
        if tma:  # the descriptor is made at capture and replayed with the graph's own buffer
            tile = dataclasses.replace(tile, tma=True)
            _needs_tma(mg, tile)
        static_x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        mg.mma_gemm(static_x, words, scales, gs, tile=tile)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = mg.mma_gemm(static_x, words, scales, gs, tile=tile)
        for _ in range(2):
            static_x.copy_(torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16))
            gs.mul_(1.5)  # the global scale is read on the device
            graph.replay()
            torch.testing.assert_close(
                static_out, mg.mma_gemm(static_x, words, scales, gs, tile=tile), rtol=0, atol=0
            )


def test_the_backend_takes_the_gemm_at_mid_m_on_sm90(mg):
    from quantdispatch.backends.base import Layout, Mma16x64Meta
    from quantdispatch.backends.triton.dispatch import linear_family
    from quantdispatch.kernels.common.device_facts import device_facts

    cap = torch.cuda.get_device_capability()
    facts, meta = device_facts(torch.device("cuda")), Mma16x64Meta(torch.bfloat16)
    paths = [
        linear_family("nvfp4", Layout.MMA16X64, meta, m, 4096, 4096, facts)
        for m in (16, 64, 256, 512)
    ]
    if cap[0] == 9:
        assert paths == ["mma GEMV", "wgmma GEMM", "wgmma GEMM", "dequantize + cuBLAS"]
    else:
        assert "wgmma GEMM" not in paths


@pytest.mark.parametrize(("shape", "m"), [((6144, 4096), 256), ((28672, 4096), 128)])
def test_tiles_that_raced_on_triton_36_match_float64(mg, shape, m):
    """Pipelined (3-stage) 64x128 TMA tiles returned wrong results on the H200 with Triton 3.6
    (relative error 1-2.5e-2, not every call: the next step's decode overwrote wgmma A registers
    still in flight, kernels/common/wgmma_guard.py). mma_gemm runs them with safe stages: every
    repetition matches float64 and equals the first bit for bit."""
    from quantdispatch.kernels.common.device_facts import device_facts
    from quantdispatch.kernels.mma_layout.gemm_tiles import GemmTile

    if not device_facts(torch.device("cuda")).tma:
        pytest.skip("TMA tiles need SM 9.0+ and Triton 3.3+")
    n, kk = shape
    g, words, scales, gs, w64 = _weights(n, kk, torch.bfloat16, 13)
    x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
    ref = x.double() @ w64.T
    tile = GemmTile(64, 128, 2, 4, 3, tma=True)
    first = mg.mma_gemm(x, words, scales, gs, tile=tile)
    check(first, ref, torch.bfloat16)
    for _ in range(10):
        torch.testing.assert_close(
            mg.mma_gemm(x, words, scales, gs, tile=tile), first, rtol=0, atol=0
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [*LLAMA, (2880, 2880)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_mxfp4_on_the_layout_heuristic_tiles(mg, shape, dtype):
    """MXFP4 repacked (kernels.mma_layout.layout.repack_mx: lane pairs share a scale pair): the
    heuristic tiles (TMA on SM 9.0+), K splits included, against float64."""
    from quantdispatch.kernels.mma_layout import layout

    n, kk = shape
    g = torch.Generator(device="cuda").manual_seed(n + 3 * kk)
    u8 = {"generator": g, "dtype": torch.uint8, "device": "cuda"}
    packed = torch.randint(0, 256, (n, kk // 2), **u8)
    e8m0 = torch.randint(105, 123, (n, kk // 32), **u8)
    w64 = fp4_w64(packed, e8m0, 32, True, None)
    words, scales, gs = layout.repack_mx(packed, e8m0, dtype)
    for m in (33, 100, 150, 256):
        x = torch.randn(m, kk, generator=g, device="cuda").to(dtype)
        check(mg.mma_gemm(x, words, scales, gs), x.double() @ w64.T, dtype)

"""The tl.dot GEMM on the mma16x64 layout (quantdispatch.kernels.mma_layout.gemm) on the CPU.

The interpreter runs no PTX: there the kernel decodes the same words with the same bit
operations in Triton integer ops (products in fp32), so these tests prove the Triton-level
plumbing (word and scale addressing, the joins and the permute that put every decoded register
at its row and MMA column, the K order of the activations, K ranges and their sum, masks for
M and for a K that is not a multiple of the step, bias and global scale) against float64 from
the format definitions. The PTX decode itself is the GEMV kernel's, proven bit-exact in
test_mma_layout.py; the kernel at real sizes on the GPU: tests/gpu/test_mma_layout_gemm_gpu.py.

Bounds (||out - ref|| / ||ref||): exact weights, fp32 sums, one rounding to the output dtype;
the interpreter truncates to bf16 (measured 3-4e-3), fp16 rounds (2e-4).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from ref64 import nvfp4_weight64  # noqa: E402

from quantdispatch.backends.base import Layout, Mma16x64Meta  # noqa: E402
from quantdispatch.backends.triton.dispatch import linear_family  # noqa: E402
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts  # noqa: E402
from quantdispatch.kernels.mma_layout import activation_order, gemm, gemm_tiles, layout  # noqa: E402

BOUND = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0x20, 0x7F, (n, k // 16), generator=g, dtype=torch.int32)
    scales[0] = torch.randint(1, 8, (k // 16,), generator=g)  # subnormal: 2^-9 .. 2^-7
    scales[1] = 0x7E  # 448, the largest
    scales[2, ::3] = 0  # zero blocks (their codes are dropped by the repack)
    return packed, scales.to(torch.uint8)


def _run(n, k, m, tile, dtype, seed, bias=True):
    packed, scales = _weight(n, k, seed)
    words, s = layout.repack(packed, scales, dtype)
    gs = torch.tensor([0.37], dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, k, generator=g) * 0.5).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    out = gemm.mma_gemm(x, words, s, gs, b, tile=tile)
    ref = x.double() @ nvfp4_weight64(packed, scales, 0.37).T
    if b is not None:
        ref = ref + b.double()
    assert out.dtype == dtype and out.shape == (m, n)
    assert bool(torch.isfinite(out).all())
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < BOUND[dtype], f"relative error {rel:.3g}"


def test_kappa_order_is_the_layout_permutation() -> None:
    k = 192
    x = torch.arange(3 * k, dtype=torch.float32).reshape(3, k)
    got = activation_order.kappa_order(x)
    for c in range(k // 64):
        for t in range(4):
            for j in range(4):
                for cc in range(2):
                    for h in range(2):
                        slot = 64 * c + 16 * j + 8 * cc + 2 * t + h
                        col = 64 * c + 16 * t + 4 * j + 2 * cc + h
                        assert torch.equal(got[:, slot], x[:, col])


@pytest.mark.parametrize(
    ("m", "k", "pad"), [(1, 64, 0), (3, 192, 0), (17, 512, 0), (5, 256, 64), (33, 2880, 0)]
)
def test_the_permutation_kernel_equals_the_torch_copy(m, k, pad) -> None:
    """kappa_order's GPU path (a Triton kernel over 32-bit pairs; here in the interpreter):
    rows past a program's block, K not a multiple of its 128-pair block, padded rows."""
    x = torch.randn(m, k + pad, dtype=torch.float32).to(torch.bfloat16)[:, :k]
    got = activation_order.kappa_order_triton(x)
    assert got.is_contiguous() and torch.equal(got, activation_order.kappa_order_torch(x))


@pytest.mark.parametrize(("m", "rows"), [(5, 16), (17, 64), (3, 3)])
def test_the_permutation_pads_to_whole_token_tiles_with_zeros(m, rows, monkeypatch) -> None:
    """``rows``: the copy the TMA tiles read is whole BLOCK_M tiles high (a box never runs past
    the last row); the rows past M are written as zeros by the kernel itself, over poison."""
    x = torch.randn(m, 256, dtype=torch.float32).to(torch.bfloat16)
    want = torch.cat(
        [activation_order.kappa_order_torch(x), torch.zeros(rows - m, 256, dtype=x.dtype)]
    )
    assert torch.equal(activation_order.kappa_order_torch(x, rows), want)
    poison = torch.full((rows, 256), float("nan"), dtype=x.dtype)
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison)  # the kernel's output buffer
    got = activation_order.kappa_order_triton(x, rows=rows)
    monkeypatch.undo()
    assert got.shape == (rows, 256) and torch.equal(got, want)


def test_the_permutation_kernel_refuses_what_it_cannot_permute() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        activation_order.kappa_order_triton(torch.zeros(2, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16-bit"):
        activation_order.kappa_order_triton(torch.zeros(2, 64, dtype=torch.float32))
    with pytest.raises(ValueError, match="rows=2 is fewer"):
        activation_order.kappa_order_triton(torch.zeros(3, 64, dtype=torch.bfloat16), rows=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("n", "k", "m", "tile"),
    [
        (64, 128, 5, gemm_tiles.GemmTile(32, 16, 2, 4, 1)),  # M < the token tile
        (
            32,
            192,
            20,
            gemm_tiles.GemmTile(32, 16, 2, 4, 1),
        ),  # 3 chunks: a half step at the end; N != K
        (48, 64, 33, gemm_tiles.GemmTile(16, 16, 1, 4, 1)),  # 3 token tiles, one partial
        (32, 320, 7, gemm_tiles.GemmTile(32, 16, 2, 4, 1, split=2)),  # 5 chunks in ranges of 4 + 1
        (32, 576, 7, gemm_tiles.GemmTile(16, 16, 2, 4, 1, split=4)),  # 9 chunks: ranges 4, 4, 1
        (32, 256, 17, gemm_tiles.GemmTile(32, 16, 1, 4, 1, split=3)),  # 4 chunks in 3 ranges
    ],
    ids=["m5", "k192", "m33", "split2", "split4", "split3"],
)
def test_matches_float64(n, k, m, tile, dtype) -> None:
    _run(n, k, m, tile, dtype, seed=n + k + m)


def test_without_bias_and_heuristic_tile() -> None:
    _run(64, 128, 3, None, torch.bfloat16, seed=3, bias=False)


def test_rejects_a_tile_that_does_not_divide_n() -> None:
    packed, scales = _weight(48, 64, 1)
    words, s = layout.repack(packed, scales, torch.bfloat16)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="BLOCK_N=32 does not divide N=48"):
        gemm.mma_gemm(x, words, s, torch.ones(1), tile=gemm_tiles.GemmTile(32, 16, 1, 4, 1))
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        gemm.mma_gemm(torch.zeros(2, 128, dtype=torch.bfloat16), words, s, torch.ones(1))


@pytest.mark.parametrize(
    "tile",
    [
        gemm_tiles.GemmTile(128, 128, 2, 8, 3),
        gemm_tiles.GemmTile(64, 64, 2, 4, 4, split=4),
        gemm_tiles.GemmTile(128, 128, 2, 8, 2, maxnreg=128),
        gemm_tiles.GemmTile(64, 32, 1, 4, 3, split=2, maxnreg=168),
        gemm_tiles.GemmTile(128, 128, 2, 8, 3, tma=True),
        gemm_tiles.GemmTile(64, 64, 2, 4, 4, split=2, maxnreg=128, tma=True),
    ],
    ids=lambda t: t.label(),
)
def test_tile_labels_parse_back(tile) -> None:
    assert gemm_tiles.parse_tile(tile.label()) == tile


@pytest.mark.parametrize(
    "text", ["128x128x100w8s3", "128x128w8s3", "128x128x128w8", "", "128x128x128w8s3tk2"]
)
def test_parse_tile_rejects_malformed_labels(text) -> None:
    with pytest.raises(ValueError, match="expected BNxBMxBKwWsS"):
        gemm_tiles.parse_tile(text)


def test_the_heuristic_takes_tma_only_where_it_runs() -> None:
    assert not device_facts(torch.device("cpu")).tma
    _run(64, 128, 40, None, torch.bfloat16, seed=12)  # heuristic tile on the CPU: pointer loads


def test_tma_tiles_are_refused_off_hopper() -> None:
    """The TMA variant needs an SM 9.0+ GPU: elsewhere a clear error naming the fix."""
    packed, scales = _weight(64, 128, 1)
    words, s = layout.repack(packed, scales, torch.bfloat16)
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    tile = gemm_tiles.GemmTile(32, 16, 2, 4, 1, tma=True)
    with pytest.raises(ValueError, match=r"by TMA, which needs an SM 9.0\+ GPU.*without the 't'"):
        gemm.mma_gemm(x, words, s, torch.ones(1), tile=tile)


def test_a_register_cap_leaves_the_result_unchanged() -> None:
    """maxnreg is a launch option (the interpreter ignores it): the numbers must not change."""
    _run(64, 128, 5, gemm_tiles.GemmTile(32, 16, 2, 4, 1, maxnreg=128), torch.bfloat16, seed=11)


@pytest.mark.parametrize("n", [64, 192, 2880, 4096, 6144, 28672, 32768])
@pytest.mark.parametrize("k", [768, 2880, 4096, 14336])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_configs_fit_the_shape(n, k, tma) -> None:
    for m in (17, 32, 33, 64, 65, 128, 129, 256, 512):
        tile = gemm_tiles.mma_gemm_config(n, k, m, tma=tma)
        assert tile.tma == tma
        assert n % tile.block_n == 0
        assert tile.block_n == 16 * tile.warps or (tile.block_n, tile.warps) == (128, 4)
        assert tile.block_m in (32, 64, 128) and tile.block_m <= max(32, 2 * m)
        assert tile.split >= 1 and tile.chunks in (1, 2)


@pytest.mark.parametrize(
    ("n", "k", "m", "label"),
    [  # the H200 winners the TMA table encodes (docs/design/wgmma-gemm.md)
        (28672, 4096, 128, "64x128x128w4s3t"),  # gate_up
        (6144, 4096, 128, "64x128x128w4s3k2t"),  # qkv
        (4096, 14336, 128, "64x128x128w4s3k4t"),  # down
        (4096, 4096, 128, "64x128x128w4s3k4t"),  # o
        (6144, 4096, 160, "64x128x128w4s3t"),  # padded token tiles: 128 at 129..192 too
        (28672, 4096, 192, "64x128x128w4s3t"),
        (4096, 14336, 160, "64x128x128w4s3k2t"),
        (4096, 14336, 256, "64x128x128w4s3k2t"),
        (4096, 4096, 256, "64x128x128w4s3k2t"),  # o
        (6144, 4096, 256, "64x128x128w4s3t"),
        (28672, 4096, 64, "128x64x128w8s3t"),
    ],
)
def test_tma_table_holds_the_measured_winners(n, k, m, label) -> None:
    assert gemm_tiles.mma_gemm_config(n, k, m, tma=True).label() == label


def test_paths_by_m_and_gpu() -> None:
    """The regime table's mma16x64 rows, as the run path reads them."""
    meta = Mma16x64Meta(torch.bfloat16)
    h200, a100 = DeviceFacts.for_capability((9, 0)), DeviceFacts.for_capability((8, 0))

    def path(m, n, k, facts):
        family = linear_family("nvfp4", Layout.MMA16X64, meta, m, n, k, facts)
        return {"mma GEMV": "mma", "wgmma GEMM": "gemm", "dequantize + cuBLAS": "dequant"}[family]

    # a 2^25+ element weight (gate_up): mma kernel to 16 rows, GEMM to 512, then dequantize
    assert [path(m, 28672, 4096, h200) for m in (1, 16, 17, 512, 513)] == [
        "mma",
        "mma",
        "gemm",
        "gemm",
        "dequant",
    ]
    # a smaller one (qkv): mma kernel to 32 rows, GEMM to 256
    assert [path(m, 6144, 4096, h200) for m in (32, 33, 256, 257)] == [
        "mma",
        "gemm",
        "gemm",
        "dequant",
    ]
    # N not a multiple of 64: no GEMM
    assert path(100, 48, 4096, h200) == "dequant"
    # SM 8.x (not measured there): the mma kernel to 64 / 128 rows, then dequantize
    assert [path(m, 6144, 4096, a100) for m in (64, 65)] == ["mma", "dequant"]
    assert [path(m, 28672, 4096, a100) for m in (128, 129)] == ["mma", "dequant"]
    assert path(64, 6144, 4096, DeviceFacts.for_capability(None)) == "mma"

"""MXFP4 weights on the mma16x64 layout (quantdispatch.kernels.mma_layout.layout.repack_mx) on the
CPU.

The layout keeps the checkpoint's bytes (0.5 + 1/32 per weight: one scale pair per group of 32
read by two lanes) and re-encodes the E8M0 scales as the NVFP4 layout's u codes relative to the
weight's largest, the rest going into a power-of-two global scale. These tests prove, against
float64 from the format definition: the decode the kernels perform (emulated bit for bit)
gives every weight exactly, for bf16 and fp16, at the edges of the 18-binade span; all-zero
blocks do not count towards the span; what cannot be held exactly is refused with a clear
error; and the tl.dot GEMM (interpreter) reads the shared scale pairs right. The GEMV and
dequantize kernels run PTX: tests/gpu/test_mma_layout_gemv_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from ref64 import mxfp4_weight64

from quantdispatch.errors import WeightFormatError
from quantdispatch.kernels.mma_layout import gemm, gemm_tiles, layout

DTYPES = [torch.bfloat16, torch.float16]


def _mx_weight(n: int, k: int, seed: int, low: int = 110, high: int = 127) -> tuple:
    """Random codes and E8M0 bytes in low..high (span high - low + 1 binades), with the edges
    present and an all-zero block carrying the byte 0 (2^-127)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    e8m0 = torch.randint(low, high + 1, (n, k // 32), generator=g, dtype=torch.int32)
    e8m0[0, 0], e8m0[1, 0] = low, high
    packed[2, :16] = 0x88  # block (2, 0): codes -0 / +0 only
    e8m0[2, 0] = 0
    return packed, e8m0.to(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("low", "high"), [(110, 127), (0, 17), (237, 254), (127, 127)])
def test_the_layout_decodes_every_weight_exactly(dtype, low, high) -> None:
    packed, e8m0 = _mx_weight(48, 192, low + high, low, high)
    words, scales, gs = layout.repack_mx(packed, e8m0, dtype)
    assert words.shape == (3, 3, 32, 4) and scales.shape == (3, 3, 16, 2)
    assert words.numel() * 4 + scales.numel() == 48 * 192 * (0.5 + 1 / 32)  # checkpoint bytes
    got = layout.decode_emulated(words, scales, dtype) * (float(gs) * 256)
    assert torch.equal(got, mxfp4_weight64(packed, e8m0))


def test_scales_spanning_more_than_the_layout_holds_are_refused() -> None:
    packed, e8m0 = _mx_weight(16, 64, 1, 100, 117)
    layout.repack_mx(packed, e8m0, torch.bfloat16)  # 18 binades: held
    e8m0[3, 1] = 99
    with pytest.raises(WeightFormatError, match=r"span 2\^-28 \.\. 2\^-10 \(19 binades\)"):
        layout.repack_mx(packed, e8m0, torch.bfloat16)


def test_nan_scales_and_wrong_shapes_are_refused() -> None:
    packed, e8m0 = _mx_weight(16, 64, 2)
    e8m0[0, 1] = 255
    with pytest.raises(WeightFormatError, match="E8M0 NaN code 255"):
        layout.repack_mx(packed, e8m0, torch.bfloat16)
    with pytest.raises(WeightFormatError, match=r"needs N % 16 == 0, K % 64 == 0 and scales"):
        layout.repack_mx(packed[:8], e8m0[:8], torch.bfloat16)
    with pytest.raises(WeightFormatError, match=r"scales \[N, K/32\]"):
        layout.repack_mx(packed, e8m0[:, :1], torch.bfloat16)


def test_a_weight_of_zeros_repacks() -> None:
    packed = torch.zeros(16, 32, dtype=torch.uint8)
    e8m0 = torch.tensor([[0, 254]] * 16, dtype=torch.uint8)
    words, scales, gs = layout.repack_mx(packed, e8m0, torch.float16)
    assert not bool(layout.decode_emulated(words, scales, torch.float16).any())
    assert torch.isfinite(gs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("n", "k", "m", "tile"),
    [
        (32, 192, 20, gemm_tiles.GemmTile(32, 16, 2, 4, 1)),  # 3 chunks: a half step; N != K
        (48, 256, 9, gemm_tiles.GemmTile(16, 16, 1, 4, 1, split=3)),  # 4 chunks in 3 ranges
    ],
    ids=["k192", "split3"],
)
def test_the_gemm_reads_the_shared_scale_pairs(n, k, m, tile, dtype) -> None:
    packed, e8m0 = _mx_weight(n, k, n + k + m)
    words, scales, gs = layout.repack_mx(packed, e8m0, dtype)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    out = gemm.mma_gemm(x, words, scales, gs, bias, tile=tile)
    ref = x.double() @ mxfp4_weight64(packed, e8m0).T + bias.double()
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-3), f"relative error {rel:.3g}"


def test_unpack_refuses_an_mxfp4_layout() -> None:
    packed, e8m0 = _mx_weight(16, 64, 3)
    words, scales, _ = layout.repack_mx(packed, e8m0, torch.bfloat16)
    with pytest.raises(ValueError, match="unpack takes NVFP4 mma16x64 layouts"):
        layout.unpack(words, scales, torch.bfloat16)

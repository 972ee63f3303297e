"""The large-M path (dequantize a slab, then GEMM) against float64, in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from ref64 import (
    fp8_weight64,
    linear64,
    mxfp4_weight64,
    nvfp4_weight64,
    random_codes,
    random_e4m3_scales,
    rel_err,
)

triton = pytest.importorskip("triton", reason="the dequant kernels are Triton kernels")

from quantdispatch.kernels.checkpoint_layout import dequant  # noqa: E402
from quantdispatch.kernels.common import slabs  # noqa: E402

BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # weight and output each rounded once


@pytest.fixture
def small_workspace(monkeypatch):
    """A tiny slab, so several slabs (and a ragged last one) are exercised."""
    monkeypatch.setattr(slabs, "WORKSPACE_ELEMENTS", 40 * 96)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_and_mxfp4(small_workspace, dtype):
    g = torch.Generator().manual_seed(1)
    n, k, m = 100, 96, 5  # 40-row slabs: 40 + 40 + 20; K not a multiple of the 128-wide block
    packed = random_codes(n, k, g)
    bs = random_e4m3_scales((n, k // 16), g)
    gs = torch.tensor(0.0173)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)

    def rows(a, b, out):
        dequant.dequant_fp4_rows(
            packed[a:b], bs.view(torch.uint8)[a:b], gs, out, scale_format="e4m3"
        )

    out = slabs.dequant_gemm(x, n, k, rows, bias)
    assert rel_err(out, linear64(x, nvfp4_weight64(packed, bs, gs), bias)) < BOUND[dtype]

    e8 = torch.randint(118, 134, (n, k // 32), generator=g).to(torch.uint8)

    def rows_mx(a, b, out):
        dequant.dequant_fp4_rows(packed[a:b], e8[a:b], None, out, scale_format="e8m0")

    out = slabs.dequant_gemm(x, n, k, rows_mx)
    assert rel_err(out, linear64(x, mxfp4_weight64(packed, e8))) < BOUND[dtype]


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8(small_workspace, kind):
    g = torch.Generator().manual_seed(2)
    n, k, m = 100, 96, 3
    w = (torch.randn(n, k, generator=g) * 60).to(torch.float8_e4m3fn)
    block = (32, 64) if kind == "block" else None
    scale = {
        "tensor": torch.tensor(0.011),
        "channel": torch.rand(n, generator=g) + 0.01,
        "block": torch.rand(4, 2, generator=g) + 0.01,
    }[kind]
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)

    def rows(a, b, out):
        dequant.dequant_fp8_rows(w.view(torch.uint8)[a:b], scale, a, out, block_size=block)

    out = slabs.dequant_gemm(x, n, k, rows)
    assert rel_err(out, linear64(x, fp8_weight64(w, scale, block))) < BOUND[torch.bfloat16]

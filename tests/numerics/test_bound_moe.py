"""The triton backend's bound MoE call (quantdispatch.backends.triton.bind.bind_moe) on the CPU
interpreter: the same bits as the op path (run.moe: the plan per call, then the layout's
launcher) for NVFP4, MXFP4 and FP8 experts on the checkpoint layout, with biases, at several M
and twice per M (the second call reuses the plan); and within the float64 oracle's bound. The
repacked layer the bound path builds (MmaLayoutMoe) against its launcher."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from ref64 import rel_err  # noqa: E402
from test_checkpoint_layout_moe import routing, stacked  # noqa: E402
from test_moe import make_experts, moe64, rand_x  # noqa: E402

from quantdispatch.backends import get_backend  # noqa: E402
from quantdispatch.backends.base import CheckpointMeta, Layout, MoeCall  # noqa: E402
from quantdispatch.backends.triton import run  # noqa: E402
from quantdispatch.kernels.common import checks  # noqa: E402

if not checks.interpreting():
    pytest.skip("runs the kernels in the interpreter (tests/gpu covers the GPU)",
                allow_module_level=True)  # fmt: skip


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_bound_moe_equals_the_op_path(fmt):
    e, hidden, inter, top_k = 4, 64, 32, 2
    ex = make_experts(fmt, e, hidden, inter, seed=3)
    w13, w2, block = stacked(ex)
    g = torch.Generator().manual_seed(5)
    b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)
    template = MoeCall(
        torch.empty(0), torch.empty(0), torch.empty(0), tuple(w13), tuple(w2), b13, b2, fmt,
        "silu", (), Layout.CHECKPOINT, CheckpointMeta(block_size=block), True,
    )  # fmt: skip
    bound = get_backend("triton").bind_moe(template)
    for m in (1, 5):
        x = rand_x(m, hidden, torch.bfloat16, seed=m)
        ids, w = routing(m, e, top_k, seed=m)
        op = run.moe(MoeCall(x, ids, w, *list(template.__dict__.values())[3:]))
        first, second = bound(x, ids, w), bound(x, ids, w)
        assert torch.equal(first, op) and torch.equal(second, op), (fmt, m)
        want = moe64(x, ids, w, ex.w13, ex.w2, b13=b13, b2=b2)
        assert rel_err(second, want) < 3e-2, (fmt, m)


def test_bound_repacked_layer_equals_the_launcher():
    """The repacked layer bound once (MmaLayoutMoe, the bound path's mma16x64 experts) gives
    mma_layout_moe's bits for the same config (the grouped GEMM: the regime the interpreter
    runs), biases and the clamped SwiGLU included."""
    from test_mma_layout_moe import repacked

    from quantdispatch.kernels.common.moe_stages import ExpertWeights
    from quantdispatch.kernels.mma_layout.moe_bound import MmaLayoutMoe
    from quantdispatch.kernels.mma_layout.moe_gemm import mma_layout_moe
    from quantdispatch.kernels.mma_layout.moe_plan import MoeGemmTile

    e, hidden, inter, top_k, dt = 4, 128, 64, 2, torch.bfloat16
    r13, r2, _, _ = repacked(make_experts("nvfp4", e, hidden, inter, seed=7), dt)
    g = torch.Generator().manual_seed(8)
    b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)
    kw = dict(activation="swiglu_oai", params=(1.5, 1.0), packed_for=dt)
    layer = MmaLayoutMoe(ExpertWeights(r13, r2, b13, b2), **kw)
    x = rand_x(6, hidden, dt, seed=9)
    ids, w = routing(6, e, top_k, seed=10)
    cfg = MoeGemmTile(16, stages=2)
    want = mma_layout_moe(x, ids, w, r13, r2, b13, b2, config=cfg, **kw)
    assert torch.equal(layer(x, ids, w, cfg), want)

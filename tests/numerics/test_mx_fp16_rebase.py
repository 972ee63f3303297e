"""MXFP4 in fp16 on the checkpoint layout: E8M0 scales reach 2^127, fp16 ends at 65504.

The checkpoint-layout kernels and the dequantized slabs round the decoded weight to the
activation dtype; in fp16 a block scale of 2^14+ made inf and one below 2^-23 flushed to zero,
silently. prepare rebases such scales (formats.mxfp4.rebase_mx_scales_for_fp16), the
factor 2^d goes to the fused kernels' fp32 accumulator, and such a weight keeps those kernels
at every M. Checked here against float64 on the CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the checkpoint-layout kernels are Triton kernels")

from dataclasses import replace

from quantdispatch.backends import get_backend
from quantdispatch.backends.base import CheckpointMeta, ExpertStacks, Layout, LinearBinding
from quantdispatch.backends.triton import run
from quantdispatch.formats.mxfp4 import Mxfp4Weight, rebase_mx_scales_for_fp16
from quantdispatch.kernels import regimes
from quantdispatch.request import Request

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def weight64(packed: torch.Tensor, e8: torch.Tensor) -> torch.Tensor:
    p = packed.long()
    codes = torch.stack((p & 0xF, p >> 4), -1).flatten(-2)
    v = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    return v * torch.pow(2.0, e8.double() - 127).repeat_interleave(32, -1)


def mx_weight(n: int, k: int, lo: int, hi: int, seed: int) -> Mxfp4Weight:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    e8 = torch.randint(lo, hi + 1, (n, k // 32), generator=g, dtype=torch.uint8)
    return Mxfp4Weight(packed=packed, block_scale=e8)


@pytest.mark.parametrize(("lo", "hi", "d"), [(104, 140, 0), (103, 140, 0), (104, 141, 1)])
def test_the_fp16_window_edges(lo, hi, d):
    """2^-23 .. 2^13 is kept as is; one binade past the top shifts by one; one past the bottom
    with the top at 2^13 has nowhere to go (d = 0, the 2^-24 blocks round in fp16)."""
    w = mx_weight(16, 64, lo, hi, 1)
    e8 = w.block_scale.clone()
    e8[0, 0], e8[0, 1] = lo, hi  # both ends present
    codes, got = rebase_mx_scales_for_fp16(w.packed, e8)
    assert got == d
    if d == 0:
        assert codes is e8


@pytest.mark.parametrize(("lo", "hi", "d"), [(140, 150, 10), (60, 70, -70), (100, 150, 10)])
def test_out_of_range_scales_are_rebased(lo, hi, d):
    """Largest scale to 2^13; codes shifted by d, clamped at 0 (blocks 36+ binades below)."""
    w = mx_weight(16, 64, lo, hi, 2)
    e8 = w.block_scale.clone()
    e8[0, 0] = hi  # the largest code present
    codes, got = rebase_mx_scales_for_fp16(w.packed, e8)
    assert got == d
    assert torch.equal(codes.int(), (e8.int() - d).clamp(0, 254))


def test_all_zero_blocks_do_not_set_the_rebase():
    """A block whose codes are all (signed) zero has no product whatever its scale."""
    w = mx_weight(16, 64, 120, 130, 3)
    packed, e8 = w.packed.clone(), w.block_scale.clone()
    packed[0, :16] = 0x88  # block (0, 0): -0 / -0 codes
    e8[0, 0] = 250
    assert rebase_mx_scales_for_fp16(packed, e8)[1] == 0


def test_all_zero_blocks_of_a_rebased_weight_stay_zero():
    """Tiny scales shift up (d < 0); an all-zero block coded 127 (what quantizers write) must
    not shift to 241+, where the fp32 scale saturates to inf and 0 x inf made its row NaN."""
    n, k = 48, 128
    w = mx_weight(n, k, 90, 100, 7)
    packed, e8 = w.packed.clone(), w.block_scale.clone()
    packed[3, :16] = 0  # row 3, block 0: all codes zero
    e8[3, 0] = 127
    codes, d = rebase_mx_scales_for_fp16(packed, e8)
    assert d < 0 and int(codes[3, 0]) == 0
    backend = get_backend("triton")
    req = Request.make("mxfp4", act_dtype=torch.float16, n=n, k=k)
    prepared = backend.prepare(Mxfp4Weight(packed=packed, block_scale=e8), req)
    x = (torch.randn(5, k, generator=torch.Generator().manual_seed(8)) * 2.0**12).half()
    out = backend.linear(x, LinearBinding.of(prepared, "mxfp4"))
    ref = x.double() @ weight64(packed, e8).T
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-3


@pytest.mark.parametrize("m", [3, 40], ids=["small-m", "large-m"])
@pytest.mark.parametrize(("lo", "hi"), [(141, 145), (96, 103)], ids=["2^14..2^18", "2^-31..2^-24"])
def test_triton_backend_fp16_matches_float64(monkeypatch, m, lo, hi):
    """prepare rebases; linear runs the fused kernel, also where M would take dequantized
    fp16 slabs (forced here at M=40: the rebased weight must not), and lands on the float64
    result with no inf."""
    if m == 40:  # every other checkpoint-layout FP4 weight dequantizes from M = 1 here
        rows = tuple(
            replace(r, steps=(replace(r.steps[0], max_m=0), r.steps[1]), large=None)
            if r.layout == "checkpoint" and "mxfp4" in r.formats and r.when is None
            else r
            for r in regimes.LINEAR_REGIMES
        )
        monkeypatch.setattr(regimes, "LINEAR_REGIMES", rows)
        plain = regimes.linear_regime("mxfp4", "checkpoint", None, 48, 128)
        assert plain.family(m, 48, 128) is regimes.Family.DEQUANT_CUBLAS

        def no_slabs(*a, **kw):
            raise AssertionError("a rebased MXFP4 weight took the dequantized fp16 slabs")

        monkeypatch.setattr(run, "dequant_gemm", no_slabs)
    n, k = 48, 128
    w = mx_weight(n, k, lo, hi, 4)
    backend = get_backend("triton")
    req = Request.make("mxfp4", act_dtype=torch.float16, n=n, k=k)
    prepared = backend.prepare(w, req)
    assert prepared.layout is Layout.CHECKPOINT
    assert prepared.meta == CheckpointMeta(fp16_rebased=True)
    g = torch.Generator().manual_seed(5)
    # outputs of a few units: |x| ~ 2^-14 against 2^14..2^18 scales, 2^12 against 2^-31..2^-24
    x = (torch.randn(m, k, generator=g) * (2.0**-14 if lo > 127 else 2.0**12)).to(torch.float16)
    w64 = weight64(w.packed, w.block_scale)
    y64 = x.double() @ w64.T
    bias = (torch.randn(n, generator=g).double() * y64.std()).to(torch.float16)  # same scale
    out = backend.linear(x, LinearBinding.of(prepared, "mxfp4", bias))
    ref = y64 + bias.double()
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-3


def test_fp16_moe_experts_outside_fp16_are_refused_with_the_fix():
    """The checkpoint layout's fused MoE kernels (SM75, or scales too wide for the mma layout)
    have no rebase: such fp16 experts get an error naming the range and the fix, not inf."""
    from quantdispatch.errors import WeightFormatError

    e, h, i = 2, 64, 64
    g = torch.Generator().manual_seed(6)

    def stack(n, k, lo, hi):
        packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
        return packed, torch.randint(lo, hi + 1, (e, n, k // 32), generator=g, dtype=torch.uint8)

    backend = get_backend("triton")
    req = Request.make("mxfp4", op="moe", act_dtype=torch.float16, experts=e)
    names = ("packed", "block_scale")
    ok13, ok2 = stack(2 * i, h, 120, 130), stack(h, i, 120, 130)
    backend.prepare_moe(ExpertStacks(ok13, ok2, names, CheckpointMeta(), True), req)
    bad2 = (ok2[0], ok2[1].clone())
    bad2[1][1, 0, 0] = 150  # expert 1 of w2: 2^23
    with pytest.raises(
        WeightFormatError, match=r"expert 1 of w2 has block scales 2\^-7 \.\. 2\^23"
    ):
        backend.prepare_moe(ExpertStacks(ok13, bad2, names, CheckpointMeta(), True), req)
    low13 = (ok13[0], ok13[1].clone())
    low13[1][0, 5, 1] = 97  # expert 0 of w13: 2^-30 at the bottom, the top inside: refused too
    with pytest.raises(WeightFormatError, match=r"expert 0 of w13 has block scales 2\^-30"):
        backend.prepare_moe(ExpertStacks(low13, ok2, names, CheckpointMeta(), True), req)
    bf16 = Request.make("mxfp4", op="moe", act_dtype=torch.bfloat16, experts=e)
    # bf16 holds 2^23
    backend.prepare_moe(ExpertStacks(ok13, bad2, names, CheckpointMeta(), True), bf16)

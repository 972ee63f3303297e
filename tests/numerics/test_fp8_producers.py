"""The fused FP8 producers (RMSNorm, SiLU x mul) in the Triton interpreter, and the handoff
that lets every FP8 linear reading one activation share its codes.

The 16-bit outputs are checked against float64 formulas rounded where the eager modules round
(at most two 16-bit steps apart on a few elements: the kernels add the squares in fp32 and use
fp32 exp / sqrt); the codes and scales bit-equal with the float64 rule
(fp8_prefill_ref.encode64) applied to the output the kernel wrote, padding rows included."""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")
from fp8_prefill_ref import encode64

from quantdispatch.backends.triton.fp8_compute import handoff_in_use
from quantdispatch.errors import InputError
from quantdispatch.integrations.transformers import fp8_handoff
from quantdispatch.kernels.native import fp8_prefill as fp8p
from quantdispatch.kernels.native.fp8_producers import rmsnorm, rmsnorm_fp8, silu_mul_fp8

F64 = torch.float64


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many 16-bit steps apart two same-dtype tensors are (0 where both are NaN)."""
    ia = a.view(torch.int16).to(torch.int64)
    ib = b.view(torch.int16).to(torch.int64)
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude -> ordered
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    both_nan = torch.isnan(a) & torch.isnan(b)
    return torch.where(both_nan, 0, (ia - ib).abs())


def check_codes(y: torch.Tensor, codes) -> None:
    """codes / scale_a are the rule's for y (M padded to 16 with zero rows)."""
    q, scale = codes
    m, k = y.shape
    mp = -(-m // 16) * 16
    assert q.shape == (mp, k) and q.dtype == torch.float8_e4m3fn
    assert scale.shape == (mp, k // 128) and scale.stride() == (1, mp)
    yp = torch.cat([y.to(F64), torch.zeros(mp - m, k, dtype=F64)])
    codes64, scale64 = encode64(yp, 1, 128)
    assert torch.equal(q.view(torch.uint8).to(torch.int64), codes64)
    assert torch.equal(scale.to(F64), scale64)


def rmsnorm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm.forward in float64, rounded to x's dtype where the module rounds
    (after the normalization, after the weight: a 16-bit x 16-bit product is exact in fp32)."""
    h = x.to(F64)
    n = (h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w.to(F64) * n.to(F64)).to(x.dtype)


def silu_mul64(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in float64, rounded to the dtype after silu and after the product."""
    g = gate.to(F64)
    s = (g / (1 + torch.exp(-g))).to(gate.dtype)
    return (s.to(F64) * up.to(F64)).to(gate.dtype)


def inputs(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    x[0, :7] = 0.0
    if m > 3:
        x[3] = 0.0  # an all-zero row: scale 0, zero codes
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(5, 256), (19, 384)])
def test_rmsnorm_fp8(dtype, m, k):
    x = inputs(m, k, dtype, m + k)
    w = (torch.randn(k, generator=torch.Generator().manual_seed(1)) * 0.5 + 1).to(dtype)
    w[:3] = torch.tensor([0.0, -2.0, 2.0**-8])
    eps = 1e-6
    y, codes = rmsnorm_fp8(x, w, eps)
    ref = rmsnorm64(x, w, eps)
    d = ulps_apart(y, ref)
    assert int(d.max()) <= 2 and float((d > 0).double().mean()) < 0.02
    check_codes(y, codes)
    y2, none = rmsnorm_fp8(x, w, eps, quantize=False)
    assert none is None and torch.equal(y2, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(5, 256), (3, 200), (4, 64)], ids=["blocks", "k200", "k64"])
@pytest.mark.parametrize("quantize", [False, True])
def test_rmsnorm_with_the_residual_add(dtype, m, k, quantize):
    """s = x + r rounded once (bit-equal with eager's add), then the norm of s; any width
    without FP8 codes (Qwen3's head-dim norms, odd hidden sizes), 128-column blocks with."""
    if quantize and k % 128:
        pytest.skip("FP8 codes come in 128-column blocks")
    x = inputs(m, k, dtype, m + k)
    r = inputs(m, k, dtype, 3 * k) * 4
    w = (torch.randn(k, generator=torch.Generator().manual_seed(2)) * 0.5 + 1).to(dtype)
    y, s, codes = rmsnorm(x, w, 1e-5, residual=r, quantize=quantize)
    assert torch.equal(s, x + r)
    d = ulps_apart(y, rmsnorm64(s, w, 1e-5))
    assert int(d.max()) <= 2 and float((d > 0).double().mean()) < 0.05
    if quantize:
        check_codes(y, codes)
    else:
        assert codes is None
        y2, none, _ = rmsnorm(x + r, w, 1e-5)
        assert none is None and torch.equal(y2, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_fp8(dtype):
    m, k = 21, 256
    gu = inputs(m, 2 * k, dtype, 7)
    gu[1, 0], gu[2, 1] = -100.0, 60.0  # exp overflow on both sides
    gate, up = gu[:, :k], gu[:, k:]  # halves of one projection: row stride 2K
    y, codes = silu_mul_fp8(gate, up)
    ref = silu_mul64(gate, up)
    # where exp(-gate) overflows fp32 (gate < -88.7) the kernel's silu, like torch's, is -0;
    # the true products there are below 2^-100
    d = torch.where((ref.float().abs() < 2.0**-100) & (y.float() == 0), 0, ulps_apart(y, ref))
    assert int(d.max()) <= 2 and float((d > 0).double().mean()) < 0.02
    check_codes(y, codes)


def test_producer_errors():
    x = torch.randn(4, 200).to(torch.bfloat16)
    with pytest.raises(InputError, match="128 columns"):
        rmsnorm_fp8(x, torch.ones(200, dtype=torch.bfloat16), 1e-6)
    x = torch.randn(4, 256).to(torch.bfloat16)
    with pytest.raises(InputError, match=r"weight is torch\.float32"):
        rmsnorm_fp8(x, torch.ones(256), 1e-6)
    with pytest.raises(InputError, match="2-D bf16 / fp16"):
        rmsnorm_fp8(x.float(), torch.ones(256), 1e-6)
    with pytest.raises(InputError, match="one shape"):
        silu_mul_fp8(x, x.to(torch.float16))


# -- the handoff --------------------------------------------------------------------------------


@pytest.fixture
def count_quantizer(monkeypatch):
    calls = []
    real = fp8p.quantize_activations

    def counted(x, recipe, impl="triton"):
        calls.append(tuple(x.shape))
        return real(x, recipe, impl)

    monkeypatch.setattr(fp8p, "quantize_activations", counted)
    fp8_handoff.clear()
    yield calls
    fp8_handoff.clear()


@pytest.fixture
def sharing():
    with fp8_handoff.sharing():
        yield


def run_linear(x2, w, recipe):
    """The FP8 prefill linear's activation step as the triton backend runs it: through the
    handoff a scope opened, else its own (torch rule)."""
    handoff = handoff_in_use()

    def quantize(v):
        return fp8p.quantize_activations(v, recipe, "torch")

    return quantize(x2) if handoff is None else handoff.quantized(x2, quantize)


def slot():
    return fp8_handoff.handoff().slot()


def test_handoff_shares_between_readers(count_quantizer):
    x = torch.randn(2, 8, 256).to(torch.bfloat16)
    with fp8_handoff.sharing():
        a = run_linear(x.reshape(-1, 256), None, "128x128")  # q_proj's view
        b = run_linear(x.reshape(-1, 256), None, "1x128")  # k_proj's own view of the same data
    assert count_quantizer == [(16, 256)] and a[0] is b[0]
    assert slot() is None  # emptied on leaving the scope


def test_handoff_only_inside_a_scope(count_quantizer):
    """Outside a scope nothing is shared: a buffer rewritten behind torch's back (here through
    numpy, as a Triton kernel would: no version bump) must not find the old codes."""
    buf = torch.randn(16, 256).to(torch.float16)
    first = run_linear(buf, None, "128x128")
    buf.numpy()[:] = torch.randn(16, 256).to(torch.float16).numpy()
    second = run_linear(buf, None, "128x128")
    assert len(count_quantizer) == 2
    assert not torch.equal(first[0].view(torch.uint8), second[0].view(torch.uint8))
    check_codes(buf, second)
    with fp8_handoff.sharing(), fp8_handoff.sharing():  # nested: the outer one empties
        run_linear(buf, None, "128x128")
    assert slot() is None


def test_handoff_misses_what_differs(count_quantizer, sharing):
    x = torch.randn(16, 256).to(torch.bfloat16)
    run_linear(x, None, "128x128")
    x.mul_(2)  # in place: the version counter moves
    b = run_linear(x, None, "128x128")
    assert len(count_quantizer) == 2
    check_codes(x, b)
    run_linear(x[:8], None, "128x128")  # another view: other shape
    run_linear(x.clone(), None, "128x128")  # same values, other memory
    assert len(count_quantizer) == 4
    with torch.inference_mode():  # no version counter: never kept
        xi = torch.randn(16, 256).to(torch.bfloat16)
        run_linear(xi, None, "128x128")
        run_linear(xi, None, "128x128")
    assert len(count_quantizer) == 6


def test_handoff_lives_no_longer_than_the_activation(count_quantizer, sharing):
    x = torch.randn(16, 256).to(torch.bfloat16)
    run_linear(x, None, "128x128")
    assert fp8_handoff.handoff().lookup(x) is not None
    del x
    gc.collect()
    assert slot() is None


def test_producer_output_found_by_the_linear(count_quantizer, sharing):
    x = inputs(8, 256, torch.bfloat16, 3)
    y, codes = rmsnorm_fp8(x, torch.ones(256, dtype=torch.bfloat16), 1e-5)
    fp8_handoff.offer(y, codes)  # what the HF integration's fused norm does
    got = run_linear(y.reshape(-1, 256), None, "128x128")
    assert count_quantizer == [] and got[0] is codes[0]
    y.add_(1)  # written after: quantized again
    run_linear(y, None, "128x128")
    assert count_quantizer == [(8, 256)]

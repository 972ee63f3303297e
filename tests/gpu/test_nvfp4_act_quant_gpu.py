"""GPU: the Triton NVFP4 activation quantizer bit-equal with the plain-torch one at real sizes.

The torch version on the GPU is checked against the same function on the CPU (a slice), so
the chain is Triton(GPU) == torch(GPU) == torch(CPU) == the float64 rule of the CPU tests. The
Triton kernel's time is printed (run with -s); nothing asserts on speed.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [(8192, 8192), (1, 4096), (37, 5120), (1000, 14336)]


@pytest.fixture(scope="module")
def q():
    """The quantizer modules, imported only on a CUDA machine and never in interpreter mode."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(
            "TRITON_INTERPRET=1 in this process (set by the CPU numerics tests): "
            "run tests/gpu in its own pytest process"
        )
    pytest.importorskip("triton")
    from quantdispatch.formats import nvfp4_act
    from quantdispatch.kernels.native import nvfp4_quant

    return nvfp4_act, nvfp4_quant


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Magnitudes over ~6 decades, an all-zero block, a tiny block, saturating blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda")
    x = x * torch.exp(torch.randn(m, k, generator=g, device="cuda") * 2.0)
    x[0, :16] = 0.0
    if m > 1:
        x[1, :16] *= 1e-4
        x[-1, -16:] = 1e4
    return x.clamp(-6e4, 6e4).to(dtype)  # finite in fp16 too


def _bits(pair):
    return pair[0], pair[1].view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k"), SHAPES)
def test_triton_quantizer_bit_equal_with_torch(q, dtype, m, k):
    act, kern = q
    x = activations(m, k, dtype, seed=m + k)
    amax = float(x.float().abs().amax())
    s = act.activation_scale(input_scale=amax / 2688.0 / 4.0, device="cuda").encode
    for swizzle in (False, True):
        ref_p, ref_s = _bits(act.quantize_nvfp4_activations_raw(x, s, swizzle=swizzle))
        got_p, got_s = _bits(kern.quantize_nvfp4_activations_triton(x, s, swizzle=swizzle))
        assert torch.equal(got_p, ref_p), f"codes differ at {int((got_p != ref_p).sum())} bytes"
        assert torch.equal(got_s, ref_s), f"scales differ at {int((got_s != ref_s).sum())}"
    rows = slice(0, min(m, 64))  # the GPU torch version equals the CPU one
    cpu = act.quantize_nvfp4_activations_raw(x[rows].cpu(), s.cpu())
    gpu = act.quantize_nvfp4_activations_raw(x[rows], s)
    assert torch.equal(cpu[0], gpu[0].cpu())
    assert torch.equal(cpu[1].view(torch.uint8), gpu[1].view(torch.uint8).cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_quantizer_time(q, dtype):
    act, kern = q
    m = k = 8192
    x = activations(m, k, dtype, seed=1)
    s = act.activation_scale(input_scale=0.01, device="cuda").encode
    for swizzle in (False, True):
        for _ in range(3):
            kern.quantize_nvfp4_activations_triton(x, s, swizzle=swizzle)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            kern.quantize_nvfp4_activations_triton(x, s, swizzle=swizzle)
        stop.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(stop) * 1000 / reps
        gbs = (x.numel() * x.element_size() + x.numel() // 2 + x.numel() // 16) / us / 1e3
        print(f"\nnvfp4 act quant {m}x{k} {dtype} swizzle={swizzle}: {us:.1f} us ({gbs:.0f} GB/s)")


def test_e4m3_encoder_matches_the_hardware_conversion(q):
    """The kernel's integer e4m3 encoder equals ``cvt.rn.satfinite.e4m3x2.f32`` (SM89+) for
    every fp32 from 0 up to 2**9 (all subnormal, normal, tie and saturating cases)."""
    import triton
    import triton.language as tl

    _, kern = q
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("cvt.rn.satfinite.e4m3x2.f32 needs SM89+")

    @triton.jit
    def probe(out_ptr, base, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        bits = base + offs
        v = bits.to(tl.float32, bitcast=True)
        hw = tl.inline_asm_elementwise(
            "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; cvt.u32.u16 $0, t; }",
            "=r,f",
            [v],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
        mine = kern._e4m3_rne_code(v)
        bad = ((hw & 0xFF) != mine).to(tl.int32)
        tl.atomic_add(out_ptr, tl.sum(tl.where(offs < n, bad, 0), axis=0))

    top = 0x44000000  # 512.0
    chunk = 1 << 24
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    for base in range(0, top, chunk):
        n = min(chunk, top - base)
        probe[(triton.cdiv(n, 1024),)](bad, base, n, BLOCK=1024)
    assert int(bad) == 0

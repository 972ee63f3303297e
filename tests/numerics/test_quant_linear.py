"""QuantLinear on the reference backend (CPU) against float64 maths written in ref64.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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

from quantdispatch.errors import BackendUnavailableError, ConfigurationError, InputError
from quantdispatch.formats import Fp8Weight, Mxfp4Weight, Nvfp4Weight
from quantdispatch.layers import QuantLinear

# fp32 accumulation, one final rounding: error is the output dtype's half-ulp (bf16 2^-9 ~ 2e-3,
# fp16 2^-12 ~ 2.4e-4) relative, plus the input's rounding to that dtype (inputs are drawn in
# float32 and rounded before both computations, so that cancels). Bounds leave ~2x margin.
BOUND = {torch.bfloat16: 4e-3, torch.float16: 6e-4}


def _nvfp4(n, k, seed, *, gs=0.0173, input_scale=None):
    g = torch.Generator().manual_seed(seed)
    return Nvfp4Weight(
        packed=random_codes(n, k, g),
        block_scale=random_e4m3_scales((n, k // 16), g),
        global_scale=torch.tensor(gs, dtype=torch.float32),
        input_scale=None if input_scale is None else torch.tensor(input_scale),
    )


def _x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(48, 80), (96, 32), (40, 160)])
def test_nvfp4_matches_float64(dtype, n, k):
    w = _nvfp4(n, k, seed=n + k)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g)
    layer = QuantLinear(w, bias=bias, act_dtype=dtype, device="cpu")
    assert layer.backend == "reference"
    x = _x((2, 3, k), dtype, seed=k)  # leading batch dims
    ref = linear64(x, nvfp4_weight64(w.packed, w.block_scale, w.global_scale), bias)
    out = layer(x)
    assert out.shape == (2, 3, n) and out.dtype == dtype
    assert rel_err(out, ref) < BOUND[dtype]


def test_subnormal_and_max_block_scales_are_exact_in_the_dequant():
    n, k = 16, 64
    g = torch.Generator().manual_seed(3)
    bs = torch.full((n, k // 16), 2.0**-9).to(torch.float8_e4m3fn)
    bs[::2] = torch.tensor(448.0).to(torch.float8_e4m3fn)
    bs[1::4, 1] = torch.tensor(7 * 2.0**-9).to(torch.float8_e4m3fn)  # largest subnormal
    w = Nvfp4Weight(packed=random_codes(n, k, g), block_scale=bs, global_scale=torch.tensor(1.0))
    layer = QuantLinear(w, act_dtype=torch.float16, device="cpu")
    # A one-hot input reads single weights: the output must be the exact weight value.
    w64 = nvfp4_weight64(w.packed, w.block_scale, w.global_scale)
    for col in (0, 17, 63):
        x = torch.zeros(1, k, dtype=torch.float16)
        x[0, col] = 1.0
        expected = w64[:, col].to(torch.float16)
        assert torch.equal(layer(x)[0], expected)


def test_mxfp4_and_fp8_match_float64():
    g = torch.Generator().manual_seed(5)
    n, k = 72, 96
    mx = Mxfp4Weight(
        packed=random_codes(n, k, g),
        block_scale=torch.randint(118, 132, (n, k // 32), generator=g).to(torch.uint8),
    )
    x = _x((5, k), torch.bfloat16, seed=9)
    out = QuantLinear(mx, device="cpu")(x)
    assert rel_err(out, linear64(x, mxfp4_weight64(mx.packed, mx.block_scale))) < 4e-3

    wq = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    for scale, block in (
        (torch.tensor(0.013), None),
        (torch.rand(n, generator=g) + 0.01, None),
        (torch.rand(1, 1, generator=g).expand(1, 1).clone() + 0.01, (128, 128)),
        (torch.rand(3, 2, generator=g) + 0.01, (32, 64)),
    ):
        fw = Fp8Weight(weight=wq, scale=scale, block_size=block)
        out = QuantLinear(fw, device="cpu")(x)
        assert rel_err(out, linear64(x, fp8_weight64(wq, fw.scale, block))) < 4e-3


def test_both_nvfp4_conventions_give_identical_outputs():
    from quantdispatch.formats import global_scale_to_compressed_tensors

    for gs in (0.0625, 0.0173):  # a power of two (exact reciprocal) and a general value
        w = _nvfp4(64, 64, seed=11, gs=gs)
        modelopt = {
            "l.weight": w.packed,
            "l.weight_scale": w.block_scale,
            "l.weight_scale_2": w.global_scale.reshape(1),
        }
        ct = {
            "l.weight_packed": w.packed,
            "l.weight_scale": w.block_scale,
            "l.weight_global_scale": global_scale_to_compressed_tensors(w.global_scale),
        }
        a = QuantLinear.from_checkpoint(modelopt, "l", device="cpu")
        b = QuantLinear.from_checkpoint(ct, "l", device="cpu")
        x = _x((4, 64), torch.bfloat16, seed=2)
        if gs == 0.0625:
            assert torch.equal(a(x), b(x))
        else:  # the fp32 reciprocal round trip is within one ulp of the global scale
            assert (
                float((a(x).double() - b(x).double()).abs().max())
                <= float(a(x).double().abs().max()) * 2.0**-7
            )


def test_state_dict_round_trip():
    w = _nvfp4(32, 48, seed=4, input_scale=0.02)
    a = QuantLinear(w, bias=torch.randn(32), device="cpu")
    b = QuantLinear(_nvfp4(32, 48, seed=99, input_scale=0.5), bias=torch.zeros(32), device="cpu")
    b.load_state_dict(a.state_dict())
    x = _x((3, 48), torch.bfloat16, seed=6)
    assert torch.equal(a(x), b(x))
    assert set(a.state_dict()) == {"packed", "block_scale", "global_scale", "input_scale", "bias"}


def test_non_contiguous_input_and_fp16():
    w = _nvfp4(24, 64, seed=8)
    layer = QuantLinear(w, act_dtype=torch.float16, device="cpu")
    x = _x((64, 6), torch.float16, seed=7).T  # [6, 64] with stride (1, 6)
    assert not x.is_contiguous()
    ref = linear64(x, nvfp4_weight64(w.packed, w.block_scale, w.global_scale))
    assert rel_err(layer(x), ref) < BOUND[torch.float16]


def test_w4a4_emulation_quantizes_activations_like_a_native_kernel():
    from quantdispatch.api import load_settings

    w = _nvfp4(32, 64, seed=12, input_scale=0.01)
    layer = QuantLinear(
        w,
        device="cpu",
        emulate_activations=True,
        settings=load_settings({}, backend={"nvfp4": "reference"}),
    )
    x = _x((3, 64), torch.bfloat16, seed=13)
    # Independent fake quantization: per 16 inputs, scale = amax/(6*s) rounded to e4m3, codes by
    # nearest E2M1 value with ties to the even code.
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    xb = x.double().reshape(3, 4, 16)
    s = 0.01
    bscale = (xb.abs().amax(-1) / (6 * s)).clamp(2.0**-9, 448).float().to(torch.float8_e4m3fn)
    denom = bscale.double() * s
    q = (xb / denom.unsqueeze(-1)).abs().clamp(max=6)
    dist = (q.unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best
    idx = torch.where(ties, torch.arange(8) % 2 == 0, False).to(torch.int64).argmax(-1)
    idx = torch.where(ties.sum(-1) > 1, idx, dist.argmin(-1))
    xq = (grid[idx] * xb.sign() * denom.unsqueeze(-1)).reshape(3, 64)
    ref = linear64(xq, nvfp4_weight64(w.packed, w.block_scale, w.global_scale))
    assert rel_err(layer(x), ref) < 4e-3
    # ... and that differs measurably from weight-only (the mode does something)
    wo = linear64(x, nvfp4_weight64(w.packed, w.block_scale, w.global_scale))
    assert rel_err(layer(x), wo) > 1e-2


def test_bad_forward_inputs():
    layer = QuantLinear(_nvfp4(16, 32, seed=1), device="cpu")
    with pytest.raises(InputError, match=r"built for torch\.bfloat16"):
        layer(torch.randn(2, 32, dtype=torch.float16))
    with pytest.raises(InputError, match="in_features = 32"):
        layer(torch.randn(2, 48, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="on meta but the layer is on cpu"):
        layer(torch.empty(2, 32, dtype=torch.bfloat16, device="meta"))


def test_fp32_input_error_names_a_cast_that_works():
    """No layer takes float32 activations, so the error for an fp32 input suggests the cast to
    the layer's dtype (and the cast runs), never a float32 layer (which is refused)."""
    layer = QuantLinear(_nvfp4(16, 32, seed=1), device="cpu")
    x = torch.randn(2, 32)
    with pytest.raises(InputError, match=r"cast the input with \.to\(torch\.bfloat16\)") as err:
        layer(x)
    assert "act_dtype=torch.float32" not in str(err.value)
    assert "16-bit activations" in str(err.value)
    with pytest.raises(ConfigurationError, match="16-bit activations"):
        QuantLinear(_nvfp4(16, 32, seed=1), act_dtype=torch.float32, device="cpu")
    assert layer(x.to(layer.act_dtype)).shape == (2, 16)
    # the other 16-bit dtype can have a layer of its own: that suggestion stays
    with pytest.raises(InputError, match=r"build the layer with act_dtype=torch\.float16"):
        layer(x.half())


def test_preset_device_is_refused_with_a_clear_message():
    with pytest.raises(BackendUnavailableError, match="simulated device"):
        QuantLinear(_nvfp4(16, 32, seed=1), device="h100")


def test_emulation_needs_the_reference_backend_and_an_input_scale():
    with pytest.raises(ConfigurationError, match="W4A16"):
        QuantLinear(_nvfp4(16, 32, seed=1), device="cpu", emulate_activations=True)


def test_repr_and_bytes_of_a_14336x4096_nvfp4_layer():
    n, k = 14336, 4096
    w = Nvfp4Weight(
        packed=torch.zeros(n, k // 2, dtype=torch.uint8),
        block_scale=torch.ones(n, k // 16).to(torch.float8_e4m3fn),
        global_scale=torch.tensor(1.0),
    )
    layer = QuantLinear(w, device="cpu")
    assert layer.device_bytes() <= 0.5625 * n * k + 64
    text = repr(layer)
    assert "format=nvfp4" in text and "scheme=W4A16" in text and "backend=reference" in text


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = QuantLinear(_nvfp4(64, 32, seed=1), device="cpu")
            self.b = QuantLinear(_nvfp4(32, 64, seed=2), bias=torch.randn(32), device="cpu")

        def forward(self, x):
            return self.b(torch.nn.functional.silu(self.a(x)))

    model = Tiny()
    x = _x((2, 5, 32), torch.bfloat16, seed=3)
    compiled = torch.compile(model, fullgraph=True)
    assert torch.equal(compiled(x), model(x))


def _op_calls(fn) -> int:
    """How many times ``fn`` ran torch.ops.quantdispatch.linear (the profiler records the op)."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "quantdispatch::linear")


def test_eager_calls_skip_the_op_dispatch_and_give_its_result():
    """An eager inference call runs the backend directly (the op's dispatch costs more host time
    than a decode kernel); with autograd recording or under compilation the op runs. Same bits
    either way."""
    layer = QuantLinear(_nvfp4(48, 64, seed=4), bias=torch.randn(48), device="cpu")
    x = _x((3, 64), torch.bfloat16, seed=5)
    with torch.no_grad():
        assert _op_calls(lambda: layer(x)) == 0
        direct = layer(x)
    via_op = torch.ops.quantdispatch.linear(
        x, layer._tensors(), layer.bias, "reference", "nvfp4", layer._meta_args, 48
    )
    assert torch.equal(direct, via_op)
    xg = x.clone().requires_grad_(True)
    assert _op_calls(lambda: layer(xg)) == 1

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), direct)
    assert str(torch.ops.quantdispatch.linear) in seen


def test_custom_op_passes_opcheck():
    layer = QuantLinear(_nvfp4(32, 48, seed=1), bias=torch.randn(32), device="cpu")
    x = _x((3, 48), torch.bfloat16, seed=2)
    args = (x, layer._tensors(), layer.bias, "reference", "nvfp4", layer._meta_args, 32)
    torch.library.opcheck(torch.ops.quantdispatch.linear.default, args)


def test_reference_forward_peak_memory_stays_within_the_chunk_bound(tmp_path):
    """Peak extra RSS of one forward on a 14336 x 4096 weight, measured in a fresh process.

    A full float32 dequantized copy would be 235 MB (bf16: 117 MB); the chunked path keeps
    about 4 * CHUNK_ELEMENTS * 4 bytes = 32 MiB of temporaries, plus activations and output.
    """
    code = textwrap.dedent(
        """
        import resource, torch
        torch.set_num_threads(1)
        from quantdispatch.formats import Nvfp4Weight
        from quantdispatch.layers import QuantLinear
        n, k = 14336, 4096
        g = torch.Generator().manual_seed(0)
        w = Nvfp4Weight(
            packed=torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
            block_scale=torch.ones(n, k // 16).to(torch.float8_e4m3fn),
            global_scale=torch.tensor(0.01),
        )
        layer = QuantLinear(w, device="cpu")
        x = torch.randn(4, k, dtype=torch.bfloat16)
        small = QuantLinear(Nvfp4Weight(packed=w.packed[:64], block_scale=w.block_scale[:64],
                                        global_scale=w.global_scale), device="cpu")
        small(x)  # warm up allocator and kernels on a tiny layer
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        y = layer(x)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    extra = int(out.stdout.strip().splitlines()[-1])
    assert extra < 64 * 2**20, f"forward grew peak RSS by {extra / 2**20:.1f} MiB"


@pytest.mark.parametrize("cast", ["half", "bfloat16", "float", "to-dtype-and-device"])
def test_model_dtype_casts_leave_the_quantized_buffers_alone(cast):
    """model.half() / .to(torch.bfloat16) cast every floating buffer: the e4m3 block scales
    became bf16 numbers and the fp32 global scale lost bits, and the next call failed far from
    the cause (a shape error in the reference backend). The layer's buffers keep their dtypes
    (and follow device moves); the output is bit-identical."""
    from quantdispatch.formats import quantize_nvfp4

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.02
    layer = QuantLinear(quantize_nvfp4(w), bias=torch.randn(64), device="cpu")
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    before = layer(x)
    dtypes = {n: b.dtype for n, b in layer.named_buffers()}
    model = torch.nn.Sequential(layer)
    if cast == "to-dtype-and-device":
        model.to("cpu", torch.bfloat16)
    else:
        getattr(model, cast)()
    assert {n: b.dtype for n, b in layer.named_buffers()} == dtypes
    assert torch.equal(layer(x), before)
    if cast == "half":  # the layer was built for bf16: an fp16 call says so
        with pytest.raises(InputError, match=r"built for torch\.bfloat16"):
            layer(x.half())

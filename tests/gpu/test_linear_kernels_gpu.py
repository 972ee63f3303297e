"""GPU tests of the Triton kernels and the native FP8 path at real layer sizes.

Reference: float64 on the GPU from the format definitions (written here, not quantdispatch
code). Outputs are NaN-poisoned. Bounds as in tests/numerics/test_checkpoint_layout_linear.py: bf16
1e-2, fp16 2e-3 (the decode is exact; only the output cast rounds). Native FP8 quantizes the
activations, so it is compared with the same quantization emulated in float64.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
QWEN3_30B = [(4096, 2048), (2048, 768)]  # q_proj (32x128 <- 2048), an expert's down_proj
MS = [1, 7, 16, 33, 256, 1000]
BOUND = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def k():
    """The kernel modules, imported only on a CUDA machine and never in interpreter mode."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(
            "TRITON_INTERPRET=1 in this process (set by the CPU numerics tests): "
            "run tests/gpu in its own pytest process"
        )
    pytest.importorskip("triton")
    from quantdispatch.kernels.checkpoint_layout import fp8 as fp8_linear
    from quantdispatch.kernels.checkpoint_layout import linear as fp4_linear
    from quantdispatch.kernels.native import scaled_mm

    return fp4_linear, fp8_linear, scaled_mm


@pytest.fixture(autouse=True)
def poisoned(monkeypatch, request):
    if "k" not in request.fixturenames:
        return
    request.getfixturevalue("k")  # skips without a usable GPU
    from quantdispatch.kernels.common import checks

    monkeypatch.setattr(
        checks,
        "empty_output",
        lambda m, n, dtype, device: torch.full((m, n), math.nan, dtype=dtype, device=device),
    )


def poison_torch_empty(monkeypatch) -> None:
    """Every float buffer made by ``torch.empty`` starts as NaN (kernels that allocate with
    torch: an element they do not write fails the test)."""
    real_empty = torch.empty

    def empty(*shape, **kw):
        out = real_empty(*shape, **kw)
        if out.is_floating_point():
            out.fill_(math.nan)
        return out

    monkeypatch.setattr(torch, "empty", empty)


# ---- float64 references from the format definitions ----------------------------------------


def e2m1_f64(codes):
    v = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    lut = torch.tensor(v + [-x for x in v], dtype=torch.float64, device=codes.device)
    return lut[codes.long()]


def e4m3_f64(bits):
    b = bits.long()
    e, m = (b >> 3) & 15, (b & 7).double()
    mag = torch.where(e == 0, m * 2.0**-9, torch.pow(2.0, (e - 7).double()) * (1 + m / 8))
    return torch.where((b & 0x80) != 0, -mag, mag)


def fp4_w64(packed, sbits, group, e8m0, gscale):
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
    s = torch.pow(2.0, sbits.double() - 127) if e8m0 else e4m3_f64(sbits)
    w = (e2m1_f64(codes).view(packed.shape[0], -1, group) * s[:, :, None]).view(packed.shape[0], -1)
    return w * gscale if gscale is not None else w


def check(out, ref, dtype):
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < BOUND[dtype], f"relative error {rel:.3g}"


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def rint(g, lo, hi, shape):
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8, device="cuda")


def nvfp4_weights(n, kk, g, subnormal_rows=True):
    packed = rint(g, 0, 256, (n, kk // 2))
    sbits = rint(g, 0x20, 0x7F, (n, kk // 16))
    if subnormal_rows:
        sbits[:8] = rint(g, 1, 8, (min(8, n), kk // 16))  # 2^-9 .. 2^-7
        sbits[8:16] = 0x7E  # 448
    return packed, sbits, torch.tensor(2.5e-3, device="cuda")


# ---- NVFP4 / MXFP4 at real sizes ---------------------------------------------------------------


@pytest.mark.parametrize("shape", LLAMA + QWEN3_30B, ids=lambda s: f"{s[0]}x{s[1]}")
def test_nvfp4_bf16_real_shapes(k, shape):
    n, kk = shape
    g = gen(n + kk)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    w64 = fp4_w64(packed, sbits, 16, False, 2.5e-3)
    for m in MS:
        x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        out = k[0].fp4_linear(x, packed, sbits.view(torch.float8_e4m3fn), gs, scale_format="e4m3")
        check(out, x.double() @ w64.T, torch.bfloat16)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(block_m=16, block_n=16, block_k=128, num_warps=4, num_stages=3, swap_ab=1, split=4),
        dict(block_m=16, block_n=32, block_k=128, num_warps=8, num_stages=3, swap_ab=0, split=2),
        dict(block_m=64, block_n=32, block_k=128, num_warps=8, num_stages=3, swap_ab=1, split=4),
        dict(block_m=32, block_n=64, block_k=256, num_warps=4, num_stages=3, swap_ab=1, split=0),
        dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, swap_ab=0, split=0),
    ],
    ids=["split-swap", "split", "split-mid", "tiled-swap", "tiled-wgmma"],
)
def test_nvfp4_every_kernel_family(k, cfg):
    """Each kernel family at a real size, independent of what the tuned table picks."""
    from quantdispatch.kernels.common.configs import GemmConfig

    n, kk = 4096, 4096
    g = gen(21)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    w64 = fp4_w64(packed, sbits, 16, False, 2.5e-3)
    for m in (1, 33, 200):
        x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        out = k[0].fp4_linear(x, packed, sbits, gs, scale_format="e4m3", config=GemmConfig(**cfg))
        check(out, x.double() @ w64.T, torch.bfloat16)


@pytest.mark.parametrize("shape", LLAMA, ids=lambda s: f"{s[0]}x{s[1]}")
def test_mxfp4_bf16_real_shapes(k, shape):
    n, kk = shape
    g = gen(7 * n + kk)
    packed = rint(g, 0, 256, (n, kk // 2))
    sbits = rint(g, 110, 136, (n, kk // 32))
    w64 = fp4_w64(packed, sbits, 32, True, None)
    for m in MS:
        x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        out = k[0].fp4_linear(x, packed, sbits, None, scale_format="e8m0")
        check(out, x.double() @ w64.T, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nvfp4_subnormal_scales_fp16_bias(k, dtype):
    """All block scales subnormal, all 16 codes, a bias, fp16 and bf16, both paths."""
    n, kk = 4096, 4096
    g = gen(99)
    packed = rint(g, 0, 256, (n, kk // 2))
    sbits = rint(g, 1, 8, (n, kk // 16))
    gs = torch.tensor(300.0, device="cuda")
    bias = torch.randn(n, generator=g, device="cuda").to(dtype)
    w64 = fp4_w64(packed, sbits, 16, False, 300.0)
    for m in (1, 33, 256):
        x = torch.randn(m, kk, generator=g, device="cuda").to(dtype)
        out = k[0].fp4_linear(x, packed, sbits, gs, scale_format="e4m3", bias=bias)
        check(out, x.double() @ w64.T + bias.double(), dtype)


# ---- FP8 weight-only ------------------------------------------------------------------------


def fp8_weights(n, kk, kind, g):
    """Random e4m3 codes (no NaN) [n, kk] with a tensor / channel / 128x128 block scale:
    (codes, scale, block_size, float64 weight)."""
    bits = rint(g, 0, 256, (n, kk))
    bits[(bits & 0x7F) == 0x7F] = 0x3A
    w64 = e4m3_f64(bits)
    block = None
    if kind == "tensor":
        scale = torch.tensor(0.01, device="cuda")
        w64 = w64 * 0.01
    elif kind == "channel":
        scale = torch.rand(n, generator=g, device="cuda") * 0.02 + 0.001
        w64 = w64 * scale.double()[:, None]
    else:
        block = (128, 128)
        scale = torch.rand(n // 128, kk // 128, generator=g, device="cuda") * 0.02 + 0.001
        w64 = w64 * scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return bits, scale, block, w64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_weight_only_real_shape(k, kind, dtype):
    n, kk = (4096, 14336) if kind == "channel" else (6144, 4096)
    g = gen(5)
    bits, scale, block, w64 = fp8_weights(n, kk, kind, g)
    for m in (1, 16, 33, 1000):
        x = torch.randn(m, kk, generator=g, device="cuda").to(dtype)
        out = k[1].fp8_weight_only_linear(
            x, bits.view(torch.float8_e4m3fn), scale, block_size=block
        )
        check(out, x.double() @ w64.T, dtype)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(block_m=16, block_n=16, block_k=128, num_warps=4, num_stages=3, swap_ab=1, split=4),
        dict(block_m=16, block_n=32, block_k=256, num_warps=8, num_stages=2, swap_ab=1, split=4),
        dict(block_m=16, block_n=32, block_k=128, num_warps=8, num_stages=3, swap_ab=0, split=2),
        dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3, swap_ab=1, split=0),
    ],
    ids=["split-swap", "split-wide", "split", "tiled-swap"],
)
def test_fp8_weight_only_every_small_m_family(k, cfg, kind):
    """The small-M kernel (K split in-program; 256-wide slices shrink to the 128-wide scale
    blocks) and the tiled one at Llama's down size, every scale kind, M = 1 / 5 / 16, against
    float64 (partial K steps: the CPU tests)."""
    from quantdispatch.kernels.common.configs import GemmConfig

    n, kk = 4096, 14336
    g = gen(17)
    bits, scale, block, w64 = fp8_weights(n, kk, kind, g)
    for m in (1, 5, 16):
        x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        out = k[1].fp8_weight_only_linear(
            x, bits.view(torch.float8_e4m3fn), scale, block_size=block, config=GemmConfig(**cfg)
        )
        check(out, x.double() @ w64.T, torch.bfloat16)


# ---- native FP8 ------------------------------------------------------------------------------


def _emulated_fp8(x, w64, input_scale):
    xf = x.float()
    if input_scale is None:
        s = xf.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
    else:
        s = input_scale.reshape(1, 1)
    xq = (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (e4m3_f64(xq.view(torch.uint8)) * s.double()) @ w64.T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wscale", ["tensor", "channel"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fp8_scaled_mm(k, dtype, wscale, static):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native FP8 needs SM89+")
    n, kk = 6144, 4096
    g = gen(17)
    bits = rint(g, 0, 256, (n, kk))
    bits[(bits & 0x7F) == 0x7F] = 0x3A
    w = bits.view(torch.float8_e4m3fn)
    scale = (
        torch.tensor(0.01, device="cuda")
        if wscale == "tensor"
        else torch.rand(n, generator=g, device="cuda") * 0.02 + 0.001
    )
    w64 = e4m3_f64(bits) * (scale.double()[:, None] if scale.dim() else scale.double())
    wp, sp = k[2].prepare_fp8_scaled_mm(w, scale)
    bias = torch.randn(n, generator=g, device="cuda").to(dtype)
    for m in (1, 33, 256):
        x = torch.randn(m, kk, generator=g, device="cuda").to(dtype)
        in_s = x.float().abs().max().reshape(()) / 448.0 if static else None
        out = k[2].fp8_scaled_mm_linear(x, wp, sp, input_scale=in_s, bias=bias)
        assert out.dtype == dtype and torch.isfinite(out).all()
        check(out, _emulated_fp8(x, w64, in_s) + bias.double(), torch.bfloat16)


# ---- CUDA graphs and torch.compile ----------------------------------------------------------


def test_cuda_graph_replay_equals_eager(k):
    n, kk = 4096, 4096
    g = gen(3)
    packed, sbits, gs = nvfp4_weights(n, kk, g)
    for m in (1, 256):
        static_x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        k[0].fp4_linear(static_x, packed, sbits, gs, scale_format="e4m3")  # compile outside
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = k[0].fp4_linear(static_x, packed, sbits, gs, scale_format="e4m3")
        for _ in range(2):
            static_x.copy_(torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16))
            gs.mul_(1.5)  # device-side scale change must be seen by the replay (no host copy)
            graph.replay()
            eager = k[0].fp4_linear(static_x, packed, sbits, gs, scale_format="e4m3")
            torch.testing.assert_close(static_out, eager, rtol=0, atol=0)


def test_torch_compile_fullgraph_custom_op(k):
    fp4 = k[0].fp4_linear

    @torch.library.custom_op("qd_kernels_test::nvfp4_linear", mutates_args=())
    def op(
        x: torch.Tensor, packed: torch.Tensor, s: torch.Tensor, gs: torch.Tensor
    ) -> torch.Tensor:
        return fp4(x, packed, s, gs, scale_format="e4m3")

    @op.register_fake
    def _(x, packed, s, gs):
        return x.new_empty((x.shape[0], packed.shape[0]))

    n, kk = 6144, 4096
    g = gen(4)
    packed, sbits, gs = nvfp4_weights(n, kk, g)

    def f(x):
        return op(x, packed, sbits, gs).float().relu() * 2.0

    compiled = torch.compile(f, fullgraph=True)
    for m in (1, 33):
        x = torch.randn(m, kk, generator=g, device="cuda").to(torch.bfloat16)
        torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)

"""GPU: FP8 prefill. The Triton re-encoder and activation quantizer (hardware FP8 conversion and
the integer path) bit-equal with the plain-torch rule at real sizes (which the CPU tests tie to
the float64 rule), and the FP8 prefill linear within its proven componentwise bound of the
float64 W4A16 result on two Llama-3-8B shapes, per call and resident; the re-encoder reading
the mma16x64 layout equal to the checkpoint path. Needs SM 8.9+ (block recipes: SM 9.0 and
CUDA 12.9+)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "numerics"))


@pytest.fixture(scope="module")
def mods():
    """The modules, imported only on an SM 8.9+ CUDA machine, never in interpreter mode."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(
            "TRITON_INTERPRET=1 in this process (set by the CPU numerics tests): "
            "run tests/gpu in its own pytest process"
        )
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need SM 8.9+")
    from quantdispatch.formats import fp8_prefill as rule
    from quantdispatch.kernels.native import fp8_prefill as fp8p
    from quantdispatch.kernels.native import fp8_prefill_quant as kq

    return rule, fp8p, kq


DEV = "cuda"


def fp4(n, k, fmt, seed):
    """Random bytes; NVFP4 scales over all of e4m3 (subnormals and zeros included), MXFP4
    exponents within rows' +-6 of a random base."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8, device=DEV)
    if fmt == "nvfp4":
        sc = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8, device=DEV)
        return packed, sc, torch.tensor(2.5e-3, device=DEV)
    base = torch.randint(110, 140, (n, 1), generator=g, device=DEV)
    sc = (base + torch.randint(-6, 7, (n, k // 32), generator=g, device=DEV)).to(torch.uint8)
    return packed, sc, None


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("recipe", ["128x128", "1x128", "rowwise"])
def test_reencoder_bit_equal(mods, fmt, recipe):
    rule, fp8p, kq = mods
    n, k = 4096, 14336
    packed, sc, gs = fp4(n, k, fmt, seed=1)
    br, bc = fp8p.weight_blocks(recipe, k)
    sf = "e4m3" if fmt == "nvfp4" else "e8m0"
    q_t, s_t = rule.reencode_fp4_torch(packed, sc, gs, scale_format=sf, block_rows=br,
                                       block_cols=bc)  # fmt: skip
    q = torch.empty(n, k, dtype=torch.uint8, device=DEV)
    s = torch.empty(s_t.shape, device=DEV)
    kq.reencode_fp4_triton(packed, sc, gs, q, s, scale_format=sf, block_rows=br,
                           block_cols=bc)  # fmt: skip
    assert torch.equal(q, q_t)
    assert torch.equal(s, s_t)
    rows = slice(256, 512)  # the GPU's torch == the CPU's torch
    q_c, _s_c = rule.reencode_fp4_torch(packed[rows].cpu(), sc[rows].cpu(), None if gs is None
                                       else gs.cpu(), scale_format=sf, block_rows=br,
                                       block_cols=bc)  # fmt: skip
    assert torch.equal(q_c, q_t[rows].cpu())


def activations(m, k, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEV)
    x *= torch.logspace(-3, 3, k, device=DEV)[torch.randperm(k, generator=g, device=DEV)]
    x[0, :128] = 0
    if m > 2:
        x[1, 5] = float("nan")
        x[2, 7] = float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8192, 4096), (1000, 14336), (1, 4096)])
def test_activation_quantizer_bit_equal(mods, dtype, shape):
    rule, fp8p, kq = mods
    x = activations(*shape, dtype, seed=shape[0])
    for recipe in ("1x128", "rowwise"):
        bc = shape[1] if recipe == "rowwise" else 128
        q_t, s_t = rule.quantize_blocks_torch(x, block_cols=bc)
        q = torch.empty(x.shape, dtype=torch.uint8, device=DEV)
        s = torch.empty(s_t.shape, device=DEV)
        kq.quantize_blocks_triton(x, q, s, block_cols=bc)
        assert torch.equal(q, q_t) and torch.equal(s, s_t), recipe
        xq, _sa = fp8p.quantize_activations(x, recipe)
        assert torch.equal(xq[: shape[0]].view(torch.uint8), q_t)
        assert bool((xq[shape[0] :].view(torch.uint8) == 0).all())


def test_hardware_rounding_equals_integer_rule(mods):
    """Every positive e4m3 value, each midpoint between neighbours (ties to even) and the fp32
    values just beside it, the flush-to-zero boundary, their negatives, and +-inf / NaN, with
    the block exponent pinned to 0 (448 in each block): the hardware-rounding quantizer, the
    integer one and the plain-torch rule give the same codes."""
    rule, _fp8p, kq = mods
    from ref64 import e4m3_from_bits

    v = e4m3_from_bits(torch.arange(0, 127)).to(torch.float32)
    mid = (v[:-1] + v[1:]) / 2  # exact in fp32
    up = torch.nextafter(mid, torch.tensor(float("inf")))
    down = torch.nextafter(mid, torch.tensor(0.0))
    tiny = torch.tensor([2.0**-10, 2.0**-10 * (1 + 2.0**-23), 2.0**-11, 2.0**-126, 1e-45])
    pos = torch.cat([v, mid, up, down, tiny])
    vals = torch.cat([pos, -pos])
    cols = 127
    pad = -len(vals) % cols
    body = torch.cat([vals, torch.zeros(pad)]).reshape(-1, cols)
    x = torch.cat([torch.full((body.shape[0], 1), 448.0), body], dim=1)
    special = torch.zeros(3, 128)
    special[0, :3] = torch.tensor([float("inf"), -1.0, 3.0])
    special[1, :3] = torch.tensor([float("-inf"), 0.5, -2.0])
    special[2, :3] = torch.tensor([float("nan"), 1.0, 448.0])
    x = torch.cat([x, special]).to(DEV)
    q_t, s_t = rule.quantize_blocks_torch(x, block_cols=128)
    for hw in (True, False):
        q = torch.empty(x.shape, dtype=torch.uint8, device=DEV)
        s = torch.empty(s_t.shape, device=DEV)
        kq.quantize_blocks_triton(x, q, s, block_cols=128, hw=hw)
        bad = (q != q_t).nonzero()
        assert bad.numel() == 0, (hw, x[tuple(bad[0])].item(), q[tuple(bad[0])], q_t[tuple(bad[0])])
        assert torch.equal(s, s_t), hw


def _recipes():
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    return ["128x128", "1x128", "rowwise"] if cap == (9, 0) else ["rowwise"]


@pytest.mark.parametrize("shape", [(6144, 4096, 1000), (4096, 14336, 256)])
@pytest.mark.parametrize("recipe", _recipes())
def test_linear_within_bound(mods, shape, recipe):
    from fp8_prefill_ref import linear_bound64

    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    _rule, fp8p, _ = mods
    n, k, m = shape
    g = torch.Generator(device=DEV).manual_seed(n + m)
    w = torch.randn(n, k, generator=g, device=DEV) * 0.02
    w[:64] *= 1e-3  # subnormal block scales
    q = quantize_nvfp4(w)
    w64 = dequantize_nvfp4(q, dtype=torch.float64)
    x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
    bias = torch.randn(n, generator=g, device=DEV).to(torch.bfloat16)
    sf = q.block_scale.view(torch.uint8)
    y = fp8p.fp8_prefill_linear(x, q.packed, sf, q.global_scale, fmt="nvfp4", bias=bias,
                                recipe=recipe)  # fmt: skip
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    res = fp8p.make_resident(q.packed, sf, q.global_scale, fmt="nvfp4", recipe=recipe)
    y_res = fp8p.fp8_prefill_linear(x, q.packed, sf, q.global_scale, fmt="nvfp4", bias=bias,
                                    resident=res)  # fmt: skip
    assert torch.equal(y, y_res)
    rows = 128
    ref = x[:rows].double() @ w64.T + bias.double()
    _, sa = fp8p.quantize_activations(x[:rows], recipe)
    bc_a = k if recipe == "rowwise" else 128
    br, bc = fp8p.weight_blocks(recipe, k)
    sx = sa[:rows].double().repeat_interleave(bc_a, 1)
    sw = res.scale.double().repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)
    bound = linear_bound64(x[:rows].double(), w64, sx, sw, ref)
    ratio = float(((y[:rows].double() - ref).abs() / bound).max())
    err = float((y[:rows].double() - ref).norm() / ref.norm())
    print(f"{recipe} {n}x{k} M={m}: rel err {err:.3e}, bound ratio {ratio:.3f}, "
          f"notes {fp8p.gemm_notes()}")  # fmt: skip
    assert ratio <= 1.0
    assert err < 0.06  # e4m3 activations: ~3% for N(0, 1) inputs


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_mma_layout_equal_checkpoint_path(mods, fmt):
    """The re-encoder reading the mma16x64 layout gives the checkpoint path's bits (hardware
    conversion and integer path), and the linear on it the same output."""
    from quantdispatch.formats.mxfp4 import quantize_mxfp4
    from quantdispatch.formats.nvfp4 import quantize_nvfp4
    from quantdispatch.kernels.mma_layout.layout import repack, repack_mx
    from quantdispatch.kernels.native.fp8_prefill_mma import reencode_mma_triton

    _, fp8p, kq = mods
    n, k, m = 6144, 4096, 512
    g = torch.Generator(device=DEV).manual_seed(3)
    w = torch.randn(n, k, generator=g, device=DEV) * 0.02
    q = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_mxfp4(w)
    sf = q.block_scale.view(torch.uint8)
    if fmt == "nvfp4":
        words, scales = repack(q.packed, sf, torch.bfloat16)
        gs = layout_gs = q.global_scale
    else:
        words, scales, layout_gs = repack_mx(q.packed, sf, torch.bfloat16)
        gs = None
    recipe = fp8p.default_recipe(k, torch.cuda.get_device_capability())
    br, bc = fp8p.weight_blocks(recipe, k)
    ref_q = torch.empty(n, k, dtype=torch.uint8, device=DEV)
    ref_s = torch.empty(-(-n // br), k // bc, device=DEV)
    kq.reencode_fp4_triton(q.packed, sf, gs, ref_q, ref_s, scale_format="e4m3" if fmt ==
                           "nvfp4" else "e8m0", block_rows=br, block_cols=bc)  # fmt: skip
    qq = torch.empty_like(ref_q)
    ss = torch.empty_like(ref_s)
    reencode_mma_triton(words, scales, layout_gs, 0, n, qq, ss, act_dtype=torch.bfloat16,
                        block_rows=br, block_cols=bc)  # fmt: skip

    # Equal codes, except that a zero may carry either sign: on the H200 the mma path wrote
    # +0 where the checkpoint path wrote -0 (both decode to 0; no product or sum changes).
    def canon(t):
        return torch.where((t & 0x7F) == 0, torch.zeros_like(t), t)

    assert torch.equal(canon(qq), canon(ref_q)) and torch.equal(ss, ref_s)
    x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
    y = fp8p.fp8_prefill_linear(x, q.packed, sf, gs, fmt=fmt, recipe=recipe)
    y_mma = fp8p.fp8_prefill_linear_mma(x, words, scales, layout_gs, fmt=fmt, recipe=recipe)
    assert torch.equal(y_mma, y)


@pytest.mark.parametrize("mode", ["prefill", "prefill-resident"])
@pytest.mark.parametrize("m", [256, 4096])
def test_quant_linear_with_fp8_compute(mods, mode, m):
    """QuantLinear with FP8 compute on (Llama-3-8B qkv, bf16): kernel_for(M) names fp8 prefill
    from the regime row's M (256 resident, 4096 per call), and the layer's output is there
    within the proven componentwise bound of the float64 W4A16 result (relative error < 0.06);
    below it the weight-only kernels run (1e-2). The resident copy is a buffer of the layer."""
    from quantdispatch.api import load_settings
    from quantdispatch.backends.triton import fp8_compute
    from quantdispatch.checking import FP8_REL_BOUND, fp8_bound_ratio, rel_error
    from quantdispatch.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from quantdispatch.kernels.regimes import fp8_prefill_regime
    from quantdispatch.layers import QuantLinear

    n, k = 6144, 4096
    cap = torch.cuda.get_device_capability()
    if fp8_compute.mode_for("nvfp4", n, k, torch.bfloat16, cap, mode) == "off":
        _row, why = fp8_compute.availability("nvfp4", n, k, torch.bfloat16, cap, mode)
        pytest.skip(f"FP8 compute does not apply here: {'; '.join(why)}")
    g = torch.Generator(device=DEV).manual_seed(m)
    w = torch.randn(n, k, generator=g, device=DEV) * 0.02
    w[:64] *= 1e-3  # subnormal block scales
    q = quantize_nvfp4(w)
    settings = load_settings({}, backend={"nvfp4": "triton"}, fp8_compute=mode)
    layer = QuantLinear(q, act_dtype=torch.bfloat16, device=DEV, settings=settings)
    min_m = fp8_prefill_regime("nvfp4", cap, mode).min_m
    family = layer.decision.kernel_for(m).family
    fp8 = m >= min_m
    assert (family == "fp8 prefill") == fp8, (mode, m, family)
    assert ("fp8_weight" in dict(layer.named_buffers())) == (mode == "prefill-resident")
    x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
    y = layer(x)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    rows = 128
    w64 = dequantize_nvfp4(q, dtype=torch.float64)
    ref = x[:rows].double() @ w64.T
    err = rel_error(y[:rows], ref)
    if fp8:
        ratio = fp8_bound_ratio("nvfp4", q, x[:rows], y[:rows], fp8_compute.recipe_for(k))
        print(f"{mode} M={m}: rel err {err:.3e}, bound ratio {ratio:.3f}")
        assert ratio <= 1.0 and err < FP8_REL_BOUND
    else:
        assert err < 1e-2, (mode, m, err)

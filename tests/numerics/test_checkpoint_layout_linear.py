"""Triton kernels (fp4_linear, fp8_weight_only_linear, decode helpers) on the CPU interpreter.

Every expected value comes from float64 math written here from the format definitions (E2M1
codes, E4M3 and E8M0 bit formulas), never from quantdispatch code. Outputs are NaN-poisoned
before each call, so an element the kernel does not write fails the test.

Error bounds, ||out - ref|| / ||ref||: the kernels decode ``e2m1 * block_scale`` exactly
(<= 5 significant bits, inside the normal 16-bit range) and accumulate in fp32, so the only
sizeable rounding is the final cast of the output: unit roundoff 2^-11 ~ 4.9e-4 for fp16 and
2^-8 ~ 3.9e-3 for bf16 (worst case per element, so also for the norm). Bounds: fp16 2e-3,
bf16 1e-2 -- four times the worst case for fp16 (2.5x for bf16) and far below what a
decoding error (one wrong code or scale among a few hundred) would give.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import json
import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (optional extra)")

import triton.language as tl  # noqa: E402

from quantdispatch.errors import InputError, WeightFormatError  # noqa: E402
from quantdispatch.kernels.checkpoint_layout.fp8 import fp8_weight_only_linear  # noqa: E402
from quantdispatch.kernels.checkpoint_layout.linear import fp4_linear  # noqa: E402
from quantdispatch.kernels.common import checks, configs, decode  # noqa: E402
from quantdispatch.kernels.common.configs import GemmConfig  # noqa: E402
from quantdispatch.kernels.common.device_facts import device_facts  # noqa: E402

CPU_FACTS = device_facts(torch.device("cpu"))

if not checks.interpreting():
    pytest.skip(
        "the Triton kernels were already compiled for a GPU in this process (a GPU test "
        "imported them first); run tests/numerics in its own pytest process",
        allow_module_level=True,
    )

BOUND = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float16, torch.bfloat16]

# ---- independent float64 decoders (from the format definitions) ---------------------------


def e2m1_ref(codes: torch.Tensor) -> torch.Tensor:
    """E2M1: bit 3 sign, e = bits 2..1, m = bit 0; e=0 -> m*0.5, else 2^(e-1)*(1+m/2)."""
    c = codes.long()
    e = (c >> 1) & 3
    m = (c & 1).double()
    mag = torch.where(e == 0, m * 0.5, torch.pow(2.0, (e - 1).double()) * (1 + m / 2))
    return torch.where((c & 8) != 0, -mag, mag)


def e4m3_ref(bits: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn): bias 7, 3 mantissa bits, subnormals 2^-6*m/8, S.1111.111 is NaN."""
    b = bits.long()
    e = (b >> 3) & 15
    m = (b & 7).double()
    mag = torch.where(e == 0, m / 8 * 2.0**-6, torch.pow(2.0, (e - 7).double()) * (1 + m / 8))
    mag = torch.where((b & 0x7F) == 0x7F, torch.full_like(mag, math.nan), mag)
    return torch.where((b & 0x80) != 0, -mag, mag)


def e8m0_ref(bits: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, bits.double() - 127)


def unpack_ref(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] codes, element 2j in the low nibble."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def fp4_weight_ref(packed, scale_bits, group, fmt, global_scale):
    w = e2m1_ref(unpack_ref(packed))
    s = e4m3_ref(scale_bits) if fmt == "e4m3" else e8m0_ref(scale_bits)
    w = (w.reshape(w.shape[0], -1, group) * s[:, :, None]).reshape(w.shape[0], -1)
    return w * float(global_scale) if global_scale is not None else w


# ---- helpers -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output buffer the wrappers allocate starts as NaN."""

    def nan_empty(m, n, dtype, device):
        return torch.full((m, n), math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(checks, "empty_output", nan_empty)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite (unwritten or overflowed) output elements"
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < BOUND[dtype], f"relative error {rel:.3g} >= {BOUND[dtype]}"


def random_e4m3_scales(n, g, gen, low=0x08, high=0x7E):
    """Random positive finite E4M3 codes; rows 0/1 subnormal (2^-9..2^-7), row 2 all 448."""
    bits = torch.randint(low, high + 1, (n, g), generator=gen, dtype=torch.uint8)
    bits[0] = torch.randint(1, 8, (g,), generator=gen, dtype=torch.uint8)  # subnormals
    bits[1, ::2] = 1  # 2^-9, the smallest
    bits[2] = 0x7E  # 448, the largest
    return bits


def make_x(m, k, dtype, gen, scale=1.0):
    return (torch.randn(m, k, generator=gen) * scale).to(dtype)


SMALL = GemmConfig(16, 16, 64, 4, 2)  # small-M path family, tiny tiles for the interpreter
LARGE = GemmConfig(32, 32, 64, 4, 2, group_m=2)  # tiled path family
SMALL_SWAP = GemmConfig(16, 32, 64, 4, 2, swap_ab=1)  # weights as the MMA's A operand
LARGE_SWAP = GemmConfig(32, 16, 32, 4, 2, group_m=1, swap_ab=1)
SPLIT_SWAP = GemmConfig(16, 16, 32, 4, 2, swap_ab=1, split=2)  # small-M kernel, K split 2x
SPLIT = GemmConfig(16, 16, 32, 4, 2, split=4)  # 4 slices of 32: K=160 leaves a partial step
SPLIT_MID = GemmConfig(32, 32, 32, 4, 2, swap_ab=1, split=2)


# ---- decode helpers: all codes against the bit formulas -------------------------------------


@triton.jit
def _decode_probe(codes_ptr, lo_ptr, hi_ptr, e4_ptr, e8_ptr, e2_ptr, fin_ptr):
    offs = tl.arange(0, 256)
    c = tl.load(codes_ptr + offs)
    lo, hi = decode.e2m1_pair_to_f32(c)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)
    tl.store(e4_ptr + offs, decode.e4m3_to_f32(c))
    tl.store(e8_ptr + offs, decode.e8m0_to_f32_scaled(c, 0))
    tl.store(e2_ptr + offs, decode.e2m1_to_f32(c & 15))
    tl.store(fin_ptr + offs, decode.e4m3_to_f32_scaled_finite(c & 0x7F))


@triton.jit
def _decode16_probe(codes_ptr, lo_ptr, hi_ptr, e4_ptr, BF16: tl.constexpr):
    """Stores raw 16-bit patterns: the interpreter's bf16 arithmetic is unreliable, its bit
    moves are not; the bf16 multiply itself is covered by the GPU tests."""
    offs = tl.arange(0, 256)
    c = tl.load(codes_ptr + offs)
    lo, hi = decode.e2m1_pair_to_16bit(c, BF16)
    tl.store(lo_ptr + offs, lo.to(tl.uint16, bitcast=True))
    tl.store(hi_ptr + offs, hi.to(tl.uint16, bitcast=True))
    if not BF16:
        tl.store(e4_ptr + offs, decode.e4m3_to_16bit(c, BF16).to(tl.uint16, bitcast=True))


def test_decode_helpers_all_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    outs = [torch.full((256,), math.nan) for _ in range(6)]
    _decode_probe[(1,)](codes, *outs)
    lo, hi, e4, e8, e2, fin = (o.double() for o in outs)
    torch.testing.assert_close(
        fin * 256, e4m3_ref(codes & 0x7F).nan_to_num(nan=480.0), rtol=0, atol=0
    )
    torch.testing.assert_close(lo * 2.0**14, e2m1_ref(codes & 0xF), rtol=0, atol=0)
    torch.testing.assert_close(hi * 2.0**14, e2m1_ref(codes >> 4), rtol=0, atol=0)
    torch.testing.assert_close(e2, e2m1_ref(codes & 0xF), rtol=0, atol=0)
    torch.testing.assert_close(e4, e4m3_ref(codes), rtol=0, atol=0, equal_nan=True)
    # e8m0: exact over the normal fp32 range; 255 is NaN; 0 (2^-127, subnormal) saturates to 0
    want8 = e8m0_ref(codes)
    want8[0] = 0.0
    want8[255] = math.nan
    torch.testing.assert_close(e8, want8, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_decode_16bit_patterns_all_codes(bf16):
    codes = torch.arange(256, dtype=torch.uint8)
    lo, hi, e4 = (torch.zeros(256, dtype=torch.int16) for _ in range(3))
    _decode16_probe[(1,)](codes, lo, hi, e4, bf16)
    dt, fold = (torch.bfloat16, 2.0**126) if bf16 else (torch.float16, 2.0**14)
    for got, want in ((lo, e2m1_ref(codes & 0xF)), (hi, e2m1_ref(codes >> 4))):
        torch.testing.assert_close(got.view(dt).double() * fold, want, rtol=0, atol=0)
    if not bf16:  # e4m3 -> fp16 includes one fp16 multiply, exact in the interpreter
        want = e4m3_ref(codes).nan_to_num(nan=480.0)
        want[codes == 0xFF] = -480.0
        torch.testing.assert_close(e4.view(torch.float16).double(), want, rtol=0, atol=0)


# ---- NVFP4 / MXFP4 ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "deq16"),
    [(torch.float16, True), (torch.float16, False), (torch.bfloat16, None)],
    ids=["fp16-deq16", "fp16-f32", "bf16"],
)
@pytest.mark.parametrize(
    ("m", "cfg"),
    [
        (1, SMALL),
        (7, None),
        (37, LARGE),
        (70, None),
        (5, SMALL_SWAP),
        (33, LARGE_SWAP),
        (1, SPLIT_SWAP),
        (3, SPLIT),
        (37, SPLIT_MID),
    ],
    ids=[
        "M1-small",
        "M7-table",
        "M37-large",
        "M70-table",
        "M5-swap",
        "M33-swap",
        "M1-split-swap",
        "M3-split",
        "M37-split-mid",
    ],
)
def test_nvfp4_matches_float64(dtype, deq16, m, cfg):
    gen = torch.Generator().manual_seed(1000 + m)
    n, k = 72, 160  # N, K not multiples of the tiles; K a multiple of 16 only
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    sbits = random_e4m3_scales(n, k // 16, gen)
    gscale = torch.tensor(0.37, dtype=torch.float32)
    bias = torch.randn(n, generator=gen) if m in (7, 37) else None
    x = make_x(m, k, dtype, gen)
    out = fp4_linear(
        x,
        packed,
        sbits.view(torch.float8_e4m3fn),
        gscale,
        scale_format="e4m3",
        bias=bias,
        config=cfg,
        deq16=deq16,
    )
    ref = x.double() @ fp4_weight_ref(packed, sbits, 16, "e4m3", gscale).T
    if bias is not None:
        ref = ref + bias.double()
    check(out, ref, dtype)


def test_nvfp4_subnormal_scales_only_and_uint8_scales():
    """All block scales subnormal (2^-9..2^-7): the bug class of vLLM #34577/#37502."""
    gen = torch.Generator().manual_seed(7)
    n, k, m = 40, 64, 3
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    sbits = torch.randint(1, 8, (n, k // 16), generator=gen, dtype=torch.uint8)
    gscale = torch.tensor(1000.0)
    for dtype in DTYPES:
        x = make_x(m, k, dtype, gen)
        for cfg in (SMALL, SPLIT):
            out = fp4_linear(x, packed, sbits, gscale, scale_format="e4m3", config=cfg)
            check(out, x.double() @ fp4_weight_ref(packed, sbits, 16, "e4m3", gscale).T, dtype)


def test_nvfp4_fp16_no_overflow_before_global_scale():
    """x @ (e2m1*block_scale) reaches ~1e6 (> fp16 max) before the 1e-3 global scale: the
    fp32 epilogue must apply it first (the bug class of vLLM #37135)."""
    gen = torch.Generator().manual_seed(11)
    n, k, m = 24, 256, 5
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    packed[:, :] = (packed & 0x88) | 0x77  # codes +-6 only: every product is as large as it gets
    sbits = torch.full((n, k // 16), 0x7E, dtype=torch.uint8)  # 448
    gscale = torch.tensor(1e-3)
    x = make_x(m, k, torch.float16, gen, scale=20.0)
    for cfg in (SMALL, LARGE, SPLIT_SWAP):
        out = fp4_linear(x, packed, sbits, gscale, scale_format="e4m3", config=cfg)
        ref = x.double() @ fp4_weight_ref(packed, sbits, 16, "e4m3", gscale).T
        assert ref.abs().max() / 1e-3 > 65504  # the unscaled sum would overflow fp16
        check(out, ref, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "cfg"), [(1, SMALL), (37, LARGE), (2, SPLIT_SWAP)], ids=["small", "large", "split"]
)
def test_mxfp4_matches_float64(dtype, m, cfg):
    gen = torch.Generator().manual_seed(2000 + m)
    n, k = 40, 96  # K a multiple of 32, not of the 64-wide K tile
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    lo, hi = (90, 160) if dtype == torch.bfloat16 else (116, 130)  # fp16 range, see kernel docs
    sbits = torch.randint(lo, hi + 1, (n, k // 32), generator=gen, dtype=torch.uint8)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = make_x(m, k, dtype, gen)
    out = fp4_linear(x, packed, sbits, None, scale_format="e8m0", bias=bias, config=cfg)
    ref = x.double() @ fp4_weight_ref(packed, sbits, 32, "e8m0", None).T + bias.double()
    check(out, ref, dtype)


# ---- FP8 weight-only ------------------------------------------------------------------------


def random_e4m3_weight(n, k, gen):
    bits = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3A  # no NaN codes in a weight
    return bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize(
    ("m", "cfg"),
    [(1, SMALL), (37, LARGE), (3, SMALL_SWAP), (1, SPLIT_SWAP), (5, SPLIT), (37, SPLIT_MID)],
    ids=["small", "large", "swap", "split-swap", "split", "split-mid"],
)
def test_fp8_weight_only_matches_float64(dtype, kind, m, cfg):
    """Both kernels (tiled; small-M with K split in-program, where K=160 leaves a partial step
    and, with block scales, slices past K), every scale kind, N and K not tile multiples."""
    gen = torch.Generator().manual_seed(3000 + m)
    n, k = 72, 160
    bits = random_e4m3_weight(n, k, gen)
    w = e4m3_ref(bits)
    block = None
    if kind == "tensor":
        scale = torch.tensor(0.013)
        w = w * 0.013
    elif kind == "channel":
        scale = torch.rand(n, generator=gen) + 0.25
        w = w * scale.double()[:, None]
    else:
        block = (32, 64)  # K tiles of 64 inside 64-wide blocks; N, K not block multiples
        scale = torch.rand(math.ceil(n / 32), math.ceil(k / 64), generator=gen) + 0.25
        full = scale.double().repeat_interleave(32, 0)[:n].repeat_interleave(64, 1)[:, :k]
        w = w * full
    bias = torch.randn(n, generator=gen) if m == 37 else None
    x = make_x(m, k, dtype, gen)
    out = fp8_weight_only_linear(
        x, bits.view(torch.float8_e4m3fn), scale, block_size=block, bias=bias, config=cfg
    )
    ref = x.double() @ w.T + (bias.double() if bias is not None else 0.0)
    check(out, ref, dtype)


@pytest.mark.parametrize("cfg", [SMALL, GemmConfig(16, 16, 64, 4, 2, swap_ab=1, split=2)])
def test_fp8_block_scale_with_wide_config_shrinks_k_tile(cfg):
    """K tiles (tiled kernel) and K slices (small-M kernel) of 64 shrink to the 32-wide blocks."""
    gen = torch.Generator().manual_seed(5)
    n, k, m = 32, 128, 2
    bits = random_e4m3_weight(n, k, gen)
    scale = torch.rand(1, 4, generator=gen) + 0.5  # 32-wide K blocks, config asks for 64
    x = make_x(m, k, torch.float16, gen)
    out = fp8_weight_only_linear(
        x, bits.view(torch.float8_e4m3fn), scale, block_size=(32, 32), config=cfg
    )
    w = e4m3_ref(bits) * scale.double().repeat_interleave(32, 1)
    check(out, x.double() @ w.T, torch.float16)


def test_fp8_k_tile_that_cannot_fit_the_scale_blocks_names_the_config():
    bits = random_e4m3_weight(32, 96, torch.Generator().manual_seed(6))
    x = torch.zeros(1, 96, dtype=torch.float16)
    cfg = GemmConfig(16, 16, 8, 4, 2, swap_ab=1, split=2)  # a K slice below the MMA K step
    with pytest.raises(InputError, match="config block_k=8 against scale blocks 48 wide"):
        fp8_weight_only_linear(
            x, bits.view(torch.float8_e4m3fn), torch.ones(1, 2), block_size=(32, 48), config=cfg
        )


# ---- shapes, errors, configs ----------------------------------------------------------------


def test_empty_batch_returns_empty():
    packed = torch.zeros(16, 16, dtype=torch.uint8)
    s = torch.ones(16, 2, dtype=torch.float8_e4m3fn)
    out = fp4_linear(
        torch.empty(0, 32, dtype=torch.float16), packed, s, torch.tensor(1.0), scale_format="e4m3"
    )
    assert out.shape == (0, 16) and out.dtype == torch.float16


def _nv_args(n=16, k=32):
    return (
        torch.zeros(n, k // 2, dtype=torch.uint8),
        torch.ones(n, k // 16, dtype=torch.float8_e4m3fn),
        torch.tensor(1.0),
    )


@pytest.mark.parametrize(
    ("x", "exc", "needle"),
    [
        (torch.zeros(4, 32), InputError, "float16 or bfloat16"),
        (torch.zeros(4, 48, dtype=torch.float16), InputError, "K=48"),
        (torch.zeros(32, dtype=torch.float16), InputError, "2-D"),
    ],
    ids=["fp32-x", "k-mismatch", "1d-x"],
)
def test_input_errors(x, exc, needle):
    with pytest.raises(exc, match=needle):
        fp4_linear(x, *_nv_args(), scale_format="e4m3")


def test_weight_errors():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    packed, s, g = _nv_args()
    with pytest.raises(WeightFormatError, match="block_scale"):
        fp4_linear(x, packed, s[:, :1].contiguous(), g, scale_format="e4m3")
    with pytest.raises(WeightFormatError, match="global_scale"):
        fp4_linear(x, packed, s, None, scale_format="e4m3")
    with pytest.raises(WeightFormatError, match="MXFP4 takes no per-tensor scale"):
        fp4_linear(
            x, packed, torch.zeros(16, 1, dtype=torch.uint8), g.double(), scale_format="e8m0"
        )
    with pytest.raises(WeightFormatError, match="scale_format"):
        fp4_linear(x, packed, s, g, scale_format="e5m2")  # type: ignore[arg-type]
    with pytest.raises(WeightFormatError, match="block_size"):
        fp8_weight_only_linear(
            x, torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(1, 1), block_size=None
        )
    with pytest.raises(InputError, match="bias"):
        fp4_linear(x, packed, s, g, scale_format="e4m3", bias=torch.zeros(3))


def test_config_lookup_is_host_only_and_bucketed(monkeypatch):
    monkeypatch.setattr(configs, "_TABLES", {})
    monkeypatch.setattr(configs, "_LOADED", True)
    assert [configs.m_bucket(m) for m in (1, 3, 16, 17, 1000, 10**6)] == [1, 4, 16, 32, 1024, 4096]
    cfg, src = configs.get_config("nvfp4", CPU_FACTS, 4096, 4096, 1)
    assert src == "heuristic" and cfg.block_m == 16
    configs.register_table(
        {
            "version": 1,
            "gpus": {
                "cpu": {
                    "nvfp4": {
                        "64x128": {
                            "1": GemmConfig(16, 32, 128, 4, 2).to_dict(),
                            "256": GemmConfig(64, 64, 64, 4, 3).to_dict(),
                        }
                    }
                }
            },
        }
    )
    assert configs.get_config("nvfp4", CPU_FACTS, 64, 128, 2)[0].block_n == 32
    assert configs.get_config("mxfp4", CPU_FACTS, 64, 128, 300)[0].block_m == 64
    assert configs.get_config("fp8", CPU_FACTS, 64, 128, 9)[1].startswith("table")


def test_registered_table_wins_over_the_shipped_ones(monkeypatch, tmp_path):
    """A table registered before the first lookup (benchmarks/linear.py --tune) still wins:
    the shipped tables load first. Before, the lazy load ran after it and overwrote it."""
    shipped = {"version": 1, "gpus": {"cpu": {"fp8": {"64x128": {"1": GemmConfig(
        16, 64, 256, 4, 3).to_dict()}}}}}  # fmt: skip
    (tmp_path / "configs_cpu.json").write_text(json.dumps(shipped))
    monkeypatch.setattr(configs, "_TABLE_DIR", tmp_path)
    monkeypatch.setattr(configs, "_TABLES", {})
    monkeypatch.setattr(configs, "_LOADED", False)
    tuned = GemmConfig(16, 16, 128, 4, 3, swap_ab=1, split=4)
    configs.register_table(
        {"version": 1, "gpus": {"cpu": {"fp8": {"64x128": {"1": tuned.to_dict()}}}}}
    )
    assert configs.get_config("fp8", CPU_FACTS, 64, 128, 1)[0] == tuned


def test_fp8_heuristic_takes_the_split_kernel_below_16384_rows():
    """Untuned GPUs (SM 8.0 / 8.6, FP8's real target): the H200 sweep's winners by shape."""
    small = configs.heuristic_config("fp8", 6144, 4096, 1, (8, 0))
    assert small.split == 4 and small.swap_ab == 1 and small.block_n == 16
    wide = configs.heuristic_config("fp8", 28672, 4096, 16, (8, 6))
    assert wide.split == 0 and (wide.block_m, wide.block_n, wide.block_k) == (16, 64, 256)
    assert configs.heuristic_config("fp8", 4096, 4096, 64, (8, 0)).split == 0

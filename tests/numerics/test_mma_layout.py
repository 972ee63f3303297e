"""The mma16x64 layout contract (quantdispatch.kernels.mma_layout.layout), on the CPU.

The GPU kernels are PTX and cannot run under the Triton interpreter; what can be proven here
is that (a) repack/unpack is a bijection on the checkpoint tensors, (b) the kernel's own bit
operations (rotate, mask, 16-bit multiply by the integer-built scale), replayed in torch, give
e2m1 * scale * 2^-8 exactly against the independent float64 decoders, for every code and
every E4M3 scale (subnormals and 448 included), for both activation dtypes. The kernels
themselves are checked against the reference in tests/gpu.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from quantdispatch.errors import WeightFormatError
from quantdispatch.kernels.common import configs, decode_tables, ptx
from quantdispatch.kernels.mma_layout import gemv, layout
from tests.numerics.ref64 import e2m1_from_bits, e4m3_from_bits, unpack_low_first

DTYPES = [torch.bfloat16, torch.float16]


def _random_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    # every finite non-negative E4M3 code, subnormals (1..7) and 448 (0x7E) included, and zero
    codes = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.int32)
    codes[0, 0], codes[0, 1], codes[1, 0] = 0x7E, 1, 0
    return packed, codes.to(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tables_tile_a_word(dtype: torch.dtype) -> None:
    table = decode_tables.DECODE_TABLES[dtype]
    bits = sorted(
        p
        for r in range(4)
        for h in range(2)
        for p in (table.positions(r, h)[0], *table.positions(r, h)[1])
    )
    assert bits == list(range(32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 64), (48, 192), (32, 1024)])
def test_repack_unpack_round_trip(dtype: torch.dtype, n: int, k: int) -> None:
    packed, scales = _random_weight(n, k, seed=n + k)
    scales[scales == 0] = 1  # zero-scale blocks lose their codes (tested below)
    words, s = layout.repack(packed, scales, dtype)
    assert words.dtype == torch.int32 and words.shape == (n // 16, k // 64, 32, 4)
    assert s.dtype == torch.uint8 and s.shape == (n // 16, k // 64, 32, 2)
    assert words.numel() * 4 + s.numel() == packed.numel() + scales.numel()  # same bytes
    back_packed, back_scales = layout.unpack(words, s, dtype)
    assert torch.equal(back_packed, packed)
    assert torch.equal(back_scales, scales)


@pytest.mark.parametrize("dtype", DTYPES)
def test_repack_in_slabs_equals_one_pass(dtype: torch.dtype, monkeypatch) -> None:
    """Slabs of 16 / 32 / 48 rows (a last slab shorter than the others) give the same bytes
    as the whole 80-row weight at once; zero-scale blocks included."""
    packed, scales = _random_weight(80, 192, seed=7)
    whole = layout.repack(packed, scales, dtype)
    for slab_rows in (16, 32, 48):
        monkeypatch.setattr(layout, "REPACK_SLAB_ELEMENTS", slab_rows * 192)
        words, s = layout.repack(packed, scales, dtype)
        assert torch.equal(words, whole[0]) and torch.equal(s, whole[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_decode_is_exact(dtype: torch.dtype) -> None:
    n, k = 48, 256
    packed, scales = _random_weight(n, k, seed=7)
    words, s = layout.repack(packed, scales, dtype)
    got = layout.decode_emulated(words, s, dtype)
    want = (
        e2m1_from_bits(unpack_low_first(packed))
        * e4m3_from_bits(scales).repeat_interleave(16, dim=1)
        * 2.0**-8
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_scale_code_and_every_e2m1_code(dtype: torch.dtype) -> None:
    """All 127 finite scale codes x all 16 E2M1 codes, in one weight."""
    scale_codes = torch.arange(0, 0x7F, dtype=torch.int32)
    n, k = 128, 16 * 16  # 16 groups per row; 127 scale codes spread over rows/groups
    reps = -(-n * (k // 16) // scale_codes.numel())
    scales = scale_codes.repeat(reps)[: n * (k // 16)].reshape(n, k // 16)
    codes = torch.arange(16, dtype=torch.int32).repeat(n, k // 16)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    words, s = layout.repack(packed, scales.to(torch.uint8), dtype)
    got = layout.decode_emulated(words, s, dtype)
    want = (
        e2m1_from_bits(codes.to(torch.uint8))
        * e4m3_from_bits(scales.to(torch.uint8)).repeat_interleave(16, dim=1)
        * 2.0**-8
    )
    assert torch.equal(got, want)


def test_zero_scale_blocks_decode_to_zero() -> None:
    packed, scales = _random_weight(16, 64, seed=3)
    scales[:, 1] = 0
    words, s = layout.repack(packed, scales, torch.bfloat16)
    got = layout.decode_emulated(words, s, torch.bfloat16)
    assert torch.count_nonzero(got[:, 16:32]) == 0
    assert torch.count_nonzero(got[:, :16]) > 0


@pytest.mark.parametrize(("n", "k"), [(24, 64), (16, 48), (16, 96)])
def test_unsupported_shapes_are_refused(n: int, k: int) -> None:
    packed, scales = _random_weight(n, k, seed=1)
    assert not layout.mma_supported_shape(n, k)
    with pytest.raises(WeightFormatError, match="N % 16 == 0, K % 64 == 0"):
        layout.repack(packed, scales, torch.bfloat16)


@pytest.mark.parametrize("bad", [0x7F, 0x80 | 0x38])
def test_nan_or_negative_scale_codes_are_refused(bad: int) -> None:
    packed, scales = _random_weight(16, 64, seed=2)
    scales[3, 2] = bad
    with pytest.raises(WeightFormatError, match="negative or NaN"):
        layout.repack(packed, scales, torch.bfloat16)


def test_configs_are_launchable_for_every_shape_and_m() -> None:
    """The heuristic's (NT, WT, WK, UNROLL, R, DEPTH): WT * R divides the tiles (the grid is whole),
    warps are a power of two Triton accepts, the K split never exceeds the chunks, and the token
    tiles cover M up to the 64 a program holds."""
    for tiles in (1, 3, 12, 48, 180, 256, 384, 1792):
        for chunks in (1, 3, 12, 45, 64, 224):
            for m in (1, 2, 7, 8, 9, 16, 33, 64, 65, 128, 1000):
                nt, wt, wk, unroll, r, depth = gemv.gemv_config(tiles, chunks, m)
                assert tiles % (wt * r) == 0, (tiles, chunks, m)
                warps = wt * wk
                assert warps in (1, 2, 4, 8, 16, 32) and wk <= max(1, chunks)
                assert 8 * nt >= min(m, configs.MAX_TOKENS_PER_PROGRAM) and nt <= 8
                assert unroll in (1, 2, 4) and r in (1, 2, 4) and depth in (1, 2)
                assert configs.mma_base_config(tiles, chunks, m)[0] == nt


def test_a_prefetch_depth_other_than_one_or_two_is_refused() -> None:
    """DEPTH (the 6th config entry) is how many steps of weight loads are in flight."""
    packed = torch.randint(0, 256, (32, 64), dtype=torch.uint8)
    scales = torch.full((32, 8), 0x38, dtype=torch.uint8)
    words, codes = layout.repack(packed, scales, torch.bfloat16)
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="DEPTH=3: the weight prefetch depth is 1 or 2"):
        gemv.mma_linear(x, words, codes, torch.ones(()), config=(1, 1, 1, 1, 1, 3))


def _run_decode_ptx(text: str, word: int) -> dict[str, int]:
    """A tiny interpreter for the decode's PTX (shl, shf.l.wrap, and, lop3 0xEC on b32)."""
    regs: dict[str, int] = {"$w": word}
    mask32 = 0xFFFFFFFF

    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        op, _, rest = line.rstrip(";").partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if op == "shl.b32":
            regs[args[0]] = (val(args[1]) << int(args[2])) & mask32
        elif op == "shf.l.wrap.b32":
            assert args[1] == args[2]
            q, n = val(args[1]), int(args[3])
            regs[args[0]] = ((q << n) | (q >> (32 - n))) & mask32
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "lop3.b32":
            assert args[4] == "0xEC"  # (a & c) | b
            regs[args[0]] = (val(args[1]) & val(args[3])) | val(args[2])
        else:  # pragma: no cover - a new opcode needs a line here
            raise AssertionError(f"unknown PTX op {op!r}")
    return regs


@pytest.mark.parametrize("fma_shifts", [True, False], ids=["shl", "rotate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_ptx_computes_the_table_registers(dtype: torch.dtype, fma_shifts: bool) -> None:
    """The PTX the kernels run (plain left shifts where no masked bit wraps around, rotates
    elsewhere) yields exactly ``(rotl(q, a) & SIGN) | (rotl(q, b) & MAG)`` per register."""
    table = decode_tables.DECODE_TABLES[dtype]
    outs = ["$o0", "$o1", "$o2", "$o3"]
    text = ptx.decode_ptx(table, "$w", outs, fma_shifts=fma_shifts)
    # the shift form is in use only where asked (the GEMV asks, the wgmma GEMM does not)
    assert ("shl.b32" in text) == fma_shifts

    def rotl(q: int, n: int) -> int:
        return ((q << n) | (q >> (32 - n))) & 0xFFFFFFFF if n else q

    gen = torch.Generator().manual_seed(5)
    words = torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64).tolist()
    for q in [0, 0xFFFFFFFF, 0x80000001, *words]:
        regs = _run_decode_ptx(text, q)
        for r, out in enumerate(outs):
            a, b = table.rotations[r]
            want = (rotl(q, a) & table.sign_mask) | (rotl(q, b) & table.mag_mask)
            assert regs[out] == want, (dtype, r, hex(q))

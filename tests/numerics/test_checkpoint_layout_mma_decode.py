"""The checkpoint-layout decode of the mma.sync kernels (quantdispatch.kernels.common.ptx,
kernels.checkpoint_layout.mma_decode) on the CPU: the kernel's bit operations replayed in torch
give e2m1 * scale * 2^-8 exactly (every E2M1 code x every finite E4M3 scale, zero included,
both 16-bit types), the decode tables tile a 32-bit word, and the activation permutation (prmt
selectors) puts in each B register the columns the A registers of the same MMA step hold. The
kernels run in tests/gpu."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from quantdispatch.kernels.checkpoint_layout import mma_decode, moe_plan
from quantdispatch.kernels.common import decode_tables
from quantdispatch.kernels.common import moe_plan as shared_plan
from quantdispatch.kernels.common.device_facts import DeviceFacts
from tests.numerics.ref64 import e2m1_from_bits, e4m3_from_bits, unpack_low_first

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_tables_tile_a_word(dtype: torch.dtype) -> None:
    table = decode_tables.CHECKPOINT_TABLES[dtype]
    bits = sorted(
        p
        for pair in range(4)
        for h in range(2)
        for p in (table.positions(pair, h)[0], *table.positions(pair, h)[1])
    )
    assert bits == list(range(32))
    # nibble pair i of a checkpoint word is (i, i + 4): sign bit 4i + 3, magnitude 4i + 2 .. 4i
    for pair in range(4):
        for h in range(2):
            nib = pair + 4 * h
            sign, mag = table.positions(pair, h)
            assert (sign, mag) == (4 * nib + 3, (4 * nib + 2, 4 * nib + 1, 4 * nib))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_and_every_scale_decode_exactly(dtype: torch.dtype) -> None:
    n, k = 128, 256
    scale_codes = torch.arange(0, 0x7F, dtype=torch.int32)  # 0, subnormals 1..7, ..., 448
    reps = -(-n * (k // 16) // scale_codes.numel())
    scales = scale_codes.repeat(reps)[: n * (k // 16)].reshape(n, k // 16).to(torch.uint8)
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    packed[0] = torch.arange(16, dtype=torch.uint8).repeat(k // 32) * 17  # every code
    got = mma_decode.decode_checkpoint_emulated(packed, scales, dtype)
    want = (
        e2m1_from_bits(unpack_low_first(packed))
        * e4m3_from_bits(scales).repeat_interleave(16, dim=1)
        * 2.0**-8
    )
    assert torch.equal(got, want)
    zero = (scales == 0).repeat_interleave(16, dim=1)
    assert zero.any() and torch.count_nonzero(got[zero]) == 0


def test_activation_permutation_matches_the_a_registers() -> None:
    b_cols = mma_decode.x_perm_columns()
    for j in range(4):
        for r, b in ((0, 2 * j), (2, 2 * j + 1)):  # A register 0 <-> b0, register 2 <-> b1
            assert (decode_tables.reg_column(j, r, 0), decode_tables.reg_column(j, r, 1)) == b_cols[
                b
            ]
    # the four steps of a lane take each of its 16 columns once
    assert sorted(c for pair in b_cols for c in pair) == list(range(16))


@pytest.mark.parametrize(
    ("inter", "hidden", "gated", "cap", "ok"),
    [
        (768, 2048, True, (9, 0), True),
        (2880, 2880, True, (8, 0), True),
        (768, 2048, True, (7, 5), False),  # no bf16 m16n8k16 before SM 8.0
        (760, 2048, True, (9, 0), False),  # I not a multiple of 64
        (768, 2040, True, (9, 0), False),
        (768, 2048, False, (9, 0), False),  # relu2 and other non-gated: tl.dot kernels
        (768, 2048, True, None, False),
    ],
)
def test_supported_shapes(inter, hidden, gated, cap, ok) -> None:
    assert shared_plan.mma_moe_supported(inter, hidden, gated, cap) is ok


def test_configs_split_k_by_work_and_the_cpu_keeps_tl_dot() -> None:
    cfg = shared_plan.mma_moe_config(8, 128, 768, 2048, direct=True)  # Qwen3 M=1
    assert cfg.direct and cfg.block_m == 8
    assert cfg.gemm1.wk == 2  # 32 chunks: >= 16 per warp
    assert cfg.gemm2.wk == 1 and cfg.gemm2.unroll == 2  # 12 chunks
    mixtral = shared_plan.mma_moe_config(32, 8, 14336, 4096, direct=False)  # M=16: 8 busy blocks
    assert mixtral.block_m == 8 and (mixtral.gemm1.wk, mixtral.gemm2.wk) == (4, 4)
    deepseek = shared_plan.mma_moe_config(128, 256, 2048, 7168, direct=False)  # M=16: many blocks
    assert (deepseek.gemm1.wk, deepseek.gemm2.wk) == (2, 2)
    cpu = DeviceFacts.for_capability(None)
    plan = moe_plan.checkpoint_layout_moe_plan(1, 8, 128, 768, 2048, "nvfp4", cpu)
    assert isinstance(plan, moe_plan.MoeConfig)


def test_moe_configs_keep_16_chunks_per_warp() -> None:
    for pairs in (1, 8, 32, 128, 1024):
        for experts in (8, 128, 256):
            for inter, hidden in ((768, 2048), (14336, 4096), (2048, 7168), (2880, 2880)):
                cfg = shared_plan.mma_moe_config(
                    pairs, experts, inter, hidden, direct=4 * pairs <= experts
                )
                for g, chunks in ((cfg.gemm1, hidden // 64), (cfg.gemm2, inter // 64)):
                    assert g.wt == 1 and g.wk in (1, 2, 4)
                    assert g.wk == 1 or chunks >= 16 * g.wk
                    assert g.unroll in (1, 2)

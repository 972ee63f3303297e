"""Marlin's preparation maths, checked against formulas written again here from the facts."""

from __future__ import annotations

import pytest
import torch
from ref64 import e4m3_from_bits, unpack_low_first

from quantdispatch.backends.marlin_contract import (
    decode_nvfp4_scale_bytes,
    encode_nvfp4_scales,
    gptq_order,
    nvfp4_global_scale,
    nvfp4_scale_factor,
    prepare_linear,
    scale_permutation,
)
from quantdispatch.backends.marlin_moe import align_tokens, block_size_for

# Every non-negative finite e4m3 byte: 0x00 (zero), subnormals 0x01..0x07, normals up to 448.
ALL_E4M3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _independent_permutation(groups: int, n: int) -> list[int]:
    """Position p of Marlin's scale array holds entry src[p] of the row-major [groups, n]
    scales: 64-entry chunks; within a chunk, position p reads slot (0,2,1,3)-swapped within
    its group of 4; slot 8a+b holds entry a+8b."""
    src = []
    for p in range(groups * n):
        chunk, r = divmod(p, 64)
        quad, t = divmod(r, 4)
        slot = quad * 4 + [0, 2, 1, 3][t]
        a, b = divmod(slot, 8)
        src.append(chunk * 64 + a + 8 * b)
    return src


@pytest.mark.parametrize(("groups", "n"), [(1, 64), (4, 128), (8, 192), (3, 256)])
def test_scale_permutation_is_a_permutation_matching_the_index_formula(groups, n):
    perm = scale_permutation(groups, n)
    assert torch.equal(perm.sort().values, torch.arange(groups * n))
    assert perm.tolist() == _independent_permutation(groups, n)


def test_scale_permutation_rejects_partial_chunks():
    with pytest.raises(ValueError, match="64-entry chunks"):
        scale_permutation(1, 96)


def _bf16_read(byte: int) -> float:
    """The bf16 kernel: byte eeeeemmm -> exponent field (e>>4)*128 + (e&15), mantissa mmm."""
    e, m = byte >> 3, byte & 7
    exponent = (e >> 4) * 128 + (e & 15)
    if exponent == 0:
        return m / 8 * 2.0**-126
    return 2.0 ** (exponent - 127) * (1 + m / 8)


def test_fp16_encoding_round_trips_every_e4m3_scale_exactly():
    s64 = e4m3_from_bits(ALL_E4M3.view(torch.uint8))
    enc = encode_nvfp4_scales(ALL_E4M3, torch.float16, 1.0)
    assert torch.equal(decode_nvfp4_scale_bytes(enc, torch.float16).double(), s64 * 2**7)
    for byte, s in zip(enc.tolist(), s64.tolist(), strict=True):  # fp16 read, independently
        e, m = byte >> 3, byte & 7
        value = m / 8 * 2.0**-14 if e == 0 else 2.0 ** (e - 15) * (1 + m / 8)
        assert value == s * 2**7


@pytest.mark.parametrize("factor", [1.0, 2.0**4, 2.0**9])
def test_bf16_encoding_keeps_scales_at_or_above_two_and_flushes_the_rest(factor):
    s64 = e4m3_from_bits(ALL_E4M3.view(torch.uint8)).tolist()
    fit = [v for v in s64 if v * 2**7 * factor <= 65504]
    scales = torch.tensor(fit).to(torch.float8_e4m3fn)
    enc = encode_nvfp4_scales(scales, torch.bfloat16, factor)
    decoded = decode_nvfp4_scale_bytes(enc, torch.bfloat16).tolist()
    for byte, got, s in zip(enc.tolist(), decoded, fit, strict=True):
        want = s * 2**7 * factor if s * 2**7 * factor >= 2 else 0.0
        assert got == want == _bf16_read(byte), (s, byte)


def test_bf16_without_the_rescale_would_read_small_scales_as_2_to_the_minus_112():
    """The fact behind the rescale: a byte with a clear top bit decodes ~2^-112 too small."""
    s = torch.tensor([2.0**-7]).to(torch.float8_e4m3fn)  # 2^-7 * 2^7 = 1 < 2
    byte = int(encode_nvfp4_scales(s, torch.float16, 1.0))
    assert _bf16_read(byte) == 2.0**-112


def test_scale_factor_puts_the_largest_scale_in_the_top_binade_for_bf16_only():
    s = torch.tensor([2.0**-9, 0.5, 3.0]).to(torch.float8_e4m3fn)
    f = nvfp4_scale_factor(s, torch.bfloat16)
    assert f == 2.0**7 and 224 < 3.0 * f <= 448
    assert nvfp4_scale_factor(s, torch.float16) == 1.0
    assert nvfp4_scale_factor(torch.tensor([448.0]).to(torch.float8_e4m3fn), torch.bfloat16) == 1
    assert nvfp4_scale_factor(torch.zeros(4).to(torch.float8_e4m3fn), torch.bfloat16) == 1.0


@pytest.mark.parametrize(("act", "offset"), [(torch.float16, 14), (torch.bfloat16, 126)])
def test_products_of_decoded_parts_equal_the_checkpoint_scales(act, offset):
    """kernel scale x unbiased FP4 decode (2^-offset) x kernel global == block x global."""
    g = torch.tensor(3.0e-4)
    s = torch.tensor([2.0**-9, 2.0**-6, 0.75, 5.0, 448.0]).to(torch.float8_e4m3fn)
    f = nvfp4_scale_factor(s, act)
    kernel = decode_nvfp4_scale_bytes(encode_nvfp4_scales(s, act, f), act).double()
    gk = nvfp4_global_scale(g, act, f).double()
    got = kernel * 2.0**-offset * gk
    want = e4m3_from_bits(s.view(torch.uint8)) * float(g)
    kept = kernel > 0
    assert torch.allclose(got[kept], want[kept].double(), rtol=1e-6, atol=0)
    assert gk.dtype == torch.float64 and gk.shape == (1,)
    if act == torch.float16:
        assert bool(kept.all())  # fp16 keeps even the smallest subnormal scale
    else:
        assert not bool(kept[0])  # 2^-9 is below 2^-14.8 of the largest (448): flushed


def test_gptq_order_puts_element_8r_plus_i_in_nibble_i_of_word_r():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (64, 32), generator=g, dtype=torch.int64).to(torch.uint8)
    words = gptq_order(packed)
    assert words.shape == (8, 64) and words.dtype == torch.int32
    codes = unpack_low_first(packed)  # [N, K]
    w = words.to(torch.int64) & 0xFFFFFFFF
    for i in range(8):
        assert torch.equal((w >> (4 * i)) & 0xF, codes[:, i::8].T)


def test_prepare_linear_pads_with_zero_codes_and_scales():
    g = torch.Generator().manual_seed(1)
    n, k = 72, 96
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn)
    seen = {}

    def repack(words, size_k, size_n):
        seen["shape"] = (tuple(words.shape), size_k, size_n)
        seen["words"] = words
        return words

    t = prepare_linear("nvfp4", packed, scales, torch.tensor(1.0), torch.bfloat16, repack)
    assert (t.n_pad, t.k_pad) == (128, 128)
    assert seen["shape"] == ((16, 128), 128, 128)
    assert int(seen["words"][12:].abs().sum()) == 0 and int(seen["words"][:, n:].abs().sum()) == 0
    assert t.scales.shape == (8, 128) and t.scales.dtype == torch.float8_e4m3fn
    assert int((t.scales.view(torch.uint8) != 0).sum()) == n * k // 16  # padding stays zero


def _align_reference(ids: list[list[int]], experts: int, block: int):
    flat = [e for row in ids for e in row]
    sorted_ids, owners = [], []
    for e in range(experts):
        rows = [i for i, x in enumerate(flat) if x == e]
        if not rows:
            continue
        padded = rows + [len(flat)] * (-len(rows) % block)
        sorted_ids += padded
        owners += [e] * (len(padded) // block)
    return sorted_ids, owners


@pytest.mark.parametrize("block", [8, 16])
def test_token_alignment_groups_pairs_by_expert_and_skips_foreign_ids(block):
    ids = [[3, 0], [3, -1], [7, 3], [0, 9], [2, 3]]  # 9 and -1: experts another rank holds
    sorted_ids, expert_ids, total = align_tokens(torch.tensor(ids), 8, block)
    want_ids, want_owner = _align_reference(ids, 8, block)
    t = int(total[0])
    assert t == len(want_ids) and sorted_ids[:t].tolist() == want_ids
    assert expert_ids[: t // block].tolist() == want_owner
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32


def test_block_size_grows_with_tokens_per_expert():
    assert block_size_for(1, 8, 128) == 8
    assert block_size_for(128, 8, 128) == 16  # 8 pairs per expert
    assert block_size_for(256, 8, 128) == 32
    assert block_size_for(4096, 8, 128) == 64

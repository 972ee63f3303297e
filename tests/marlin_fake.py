"""A fake Marlin provider for CPU tests: vLLM 0.33.0's op schemas with torch implementations
written from the documented kernel semantics (docs/design/marlin.md), not from its code.

What it proves: that quantdispatch's adapter (preparation, argument order, padding, slicing,
MoE routing around the grouped GEMM) is consistent with the semantics we documented. What it
cannot prove: that the real kernel has those semantics, and its tile repack is not the real
one (any bijection does here). Only the GPU tests with vLLM's library check the real thing.

Nothing here imports quantdispatch: the scale un-permutation, the S0E5M3 decode and the FP4
decode are written again, independently, from the facts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

FP4_TYPE_ID = 562949953487106  # vLLM scalar_types.float4_e2m1f.id
SCHEMAS = {
    ("_C", "marlin_gemm"): (
        "marlin_gemm(Tensor a, Tensor? c_or_none, Tensor b_q_weight, Tensor? b_bias_or_none,"
        "Tensor b_scales, Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, "
        "Tensor workspace, int b_type_id, SymInt size_m, SymInt size_n, SymInt size_k, "
        "bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float) -> Tensor"
    ),
    ("_C", "gptq_marlin_repack"): (
        "gptq_marlin_repack(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits, "
        "bool is_a_8bit) -> Tensor"
    ),
    ("_moe_C", "moe_wna16_marlin_gemm"): (
        "moe_wna16_marlin_gemm(Tensor! a, Tensor? c_or_none,Tensor! b_q_weight, "
        "Tensor? b_bias_or_none,Tensor! b_scales, Tensor? a_scales, Tensor? global_scale, "
        "Tensor? b_zeros_or_none,Tensor! workspace,Tensor sorted_token_ids,Tensor! expert_ids, "
        "Tensor! num_tokens_past_padded,Tensor! topk_weights, int moe_block_size, int top_k, "
        "bool mul_topk_weights, int b_type_id,int size_m, int size_n, int size_k, "
        "bool use_atomic_add,bool use_fp32_reduce, bool is_zp_float,int thread_k, int thread_n, "
        "int blocks_per_sm) -> Tensor"
    ),
}
#: The same ops as vLLM 0.22-0.29 declare them (g_idx / perm / is_k_full), for mismatch tests.
OLD_GEMM_SCHEMA = (
    "marlin_gemm(Tensor a, Tensor? c_or_none, Tensor b_q_weight, Tensor? b_bias_or_none,"
    "Tensor b_scales, Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, "
    "Tensor? g_idx_or_none, Tensor? perm_or_none, Tensor workspace, int b_type_id, "
    "SymInt size_m, SymInt size_n, SymInt size_k, bool is_k_full, bool use_atomic_add, "
    "bool use_fp32_reduce, bool is_zp_float) -> Tensor"
)


def e2m1_from_bits(codes: torch.Tensor) -> torch.Tensor:
    """4-bit code -> float64: magnitude table 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    c = codes.to(torch.int64)
    return torch.where(c >= 8, -table[c & 7], table[c & 7])


def repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit):
    """int32 [K/8, N] (GPTQ order) -> int32 [K/16, 2N] by a fixed bijection."""
    assert b_q_weight.dtype == torch.int32 and num_bits == 4 and not is_a_8bit
    assert tuple(b_q_weight.shape) == (size_k // 8, size_n), (b_q_weight.shape, size_k, size_n)
    assert size_k % 16 == 0 and size_n % 64 == 0
    return b_q_weight.reshape(size_k // 16, 2, size_n).transpose(1, 2).reshape(size_k // 16, -1)


def _unrepack(q: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
    return q.reshape(size_k // 16, size_n, 2).transpose(1, 2).reshape(size_k // 8, size_n)


def _marlin_position_sources(count: int) -> torch.Tensor:
    """For each position of Marlin's scale array, the row-major [K/g, N] entry it holds:
    chunks of 64; inside, position 4q+t reads slot 4q+(0,2,1,3)[t] of a chunk whose slot
    8r+c holds entry r+8c."""
    table = []
    for pos in range(64):
        q, t = divmod(pos, 4)
        slot = 4 * q + (0, 2, 1, 3)[t]
        r, c = divmod(slot, 8)
        table.append(r + 8 * c)
    base = torch.tensor(table, dtype=torch.int64)
    return (torch.arange(count // 64)[:, None] * 64 + base).reshape(-1)


def _unpermute(scales: torch.Tensor) -> torch.Tensor:
    g, n = scales.shape
    flat = torch.empty(g * n, dtype=scales.dtype)
    flat[_marlin_position_sources(g * n)] = scales.reshape(-1)
    return flat.reshape(g, n)


def s0e5m3_value(byte: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """float64 value the kernel reads from an encoded NVFP4 scale byte eeeeemmm."""
    b = byte.to(torch.int64)
    e5, m3 = b >> 3, (b & 7).to(torch.float64)
    if act == torch.float16:  # the byte lands in fp16 bits 14..7
        normal = torch.pow(2.0, (e5 - 15).to(torch.float64)) * (1 + m3 / 8)
        return torch.where(e5 == 0, m3 / 8 * 2.0**-14, normal)
    exponent = (e5 >> 4) * 128 + (e5 & 15)  # bf16: top bit to the exponent's top bit
    normal = torch.pow(2.0, (exponent - 127).to(torch.float64)) * (1 + m3 / 8)
    return torch.where(exponent == 0, m3 / 8 * 2.0**-126, normal)


def weight64(q, scales, global_scale, size_k, size_n, act) -> torch.Tensor:
    """[K, N] float64 weight the kernel multiplies by, from the provider-layout tensors."""
    words = _unrepack(q, size_k, size_n).to(torch.int64)
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1)
    values = e2m1_from_bits(nibbles.reshape(size_k, size_n))
    sbytes = _unpermute(scales.view(torch.uint8).cpu())
    if scales.dtype == torch.float8_e4m3fn:
        assert global_scale is not None and tuple(sbytes.shape) == (size_k // 16, size_n)
        fp4_offset = 2.0 ** -(14 if act == torch.float16 else 126)
        s = s0e5m3_value(sbytes, act) * fp4_offset * float(global_scale.reshape(-1)[0])
        return values * s.repeat_interleave(16, 0)
    assert scales.dtype == torch.float8_e8m0fnu and global_scale is None
    assert act == torch.bfloat16, "no fp16 MXFP4 Marlin kernel"
    b = sbytes.to(torch.float64)
    s = torch.where(b == 0, torch.zeros_like(b), torch.pow(2.0, b - 127))
    return values * s.repeat_interleave(32, 0)


def _check_tiles(size_n: int, size_k: int) -> None:
    ok = (size_n % 64 == 0 and size_k % 128 == 0) or (size_n % 128 == 0 and size_k % 64 == 0)
    if not ok:
        raise RuntimeError(f"Invalid thread config for size_n={size_n} size_k={size_k}")


def gemm(a, c, q, bias, scales, a_scales, g, zeros, ws, type_id, m, n, k, atomic, fp32, zpf):
    assert type_id == FP4_TYPE_ID and a_scales is None and zeros is None and bias is None
    assert a.dtype in (torch.float16, torch.bfloat16) and tuple(a.shape) == (m, k)
    assert ws.dtype == torch.int32 and ws.numel() > 0 and not zpf
    _check_tiles(n, k)
    w = weight64(q, scales, g, k, n, a.dtype)
    return (a.double() @ w).to(a.dtype)


def moe_gemm(
    a, c, q, bias, scales, a_scales, g, zeros, ws, sorted_ids, expert_ids, n_padded,
    topk_weights, block, top_k, mul_w, type_id, size_m, size_n, size_k, atomic, fp32, zpf,
    thread_k, thread_n, blocks_per_sm,
):  # fmt: skip
    assert type_id == FP4_TYPE_ID and bias is None and a_scales is None and zeros is None
    assert block in (8, 16, 32, 48, 64) and sorted_ids.dtype == torch.int32
    _check_tiles(size_n, size_k)
    out = c.clone() if c is not None else torch.zeros(size_m * top_k, size_n, dtype=a.dtype)
    total = int(n_padded[0])
    assert total % block == 0
    for b in range(total // block):
        e = int(expert_ids[b])
        assert 0 <= e < q.shape[0], f"block {b} has expert {e}"
        rows = sorted_ids[b * block : (b + 1) * block].to(torch.int64)
        rows = rows[rows < size_m * top_k]
        if rows.numel() == 0:
            continue
        gs = g[e] if g is not None else None
        w = weight64(q[e], scales[e], gs, size_k, size_n, a.dtype)
        y = a[rows // top_k].double() @ w
        if mul_w:
            y = y * topk_weights.reshape(-1)[rows].double()[:, None]
        out[rows] = y.to(a.dtype)
    return out


_IMPLS = {
    ("_C", "marlin_gemm"): gemm,
    ("_C", "gptq_marlin_repack"): repack,
    ("_moe_C", "moe_wna16_marlin_gemm"): moe_gemm,
}


@contextlib.contextmanager
def fake_ops(*, moe: bool = True, gemm_schema: str | None = None) -> Iterator[None]:
    """Register the fake ops (torch.ops._C / torch.ops._moe_C) for the duration."""
    libs = {}
    try:
        for (ns, name), schema in SCHEMAS.items():
            if ns == "_moe_C" and not moe:
                continue
            if name == "marlin_gemm" and gemm_schema is not None:
                schema = gemm_schema
            lib = libs.setdefault(ns, torch.library.Library(ns, "FRAGMENT"))
            lib.define(schema)
            lib.impl(name, _IMPLS[(ns, name)], "CompositeExplicitAutograd")
        yield
    finally:
        for lib in libs.values():
            lib._destroy()

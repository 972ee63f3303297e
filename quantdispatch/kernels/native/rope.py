"""Rotary position embedding of queries and keys in one kernel (the HF integration's fused ops).

HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` computes ``q * cos + rotate_half(q) * sin`` and the
same for k: ten small kernels per attention layer (a multiply, a negation, a concatenation, a
multiply and an add, twice). :func:`rope` computes both in one launch and rounds where eager
rounds: each product once to the 16-bit dtype, then their sum once (the products of two 16-bit
values are exact in fp32, and the sum is an fp32 add rounded to 16 bits as torch's), so the
results are bit-identical to HF's.

Layout: q [B, Hq, S, D] and k [B, Hk, S, D] with any strides whose last is 1 (HF passes the
projections viewed as [B, S, H, D] and transposed); cos and sin [B or 1, S, D] with a last stride
of 1. The outputs take their inputs' strides (``empty_like``), as eager's elementwise ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.errors import InputError, format_error
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.native.fp8_prefill_quant import widen16
from quantdispatch.kernels.native.fp8_producers import _narrow, _round16

__all__ = ["rope", "rope_eligible", "rope_launch"]

_16_BIT = (torch.bfloat16, torch.float16)
_HEADS = 8  # heads per program


@triton.jit
def _rope_heads(x_ptr, o_ptr, c_row, s_row, b, s, h0, nh, sxb, sxh, sxs, sob, soh, sos, half,
                HB: tl.constexpr, HALF: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    heads = h0 + tl.arange(0, HB)
    d = tl.arange(0, HALF)
    m = (heads < nh)[:, None] & (d < half)[None, :]
    hx = heads.to(tl.int64)[:, None]
    x_at = x_ptr + b * sxb + s * sxs + hx * sxh + d[None, :]
    o_at = o_ptr + b * sob + s * sos + hx * soh + d[None, :]
    x1 = widen16(tl.load(x_at, mask=m, other=0), BF16)
    x2 = widen16(tl.load(x_at + half, mask=m, other=0), BF16)
    dm = d < half
    c1 = widen16(tl.load(c_row + d, mask=dm, other=0), BF16)[None, :]
    c2 = widen16(tl.load(c_row + half + d, mask=dm, other=0), BF16)[None, :]
    s1 = widen16(tl.load(s_row + d, mask=dm, other=0), BF16)[None, :]
    s2 = widen16(tl.load(s_row + half + d, mask=dm, other=0), BF16)[None, :]
    # rotate_half(x) = cat(-x2, x1): out1 = x1 c1 + (-x2) s1, out2 = x2 c2 + x1 s2
    y1 = _round16(_round16(x1 * c1, BF16) + _round16(-x2 * s1, BF16), BF16)
    y2 = _round16(_round16(x2 * c2, BF16) + _round16(x1 * s2, BF16), BF16)
    tl.store(o_at, _narrow(y1, BF16), mask=m)
    tl.store(o_at + half, _narrow(y2, BF16), mask=m)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, c_ptr, s_ptr, seq, hq, hk, half,
                 sqb, sqh, sqs, skb, skh, sks, sqob, sqoh, sqos, skob, skoh, skos,
                 scb, scs, ssb, sss, HB: tl.constexpr, HALF: tl.constexpr,
                 BF16: tl.constexpr):  # fmt: skip
    """One program: one token (batch row b, position s) and up to HB heads of q or of k."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    b = (t // seq).to(tl.int64)
    s = (t % seq).to(tl.int64)
    c_row = c_ptr + b * scb + s * scs
    s_row = s_ptr + b * ssb + s * sss
    nqb = tl.cdiv(hq, HB)
    if j < nqb:
        _rope_heads(q_ptr, qo_ptr, c_row, s_row, b, s, j * HB, hq, sqb, sqh, sqs, sqob, sqoh,
                    sqos, half, HB, HALF, BF16)  # fmt: skip
    else:
        _rope_heads(k_ptr, ko_ptr, c_row, s_row, b, s, (j - nqb) * HB, hk, skb, skh, sks, skob,
                    skoh, skos, half, HB, HALF, BF16)  # fmt: skip


def rope_eligible(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rope` computes this call (else the caller runs the model's own function):
    the layout of the module doc, one 16-bit dtype, an even head size, one device."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    b, _, s, d = q.shape
    return (
        q.dtype in _16_BIT
        and k.dtype is q.dtype
        and cos.dtype is q.dtype
        and sin.dtype is q.dtype
        and d % 2 == 0
        and k.shape[0] == b
        and k.shape[2] == s
        and k.shape[3] == d
        and cos.shape[0] in (1, b)
        and cos.shape[1:] == (s, d)
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and k.device == q.device
        and cos.device == q.device
        and sin.device == q.device
    )


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # type: ignore[no-untyped-def]
    """(q_embed, k_embed): HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` with its default
    ``unsqueeze_dim=1``, bit for bit, in one launch (module doc for the layouts)."""
    if not rope_eligible(q, k, cos, sin):
        raise InputError(
            format_error(
                f"rope: q {q.dtype} {tuple(q.shape)}, k {k.dtype} {tuple(k.shape)}, "
                f"cos {cos.dtype} {tuple(cos.shape)}",
                "q [B, Hq, S, D], k [B, Hk, S, D], cos / sin [B or 1, S, D], one 16-bit dtype, "
                "even D, unit last strides, one device",
                "call the model's own apply_rotary_pos_emb",
            )
        )
    return rope_launch(q, k, cos, sin)


def rope_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # type: ignore[no-untyped-def]
    """:func:`rope` for callers that have checked :func:`rope_eligible` themselves (the fused
    attention's per-call path): the launch only."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    bf16 = q.dtype == torch.bfloat16
    v = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
    half = d // 2
    grid = (b * s, triton.cdiv(hq, _HEADS) + triton.cdiv(hk, _HEADS))
    cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    launch(
        _rope_kernel, grid, v(q), v(k), v(qo), v(ko), v(cos), v(sin), s, hq, hk, half,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        cb, cos.stride(1), sb, sin.stride(1),
        HB=_HEADS, HALF=triton.next_power_of_2(half), BF16=bf16, num_warps=4,
    )  # fmt: skip
    return qo, ko

"""The fused rotary embedding kernel (quantdispatch.kernels.native.rope) against HF's formula
run by torch in the same dtype: bit for bit, in the layouts HF passes (projections viewed as
[B, S, H, D] and transposed), with grouped heads, a cos / sin batch of 1 or B, head sizes that
are not powers of two, and more heads than a program takes. Bad layouts raise our error."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from quantdispatch.errors import InputError
from quantdispatch.kernels.native.rope import rope, rope_eligible


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _eager(q, k, cos, sin):  # type: ignore[no-untyped-def]
    """HF's apply_rotary_pos_emb with unsqueeze_dim=1, op by op."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _inputs(b, s, hq, hk, d, dtype, cos_batch, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq * d, generator=g).to(dtype).view(b, s, hq, d).transpose(1, 2)
    k = (3 * torch.randn(b, s, hk * d, generator=g)).to(dtype).view(b, s, hk, d).transpose(1, 2)
    pos = torch.arange(s, dtype=torch.float32) + 7
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)  # [S, D]
    cb = b if cos_batch else 1
    cos = (emb.cos() * 1.3).to(dtype)[None].expand(cb, s, d).contiguous()
    sin = (emb.sin() * 1.3).to(dtype)[None].expand(cb, s, d).contiguous()
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("b", "s", "hq", "hk", "d", "cos_batch"),
    [(1, 1, 4, 2, 64, False), (2, 3, 12, 4, 80, True), (3, 2, 9, 9, 32, False),
     (1, 5, 2, 1, 16, True)],
)
def test_rope_is_hfs_formula_bit_for_bit(dtype, b, s, hq, hk, d, cos_batch):
    q, k, cos, sin = _inputs(b, s, hq, hk, d, dtype, cos_batch)
    assert rope_eligible(q, k, cos, sin)
    got_q, got_k = rope(q, k, cos, sin)
    want_q, want_k = _eager(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == q.stride() and got_k.stride() == k.stride()


def test_rope_handles_huge_and_tiny_values_as_eager_does():
    q, k, cos, sin = _inputs(1, 2, 3, 1, 32, torch.bfloat16, False, seed=3)
    q = q.clone()
    q[0, 0, 0, :4] = torch.tensor([3.0e38, -3.0e38, 1e-39, 0.0], dtype=torch.bfloat16)
    got_q, got_k = rope(q, k, cos, sin)
    want_q, want_k = _eager(q, k, cos, sin)
    assert torch.equal(got_q.isnan(), want_q.isnan())
    assert torch.equal(got_q.nan_to_num(), want_q.nan_to_num()) and torch.equal(got_k, want_k)


def test_rope_refuses_what_it_does_not_compute():
    q, k, cos, sin = _inputs(1, 2, 4, 2, 32, torch.bfloat16, False)
    assert not rope_eligible(q.float(), k, cos, sin)  # mixed dtypes
    assert not rope_eligible(q[..., :31], k[..., :31], cos[..., :31], sin[..., :31])  # odd D
    assert not rope_eligible(q.transpose(2, 3), k, cos, sin)  # last stride != 1
    assert not rope_eligible(q, k, cos[:, :1], sin[:, :1])  # other positions
    with pytest.raises(InputError, match="rope: q"):
        rope(q.float(), k, cos, sin)

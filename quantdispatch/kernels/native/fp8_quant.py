"""Dynamic per-token FP8 (e4m3) activation quantization in one Triton launch.

The native FP8 path quantizes activations on every call; done with torch ops that is five or
six kernels (abs, amax, clamp, divide, cast...), which at decode sizes costs more than the FP8
GEMM saves. One program per token row computes amax, scale = amax / 448 and the saturated e4m3
codes. Runs only where native FP8 runs (SM89+), so Triton's hardware fp8 conversion is allowed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantdispatch.kernels.common.launch import launch

__all__ = ["quantize_per_token_fp8"]

E4M3_MAX = 448.0


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < k, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, k, BLOCK_K):
        mask = k0 + offs < k
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)  # IEEE, like torch
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(tl.float8e4nv), mask=mask)


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16 (K contiguous) -> (e4m3 codes [M, K], fp32 scales [M, 1]).

    Same maths as the torch-ops version: scale = max(amax, 1e-12) / 448, codes = saturate(x /
    scale) rounded to nearest even.
    """
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block_k = min(4096, triton.next_power_of_2(k))
    launch(
        _per_token_fp8_kernel, (m,), x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=block_k,
        num_warps=8,
    )  # fmt: skip
    return q, s

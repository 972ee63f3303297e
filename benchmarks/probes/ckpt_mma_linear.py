"""The checkpoint-layout mma.sync kernel in its LINEAR mode (rows are tokens, ``y = x W^T *
global scale + bias``), for mma_sweep.py ``--ckpt`` and profile_mma.py ``--kernel ckpt``.

The package never runs it: linears are repacked into the mma16x64 layout on SM 8.0+, and the
checkpoint-layout decode costs more per weight (docs/design/checkpoint-layout.md). The
kernel (:func:`quantdispatch.kernels.common.moe_mma.checkpoint_mma_kernel`) keeps the
mode as this comparison's subject; the MoE modes are what the package launches.
"""

from __future__ import annotations

import torch
import triton

from quantdispatch.kernels.common.checks import rows_aligned
from quantdispatch.kernels.common.configs import mma_base_config
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.common.moe_mma import checkpoint_mma_kernel


def mma_ckpt_supported_shape(n: int, k: int) -> bool:
    """Whole 16-row tiles and 64-column chunks."""
    return n > 0 and k > 0 and n % 16 == 0 and k % 64 == 0


def linear_config(tiles: int, chunks: int, m: int) -> tuple[int, int, int, int]:
    """(NT, WT, WK, UNROLL) for a linear call: the repacked kernel's one-step heuristic
    (:func:`quantdispatch.kernels.common.configs.mma_base_config`) without its tiles-per-warp R
    (this kernel has neither R nor DEPTH; its configs were not swept again when the repacked
    kernel got DEPTH 2)."""
    nt, wt, wk, unroll, _ = mma_base_config(tiles, chunks, m)
    return nt, wt, wk, unroll


def mma_ckpt_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ W.T * global_scale (+ bias)`` for an NVFP4 weight in the checkpoint layout
    (packed [N, K/2] uint8, E4M3 codes [N, K/16] uint8); x [M, K] fp16/bf16, out [M, N].

    ``config`` = (NT, WT, WK, UNROLL) overrides the heuristic (tuning); WT must divide N/16."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if not mma_ckpt_supported_shape(n, k) or not rows_aligned(packed):
        raise ValueError(
            f"weight {n}x{k} (strides {packed.stride()}) is not whole 16x64 tiles with 16-byte "
            "aligned rows"
        )
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(0) % 8 or x.data_ptr() % 16 or x.stride(1) != 1:  # 16-byte loads of x rows
        x = x.clone(memory_format=torch.contiguous_format)
    tiles, chunks = n // 16, k // 64
    nt, wt, wk, unroll = config or linear_config(tiles, chunks, m)
    if tiles % wt:
        raise ValueError(f"WT={wt} does not divide the {tiles} tiles")
    grid = (triton.cdiv(m, 8 * nt), tiles // wt)
    launch(checkpoint_mma_kernel, grid,
        x, x, x, x, x, global_scale,
        packed, block_scale_u8, global_scale, bias if bias is not None else global_scale, out,
        m, 1, 1, 0,
        x.stride(0), 0, packed.stride(0), 0, block_scale_u8.stride(0), 0, out.stride(0),
        0.0, 0.0,
        CHUNKS=chunks, GATE_UP=False, ACT=0, HAS_BIAS=bias is not None, DIRECT=False,
        LINEAR=True, NT=nt, WT=wt, WK=wk, UNROLL=unroll, BF16=x.dtype == torch.bfloat16,
        REPACKED=False, num_warps=wt * wk, num_stages=1,
    )  # fmt: skip
    return out

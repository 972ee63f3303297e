"""The stacked canonical expert tensors of the checkpoint layout as the MoE kernels take them:
each stack checked and unpacked once (:func:`unpack_stack`), the FP8 scale strides and kinds
(:func:`scale_strides`), and whether the mma.sync kernels may read the stacks
(:func:`weights_aligned`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from quantdispatch.errors import WeightFormatError, format_error
from quantdispatch.kernels.common.checks import rows_aligned

__all__ = [
    "FORMAT_CODES",
    "GROUPS",
    "ExpertStack",
    "fail",
    "scale_strides",
    "unpack_stack",
    "weights_aligned",
]

#: The kernels' FMT constexpr per format, and the K elements per block scale.
FORMAT_CODES = {"nvfp4": 0, "mxfp4": 1, "fp8": 2}
GROUPS = {"nvfp4": 16, "mxfp4": 32, "fp8": 1}


def fail(what: str, rule: str, fix: str, exc: type[Exception] = WeightFormatError) -> None:
    raise exc(format_error(f"fused_moe: {what}", rule, fix))


class ExpertStack(NamedTuple):
    """One checked stack: codes (uint8 views), scales, the NVFP4 global scales (else None) and
    its [E, N, K]."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    e: int
    n: int
    k: int


def weights_aligned(fmt: str, w13_codes: torch.Tensor, w2_codes: torch.Tensor) -> bool:
    """Whether the mma kernels may take these stacks: NVFP4 with 16-byte aligned weight rows
    (they load 8 bytes per row; the plan checks format, GPU and shapes)."""
    return fmt == "nvfp4" and rows_aligned(w13_codes) and rows_aligned(w2_codes)


def unpack_stack(
    fmt: str, w: Sequence[torch.Tensor], which: str, block_size: tuple[int, int] | None
) -> ExpertStack:
    """The stack ``w`` of ``fmt`` checked (``which`` names it in errors)."""
    need = {"nvfp4": 3, "mxfp4": 2, "fp8": 2}[fmt]
    if len(w) != need:
        fail(
            f"{which} has {len(w)} tensors",
            f"{fmt} expert weights are {need} stacked tensors",
            "pass the stacked canonical tensors (see quantdispatch.moe)",
        )
    codes = w[0]
    if codes.dim() != 3 or codes.stride(-1) != 1:
        fail(
            f"{which}[0] has shape {tuple(codes.shape)}",
            "stacked expert weights are [E, N, K/2] (fp4) or [E, N, K] (fp8), rows contiguous",
            "stack the experts' weights with torch.stack",
        )
    if fmt == "fp8":
        return _fp8_stack(codes, w[1], which, block_size)
    return _fp4_stack(fmt, w, which)


def _fp8_stack(
    codes: torch.Tensor, scale: torch.Tensor, which: str, block_size: tuple[int, int] | None
) -> ExpertStack:
    e, n, k = codes.shape
    if codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
        fail(f"{which}[0] is {codes.dtype}", "FP8 weights are float8_e4m3fn", "")
    if scale.dtype != torch.float32:
        fail(f"{which}[1] is {scale.dtype}", "FP8 scales are float32", "convert at load")
    per_expert = scale.dim() == 1 and scale.shape[0] == e
    if per_expert or (scale.dim() == 2 and tuple(scale.shape) == (e, n)):
        pass
    elif scale.dim() == 3 and block_size is not None:
        bn, bk = block_size
        want = (e, -(-n // bn), -(-k // bk))
        if tuple(scale.shape) != want or bk % 16 != 0:
            fail(
                f"{which}[1] has shape {tuple(scale.shape)} with block {(bn, bk)}",
                f"block scales are [E, ceil(N/bn), ceil(K/bk)] = {list(want)}, bk % 16 == 0",
                "pass block_size=(bn, bk) matching the checkpoint's weight_block_size",
            )
    else:
        fail(
            f"{which}[1] has shape {tuple(scale.shape)} (block_size {block_size})",
            "FP8 expert scales are [E] (tensor), [E, N] (channel) or [E, nb, kb] with "
            "block_size=(bn, bk) (block)",
            "pass the stacked scales of this layer",
        )
    return ExpertStack(codes.view(torch.uint8), scale, None, e, n, k)


def _fp4_stack(fmt: str, w: Sequence[torch.Tensor], which: str) -> ExpertStack:
    codes, scale = w[0], w[1]
    e, n = codes.shape[0], codes.shape[1]
    group = GROUPS[fmt]
    if codes.dtype != torch.uint8:
        fail(f"{which}[0] is {codes.dtype}", "packed FP4 codes are uint8 [E, N, K/2]", "")
    k = codes.shape[2] * 2
    want_dt = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    if (
        scale.dtype not in (want_dt, torch.uint8)
        or tuple(scale.shape) != (e, n, k // group)
        or scale.stride(-1) != 1
    ):
        fail(
            f"{which}[1] is {scale.dtype} {tuple(scale.shape)}",
            f"{fmt} block scales are {want_dt} [E, N, K/{group}] = [{e}, {n}, {k // group}]",
            "pass the stacked block scales of this layer",
        )
    gs = None
    if fmt == "nvfp4":
        gs = w[2]
        if gs.dtype != torch.float32 or tuple(gs.shape) != (e,):
            fail(
                f"{which}[2] is {gs.dtype} {tuple(gs.shape)}",
                f"NVFP4 experts have one float32 global scale (multiplier) each: [{e}]",
                "stack the per-expert global scales (merged gate/up share one)",
            )
    return ExpertStack(codes, scale.view(torch.uint8), gs, e, n, k)


def scale_strides(fmt: str, scale: torch.Tensor) -> tuple[int, int, int, int]:
    """(stride_se, stride_sn, stride_sk, scale kind) for the kernels."""
    if fmt != "fp8":
        return scale.stride(0), scale.stride(1), 0, 0
    if scale.dim() == 1:
        return scale.stride(0), 0, 0, 0
    if scale.dim() == 2:
        return scale.stride(0), scale.stride(1), 0, 1
    return scale.stride(0), scale.stride(1), scale.stride(2), 2

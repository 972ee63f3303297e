"""Native FP8 W8A8 through ``torch._scaled_mm`` (FP8 tensor cores, SM89+).

Layout contract of ``torch._scaled_mm``: ``mat_a`` row-major [M, K] e4m3, ``mat_b``
column-major [K, N] e4m3, fp32 scales that are either both one-element (tensor-wise) or
``[M, 1]`` and ``[1, N]`` (row-wise). A checkpoint's row-major weight [N, K] transposed is
exactly a column-major [K, N] view, so no weight copy is ever needed; the only preparation is
turning the weight scale into the fp32 ``[1, N]`` (or one-element) tensor, which
:func:`prepare_fp8_scaled_mm` does once at load time (the linear also accepts unprepared
scales and then reshapes/expands them per call).

Activations: ``input_scale=None`` quantizes x per token (row-wise amax / 448) on every call
and uses row-wise scaling; a static per-tensor ``input_scale`` quantizes with that scale and
uses tensor-wise scaling when the weight scale is per-tensor, row-wise otherwise. Row-wise
scaling produces bf16 (older builds reject fp16 there), so fp16 callers get a bf16 result
cast to fp16: bf16-level accuracy.
"""

from __future__ import annotations

import torch

from quantdispatch.capability import SM89_PLUS
from quantdispatch.errors import (
    BackendUnavailableError,
    InputError,
    WeightFormatError,
    format_error,
)
from quantdispatch.kernels.common.device_facts import device_facts

__all__ = ["fp8_scaled_mm_linear", "prepare_fp8_scaled_mm"]

E4M3_MAX = 448.0
_WHERE = "fp8_scaled_mm_linear"
_X_DTYPES = (torch.float16, torch.bfloat16)


def prepare_fp8_scaled_mm(
    weight: torch.Tensor, weight_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check once at load; return ``(weight, scale)`` ready for :func:`fp8_scaled_mm_linear`.

    ``weight`` stays the contiguous e4m3 [N, K] tensor (its ``.t()`` is the column-major
    operand). ``scale`` becomes fp32: one element for a per-tensor scale, ``[1, N]`` for a
    per-channel one (the row-wise operand shape). No weight bytes are copied.
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise WeightFormatError(
            format_error(
                f"{_WHERE}: weight is {weight.dtype} {tuple(weight.shape)}",
                "native FP8 needs a float8_e4m3fn [N, K] weight",
                "load the checkpoint weight as e4m3",
            )
        )
    n, k = weight.shape
    if n % 16 or k % 16:
        raise WeightFormatError(
            format_error(
                f"{_WHERE}: weight shape {(n, k)}",
                "torch._scaled_mm needs N and K multiples of 16",
                "use the weight-only FP8 kernel (fp8_weight_only_linear) for this layer",
            )
        )
    if not weight.is_contiguous():
        weight = weight.contiguous()
    scale = weight_scale.to(torch.float32)
    if scale.numel() == 1:
        scale = scale.reshape(())
    elif scale.numel() == n and scale.dim() in (1, 2):
        scale = scale.reshape(1, n).contiguous()
    else:
        raise WeightFormatError(
            format_error(
                f"{_WHERE}: weight_scale shape {tuple(weight_scale.shape)}",
                f"it must be per-tensor (one element) or per-channel ({n} elements)",
                "block-scaled FP8 goes through fp8_weight_only_linear",
            )
        )
    if scale.device != weight.device:
        raise WeightFormatError(
            format_error(
                f"{_WHERE}: weight_scale on {scale.device}, weight on {weight.device}",
                "scales live beside the weight",
                "move both to the layer's device at load",
            )
        )
    return weight, scale


def _quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise dynamic quantization: scale = amax(|x_row|) / 448 (>= tiny), e4m3 codes."""
    amax = x.abs().amax(dim=1, keepdim=True).to(torch.float32)
    scale = amax.clamp(min=1e-12) / E4M3_MAX
    q = (x.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _check_x(x: torch.Tensor) -> None:
    """x a 2-D 16-bit tensor on an SM89+ GPU."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise InputError(
            format_error(
                f"{_WHERE}: x is {getattr(x, 'dtype', type(x).__name__)} "
                f"{tuple(getattr(x, 'shape', ()))}",
                "x must be a 2-D float16/bfloat16 [M, K] tensor",
                "flatten and cast x first",
            )
        )
    if x.device.type != "cuda":
        raise InputError(
            format_error(
                f"{_WHERE}: x is on {x.device}",
                "torch._scaled_mm runs on CUDA only",
                "move x and the layer to an SM89+ GPU",
            )
        )
    facts = device_facts(x.device)
    name, cap = facts.name, facts.capability or (0, 0)
    if cap not in SM89_PLUS:
        raise BackendUnavailableError(
            format_error(
                f"{_WHERE}: {name} is SM{cap[0]}{cap[1]}",
                "FP8 tensor cores need SM89 or newer",
                "use fp8_weight_only_linear (W8A16) on this GPU",
            )
        )


def _check_operands(
    x: torch.Tensor, k: int, n: int, operands: dict[str, torch.Tensor | None]
) -> None:
    """x's K is the weight's, every operand (by name) on x's device, the bias [N]."""
    if x.shape[1] != k:
        raise InputError(
            format_error(
                f"{_WHERE}: x has K={x.shape[1]}, weight has K={k}",
                "they must match",
                "pass this layer's activation",
            )
        )
    for nm, t in operands.items():
        if t is not None and t.device != x.device:
            raise InputError(
                format_error(
                    f"{_WHERE}: {nm} is on {t.device}, x on {x.device}",
                    "one device for all operands",
                    f"move {nm} at load time",
                )
            )
    bias = operands.get("bias")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise InputError(
            format_error(
                f"{_WHERE}: bias shape {tuple(bias.shape)}",
                f"bias must be [N={n}]",
                "pass the layer's bias",
            )
        )


def _quantize_x(
    x: torch.Tensor, input_scale: torch.Tensor | None, w_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(e4m3 x, its scale, row-wise?): per token when ``input_scale`` is None, else with the
    static scale (tensor-wise where the weight scale is too)."""
    if input_scale is None:
        if x.is_cuda and x.stride(1) == 1:
            from quantdispatch.kernels.native.fp8_quant import quantize_per_token_fp8

            xq, scale_a = quantize_per_token_fp8(x)  # one launch instead of ~6 torch ops
        else:
            xq, scale_a = _quantize_per_token(x)
        return xq, scale_a, True
    if input_scale.numel() != 1:
        raise InputError(
            format_error(
                f"{_WHERE}: input_scale has {input_scale.numel()} elements",
                "a static activation scale is one float32 element",
                "pass the checkpoint's input_scale",
            )
        )
    s_in = input_scale.to(torch.float32).reshape(())
    xq = (x.to(torch.float32) / s_in).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    rowwise = w_scale.numel() != 1
    scale_a = s_in.reshape(1, 1).expand(x.shape[0], 1).contiguous() if rowwise else s_in
    return xq, scale_a, rowwise


def fp8_scaled_mm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` on FP8 tensor cores; [M, N] in x.dtype.

    ``weight_scale``: one element or [N] (or the [1, N] form from the prepare step);
    ``input_scale``: None for dynamic per-token quantization, else a one-element fp32 tensor.
    """
    _check_x(x)
    weight, w_scale = (
        (weight, weight_scale)
        if weight_scale.dtype == torch.float32 and weight_scale.dim() in (0, 2)
        else prepare_fp8_scaled_mm(weight, weight_scale)
    )
    n, k = weight.shape
    operands = {"weight": weight, "weight_scale": w_scale, "input_scale": input_scale}
    _check_operands(x, k, n, {**operands, "bias": bias})
    if x.shape[0] == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    x = x if x.is_contiguous() else x.contiguous()
    xq, scale_a, rowwise = _quantize_x(x, input_scale, w_scale)
    if rowwise:
        scale_b = w_scale if w_scale.dim() == 2 else w_scale.reshape(1, 1).expand(1, n).contiguous()
        out_dtype = torch.bfloat16
    else:
        scale_b = w_scale.reshape(())
        out_dtype = x.dtype
    fused_bias = bias.to(out_dtype) if bias is not None and out_dtype == x.dtype else None
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=fused_bias, out_dtype=out_dtype
    )
    if out_dtype != x.dtype:  # fp16 with row-wise scales: bias in fp32, then one cast
        if bias is not None:
            return (out.to(torch.float32) + bias.to(torch.float32)).to(x.dtype)
        return out.to(x.dtype)
    return out

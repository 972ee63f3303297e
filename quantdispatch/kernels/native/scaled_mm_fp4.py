"""NVFP4 W4A4 linear through ``torch._scaled_mm`` (cuBLASLt's block-scaled FP4 GEMM).

Per call: quantize x to NVFP4 with the checkpoint's activation scale (plain torch or the Triton
kernel; the same bits), call ``torch._scaled_mm`` on ``float4_e2m1fn_x2`` views with e4m3 block
scales in the swizzled 128x4 layout and an fp32 output, then apply alpha = a * w (the two
per-tensor scales) in fp32, add the bias in fp32, and cast once. ``torch._scaled_mm`` takes no
per-tensor scale for NVFP4 (``scale_result`` is only used for fp8 outputs), hence the fp32
epilogue. The weight is prepared once at load (:func:`prepare_nvfp4_scaled_mm`).

Facts about torch's support, with their sources, are in :data:`FP4_SCALED_MM` and
docs/design/native-fp4.md. Nothing here probes the device: the backend checks the GPU with
:func:`fp4_scaled_mm_reasons` before choosing this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantdispatch.errors import InputError, WeightFormatError, format_error
from quantdispatch.formats.nvfp4_act import (
    GROUP,
    activation_scale,
    gemm_alpha,
    quantize_nvfp4_activations_raw,
    swizzle_block_scales,
)
from quantdispatch.kernels.common.checks import check_native_call

__all__ = [
    "FP4_SCALED_MM",
    "Fp4ScaledMmFacts",
    "PreparedNvfp4ScaledMm",
    "fp4_scaled_mm_reasons",
    "nvfp4_scaled_mm_linear",
    "prepare_nvfp4_scaled_mm",
]

_WHERE = "nvfp4_scaled_mm_linear"


@dataclass(frozen=True)
class Fp4ScaledMmFacts:
    """What ``torch._scaled_mm`` needs for NVFP4 operands (sources: docs/design/native-fp4.md)."""

    min_torch: tuple[int, int]
    min_cuda: tuple[int, int]
    capabilities: tuple[tuple[int, int], ...]  # run by torch's own NVFP4 tests / users
    capabilities_unverified: tuple[tuple[int, int], ...]  # torch does not refuse; cuBLASLt decides
    k_multiple: int  # v1 checks the packed K/2 against 16
    n_multiple: int
    scale_dtype: torch.dtype
    scale_layout: str
    out_dtypes: tuple[torch.dtype, ...]
    bias_with_fp32_out: bool
    fast_accum: bool
    global_scale_argument: bool  # v1 _scaled_mm: none (torch.nn.functional.scaled_mm v2 has one)


FP4_SCALED_MM = Fp4ScaledMmFacts(
    min_torch=(2, 8),
    min_cuda=(12, 8),
    capabilities=((10, 0), (10, 3)),
    capabilities_unverified=((11, 0), (12, 0), (12, 1)),
    k_multiple=32,
    n_multiple=16,
    scale_dtype=torch.float8_e4m3fn,
    scale_layout="128x4 tiles (rows padded to 128, K/16 padded to 4), 32x4x4 interleave, "
    "contiguous, numel round_up(rows, 128) * round_up(K/16, 4)",
    out_dtypes=(torch.bfloat16, torch.float16, torch.float32),
    bias_with_fp32_out=False,
    fast_accum=False,
    global_scale_argument=False,
)


def _version(v: str | None) -> tuple[int, int] | None:
    if not v:
        return None
    try:
        parts = v.split("+")[0].split(".")
        return (int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0))
    except (ValueError, IndexError):
        return None


def fp4_scaled_mm_reasons(
    *,
    torch_version: str | None,
    cuda_version: str | None,
    capability: tuple[int, int] | None,
    n: int | None = None,
    k: int | None = None,
) -> list[str]:
    """Why ``torch._scaled_mm`` NVFP4 cannot run with these facts ([] = nothing known against).

    An SM in ``capabilities_unverified`` passes: torch does not refuse it, only the first-use
    self-check can tell whether this build's cuBLASLt runs it.
    """
    f = FP4_SCALED_MM
    reasons = []
    tv = _version(torch_version)
    if tv is None or tv < f.min_torch:
        reasons.append(
            f"torch {torch_version or 'unknown'} has no NVFP4 torch._scaled_mm "
            f"(needs >= {f.min_torch[0]}.{f.min_torch[1]})"
        )
    cv = _version(cuda_version)
    if cv is None or cv < f.min_cuda:
        reasons.append(
            f"torch's CUDA build is {cuda_version or 'none'}; the FP4 data type needs CUDA >= "
            f"{f.min_cuda[0]}.{f.min_cuda[1]}"
        )
    if capability is not None and capability not in f.capabilities + f.capabilities_unverified:
        reasons.append(
            f"SM {capability[0]}.{capability[1]} has no FP4 tensor cores (NVFP4 needs SM 10.x, "
            "11.0 or 12.x)"
        )
    if k is not None and k % f.k_multiple:
        reasons.append(f"K={k} is not a multiple of {f.k_multiple} (torch._scaled_mm FP4 rule)")
    if n is not None and n % f.n_multiple:
        reasons.append(f"N={n} is not a multiple of {f.n_multiple} (torch._scaled_mm rule)")
    return reasons


@dataclass(frozen=True, eq=False)
class PreparedNvfp4ScaledMm:
    """Load-time state: the weight's codes [N, K/2], swizzled scales, alpha and S (both fp32)."""

    weight_packed: torch.Tensor
    weight_scale_swizzled: torch.Tensor
    alpha: torch.Tensor
    encode_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.weight_packed.shape[0]), 2 * int(self.weight_packed.shape[1]))


def prepare_nvfp4_scaled_mm(
    weight_packed: torch.Tensor,
    weight_block_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    *,
    input_scale: torch.Tensor | float | None = None,
    input_global_scale: torch.Tensor | float | None = None,
) -> PreparedNvfp4ScaledMm:
    """Check once at load and swizzle the weight's block scales; compute alpha and S.

    ``weight_global_scale`` is the weight's multiplier (ModelOpt ``weight_scale_2``; for
    compressed-tensors 1 / ``weight_global_scale``, what the checkpoint reader stores). The
    activation scale comes in either convention (see ``activation_scale``).
    """
    if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
        raise WeightFormatError(
            format_error(
                f"{_WHERE}: weight_packed is {weight_packed.dtype} {tuple(weight_packed.shape)}",
                "the NVFP4 weight is packed uint8 [N, K/2]",
                "pass Nvfp4Weight.packed",
            )
        )
    n, k = weight_packed.shape[0], 2 * weight_packed.shape[1]
    if tuple(weight_block_scale.shape) != (n, k // GROUP) or weight_block_scale.element_size() != 1:
        raise WeightFormatError(
            format_error(
                f"{_WHERE}: weight_block_scale is {weight_block_scale.dtype} "
                f"{tuple(weight_block_scale.shape)}",
                f"it must be e4m3 [N, K/16] = [{n}, {k // GROUP}], unswizzled",
                "pass Nvfp4Weight.block_scale",
            )
        )
    for label, value, mult in (
        ("N", n, FP4_SCALED_MM.n_multiple),
        ("K", k, FP4_SCALED_MM.k_multiple),
    ):
        if value % mult:
            raise WeightFormatError(
                format_error(
                    f"{_WHERE}: weight has {label}={value}",
                    f"torch._scaled_mm FP4 needs {label} to be a multiple of {mult}",
                    "run this layer on the triton (weight-only) backend",
                )
            )
    scale = activation_scale(
        input_scale=input_scale, input_global_scale=input_global_scale, device=weight_packed.device
    )
    return PreparedNvfp4ScaledMm(
        weight_packed=weight_packed.contiguous(),
        weight_scale_swizzled=swizzle_block_scales(weight_block_scale.view(torch.float8_e4m3fn)),
        alpha=gemm_alpha(scale.decode, weight_global_scale.to(weight_packed.device)),
        encode_scale=scale.encode,
    )


def _quantize(x: torch.Tensor, s: torch.Tensor, quantizer: str) -> tuple[torch.Tensor, ...]:
    if quantizer == "triton":
        from quantdispatch.kernels.native.nvfp4_quant import quantize_nvfp4_activations_triton

        return quantize_nvfp4_activations_triton(x, s, swizzle=True)
    if quantizer == "torch":
        return quantize_nvfp4_activations_raw(x, s, swizzle=True)
    raise InputError(
        format_error(
            f"{_WHERE}: quantizer={quantizer!r}",
            'the activation quantizer is "torch" or "triton"',
            'pass quantizer="triton" on GPUs (one launch), "torch" elsewhere',
        )
    )


def nvfp4_scaled_mm_linear(
    x: torch.Tensor,
    prepared: PreparedNvfp4ScaledMm,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    quantizer: str = "triton",
) -> torch.Tensor:
    """y = alpha * (q(x) @ W.T) + bias, [M, N] in ``out_dtype`` (default x.dtype).

    x [M, K] bf16/fp16. No finiteness check and no device sync: non-finite activations give
    non-finite outputs, as in every native kernel.
    """
    n, k = prepared.shape
    check_native_call(x, n, k, bias, _WHERE)
    dtype = out_dtype or x.dtype
    m = x.shape[0]
    if m == 0:
        return torch.empty((0, n), dtype=dtype, device=x.device)
    a_packed, a_scale = _quantize(x, prepared.encode_scale, quantizer)
    acc = torch._scaled_mm(
        a_packed.view(torch.float4_e2m1fn_x2),
        prepared.weight_packed.view(torch.float4_e2m1fn_x2).t(),
        scale_a=a_scale,
        scale_b=prepared.weight_scale_swizzled,
        out_dtype=torch.float32,
    )
    out = acc * prepared.alpha
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(dtype)

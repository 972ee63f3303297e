"""torch's native scaled matmul (``torch._scaled_mm``): FP8 W8A8 on SM89+ and NVFP4 W4A4 on FP4
tensor cores, nothing to install.

FP8: e4m3 weight and e4m3 activations on FP8 tensor cores (Ada, Hopper, Blackwell), per-tensor
or per-channel (row-wise) weight scales; activations are quantized per token at run time (or
with the checkpoint's static scale). Block-scaled (128x128) FP8 checkpoints go to the Triton
weight-only kernel instead.

NVFP4 (W4A4 checkpoints only): activations quantized per call to NVFP4 with the checkpoint's
input scale, cuBLASLt's block-scaled FP4 GEMM through ``torch._scaled_mm``
(kernels/native/scaled_mm_fp4.py), the two per-tensor scales applied in fp32. Facts
(quantdispatch.capability, docs/design/native-fp4.md): torch >= 2.8 built with CUDA >= 12.8;
verified on SM 10.0 / 10.3; SM 11.0 and the sm120 family are not refused by torch but not
established either, so there it is taken only behind the first-use self-check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from quantdispatch.backends.base import (
    Backend,
    BackendFacts,
    Layout,
    LinearBinding,
    PreparedWeight,
    ScaledMmMeta,
)
from quantdispatch.backends.prepared import named_tensors
from quantdispatch.capability import (
    FP4_MMA,
    FP8_MMA,
    SM120_FAMILY,
    TORCH_NVFP4_MIN_CUDA,
    TORCH_NVFP4_MIN_TORCH,
    TORCH_NVFP4_UNVERIFIED,
    TORCH_NVFP4_VERIFIED,
    fmt_sm,
)
from quantdispatch.request import Op, Request, Scheme

if TYPE_CHECKING:
    import torch

    from quantdispatch.checkpoints import QuantWeight
    from quantdispatch.device import DeviceProfile


class Nvfp4Tensors(NamedTuple):
    """A W4A4 NVFP4 weight as torch._scaled_mm takes it, in order (the field names are the
    layer's buffer names): packed codes, swizzled e4m3 block scales, alpha, encode scale."""

    fp4_weight: torch.Tensor
    fp4_weight_scale_swizzled: torch.Tensor
    fp4_alpha: torch.Tensor
    fp4_encode_scale: torch.Tensor


class Fp8Tensors(NamedTuple):
    """A W8A8 FP8 weight (e4m3 [N, K], its scale, the checkpoint's static input scale if any)."""

    weight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None = None


def _at_least(version: str | None, need: tuple[int, int]) -> bool:
    """``"2.9.1+cu128"`` >= (2, 8); an unreadable version is not."""
    if not version:
        return False
    try:
        parts = version.split("+")[0].split(".")
        major = int(parts[0])
        minor = int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (ValueError, IndexError):
        return False
    return (major, minor) >= need


def _cuda_at_least(version: str | None, need: tuple[int, int]) -> bool:
    return _at_least(version, need)


class TorchScaledMMFacts(BackendFacts):
    """What the torch backend runs: this torch build's torch._scaled_mm on this GPU."""

    name = "torch"
    title = "torch._scaled_mm native tensor-core GEMM (quantized activations)"
    supports = {"fp8": frozenset({Op.LINEAR}), "nvfp4": frozenset({Op.LINEAR})}
    implemented = {"fp8": frozenset({Op.LINEAR}), "nvfp4": frozenset({Op.LINEAR})}
    weight_only = False

    def device_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        gpu = self.gpu_reasons(profile)
        if gpu:
            return gpu
        cc = profile.capability
        if cc is None:
            return []
        if request.format == "nvfp4":
            return self._nvfp4_reasons(cc, profile)
        if cc not in FP8_MMA:
            return [f"SM {fmt_sm(cc)} has no FP8 tensor cores (torch._scaled_mm FP8 needs SM 8.9+)"]
        return []

    @staticmethod
    def _nvfp4_reasons(cc: tuple[int, int], profile: DeviceProfile) -> list[str]:
        reasons = []
        if cc not in FP4_MMA:
            reasons.append(
                f"SM {fmt_sm(cc)} has no FP4 tensor cores (torch._scaled_mm NVFP4 needs the "
                f"{FP4_MMA.describe()})"
            )
        if not _at_least(profile.torch_version, TORCH_NVFP4_MIN_TORCH):
            need = ".".join(map(str, TORCH_NVFP4_MIN_TORCH))
            reasons.append(
                f"torch {profile.torch_version} has no NVFP4 torch._scaled_mm (needs >= {need})"
            )
        if not _cuda_at_least(profile.cuda_version, TORCH_NVFP4_MIN_CUDA):
            need = ".".join(map(str, TORCH_NVFP4_MIN_CUDA))
            reasons.append(
                f"torch's CUDA build is {profile.cuda_version or 'none'}; the FP4 data type "
                f"needs CUDA >= {need}"
            )
        return reasons

    def scheme_reasons(self, request: Request) -> list[str]:
        reasons = super().scheme_reasons(request)
        if reasons and request.format == "nvfp4":
            reasons[0] += (
                "; the native FP4 GEMM multiplies FP4 activations, so it serves W4A4 "
                "checkpoints only (the weight-only kernels run W4A16)"
            )
        return reasons

    def unverified_reason(self, request: Request, profile: DeviceProfile) -> str | None:
        """Why this SM takes the NVFP4 path only behind the first-use self-check (or None)."""
        cc = profile.capability
        if request.format != "nvfp4" or cc is None or cc not in TORCH_NVFP4_UNVERIFIED:
            return None
        family = f" ({SM120_FAMILY.describe()})" if cc in SM120_FAMILY else ""
        verified = ", ".join(fmt_sm(c) for c in sorted(TORCH_NVFP4_VERIFIED.members))
        return (
            f"NVFP4 torch._scaled_mm is not verified on SM {fmt_sm(cc)}{family}: torch does not "
            f"refuse it, but runs are established on SM {verified} only"
        )

    def variant(self, request: Request, profile: DeviceProfile) -> str | None:
        if request.format != "nvfp4":
            return None
        return (
            "cuBLASLt block-scaled FP4 GEMM; activations quantized to NVFP4 per call (Triton), "
            "alpha and bias in fp32"
        )

    def selfcheck_identity(self, profile: DeviceProfile) -> str:
        """The kernel provider for the self-check's cache key: this torch build's cuBLASLt."""
        return f"torch {profile.torch_version}"

    def shape_reasons(self, request: Request) -> list[str]:
        if request.format == "nvfp4":
            from quantdispatch.kernels.native.scaled_mm_fp4 import FP4_SCALED_MM

            out = []
            for label, value, mult in (
                ("N", request.n, FP4_SCALED_MM.n_multiple),
                ("K", request.k, FP4_SCALED_MM.k_multiple),
            ):
                if value is not None and value % mult:
                    out.append(
                        f"{label}={value} is not a multiple of {mult} (torch._scaled_mm FP4 rule)"
                    )
            return out
        reasons = []
        if request.format == "fp8" and request.scale_kind == "block":
            reasons.append(
                "block-scaled (128x128) FP8 weights are not bound to torch._scaled_mm here; "
                "the triton backend runs them"
            )
        for label, value in (("N", request.n), ("K", request.k)):
            if value is not None and value % 16 != 0:
                reasons.append(f"{label}={value} is not a multiple of 16 (cuBLASLt FP8 rule)")
        return reasons


class TorchScaledMMBackend(Backend):
    """The torch backend's life cycle: operands as torch._scaled_mm takes them, once."""

    facts = TorchScaledMMFacts()

    def prepare_linear(
        self, weight: QuantWeight, request: Request, options: object
    ) -> PreparedWeight:
        from quantdispatch.kernels.native.scaled_mm import prepare_fp8_scaled_mm

        if request.format == "nvfp4" and request.scheme is Scheme.WEIGHT_ACT:
            return _prepare_nvfp4(weight)
        if request.format != "fp8" or weight.block_size is not None:  # type: ignore[union-attr]
            self.cannot_prepare(request)
        w, scale = prepare_fp8_scaled_mm(weight.weight, weight.scale)
        return _prepared(Fp8Tensors(w, scale, weight.input_scale), weight.shape)

    def make_linear(self, w: LinearBinding):  # type: ignore[no-untyped-def]
        return _scaled_mm_linear(w.tensors, w.bias, w.fmt)


def _scaled_mm_linear(tensors: Sequence[torch.Tensor], bias: torch.Tensor | None, fmt: str):  # type: ignore[no-untyped-def]
    """The weight's torch._scaled_mm call with its tensors viewed and wrapped once: x -> y."""
    import torch

    from quantdispatch.backends.base import op_view
    from quantdispatch.kernels.native.scaled_mm import fp8_scaled_mm_linear

    if fmt == "nvfp4":
        from quantdispatch.kernels.native.scaled_mm_fp4 import (
            PreparedNvfp4ScaledMm,
            nvfp4_scaled_mm_linear,
        )

        w = Nvfp4Tensors(*tensors)
        prepared = PreparedNvfp4ScaledMm(
            weight_packed=op_view(w.fp4_weight, torch.uint8),
            weight_scale_swizzled=op_view(w.fp4_weight_scale_swizzled, torch.float8_e4m3fn),
            alpha=w.fp4_alpha,
            encode_scale=w.fp4_encode_scale,
        )

        def nvfp4(x: torch.Tensor) -> torch.Tensor:
            quantizer = "triton" if x.is_cuda else "torch"
            return nvfp4_scaled_mm_linear(x, prepared, bias=bias, quantizer=quantizer)

        return nvfp4

    named = Fp8Tensors(*tensors)
    weight, scale, input_scale = (
        op_view(named.weight, torch.float8_e4m3fn),
        named.scale,
        named.input_scale,
    )

    def fp8(x: torch.Tensor) -> torch.Tensor:
        return fp8_scaled_mm_linear(x, weight, scale, input_scale=input_scale, bias=bias)

    return fp8


def _prepare_nvfp4(weight) -> PreparedWeight:
    """Load-time NVFP4 state: codes, swizzled block scales, alpha = a * w and the encode scale."""
    from quantdispatch.errors import CheckpointError, format_error
    from quantdispatch.kernels.native.scaled_mm_fp4 import prepare_nvfp4_scaled_mm

    if weight.input_scale is None:
        raise CheckpointError(
            format_error(
                "the NVFP4 weight has no input_scale",
                "torch._scaled_mm NVFP4 quantizes activations with the checkpoint's input scale "
                "(W4A4)",
                "load input_scale / input_global_scale with the weight, or run the layer "
                "weight-only (scheme='weight_only')",
            )
        )
    p = prepare_nvfp4_scaled_mm(
        weight.packed, weight.block_scale, weight.global_scale, input_scale=weight.input_scale
    )
    named = Nvfp4Tensors(p.weight_packed, p.weight_scale_swizzled, p.alpha, p.encode_scale)
    return _prepared(named, p.shape)


def _prepared(named: Nvfp4Tensors | Fp8Tensors, shape: tuple[int, int]) -> PreparedWeight:
    """An N x K weight's named operands in the torch._scaled_mm layout."""
    names, tensors = named_tensors(named)
    n, k = shape
    return PreparedWeight(names, tensors, Layout.SCALED_MM, ScaledMmMeta(), n, k)

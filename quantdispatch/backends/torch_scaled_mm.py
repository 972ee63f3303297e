"""torch's native scaled matmul (``torch._scaled_mm``): FP8 W8A8 on SM89+, nothing to install.

FP8: e4m3 weight and e4m3 activations on FP8 tensor cores (Ada, Hopper, Blackwell), per-tensor
or per-channel (row-wise) weight scales; activations are quantized per token at run time (or
with the checkpoint's static scale). Block-scaled (128x128) FP8 checkpoints go to the Triton
weight-only kernel instead. NVFP4 through ``_scaled_mm`` needs the sm100 family and a CUDA >= 12.8
build; it is stated here but not bound yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from quantdispatch.backends.base import Backend, Layout, LayoutMeta, PreparedWeight, ScaledMmMeta
from quantdispatch.capability import FP8_MMA, SM100_FAMILY, SM120_FAMILY, fmt_sm
from quantdispatch.request import Op, Request

if TYPE_CHECKING:
    import torch

    from quantdispatch.device import DeviceProfile


def _cuda_at_least(version: str | None, need: tuple[int, int]) -> bool:
    if not version:
        return False
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= need


class TorchScaledMMBackend(Backend):
    name = "torch"
    title = "torch._scaled_mm native tensor-core GEMM (quantized activations)"
    supports = {"fp8": frozenset({Op.LINEAR}), "nvfp4": frozenset({Op.LINEAR})}
    implemented = {"fp8": frozenset({Op.LINEAR})}
    weight_only = False

    def device_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        gpu = self.gpu_reasons(profile)
        if gpu:
            return gpu
        cc = profile.capability
        if cc is None:
            return []
        if request.format == "nvfp4":
            reasons = []
            if cc in SM120_FAMILY:
                reasons.append(
                    f"SM {fmt_sm(cc)} belongs to the {SM120_FAMILY.describe()}, not the "
                    f"{SM100_FAMILY.describe()} that torch._scaled_mm's NVFP4 path needs"
                )
            elif cc not in SM100_FAMILY:
                reasons.append(
                    f"SM {fmt_sm(cc)} has no FP4 tensor cores (torch._scaled_mm NVFP4 needs the "
                    f"{SM100_FAMILY.describe()})"
                )
            if not _cuda_at_least(profile.cuda_version, (12, 8)):
                reasons.append(
                    f"torch's CUDA build is {profile.cuda_version or 'none'}; NVFP4 needs >= 12.8"
                )
            return reasons
        if cc not in FP8_MMA:
            return [f"SM {fmt_sm(cc)} has no FP8 tensor cores (torch._scaled_mm FP8 needs SM 8.9+)"]
        return []

    def shape_reasons(self, request: Request) -> list[str]:
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

    def prepare(self, weight: object, request: Request) -> PreparedWeight:
        from quantdispatch.formats.fp8 import Fp8Weight
        from quantdispatch.kernels.native.scaled_mm import prepare_fp8_scaled_mm

        if not isinstance(weight, Fp8Weight) or weight.block_size is not None:
            return super().prepare(weight, request)
        w, scale = prepare_fp8_scaled_mm(weight.weight, weight.scale)
        names, tensors = ["weight", "scale"], [w, scale]
        if weight.input_scale is not None:
            names.append("input_scale")
            tensors.append(weight.input_scale)
        n, k = weight.shape
        return PreparedWeight(
            names=tuple(names),
            tensors=tuple(tensors),
            layout=Layout.SCALED_MM,
            meta=ScaledMmMeta(),
            out_features=n,
            in_features=k,
        )

    def linear(
        self,
        x: torch.Tensor,
        tensors: Sequence[torch.Tensor],
        bias: torch.Tensor | None,
        fmt: str,
        layout: Layout,
        meta: LayoutMeta,
        *,
        pdl: bool = True,
    ) -> torch.Tensor:
        import torch

        from quantdispatch.backends.base import op_view
        from quantdispatch.kernels.native.scaled_mm import fp8_scaled_mm_linear

        weight = op_view(tensors[0], torch.float8_e4m3fn)
        input_scale = tensors[2] if len(tensors) > 2 else None
        return fp8_scaled_mm_linear(x, weight, tensors[1], input_scale=input_scale, bias=bias)

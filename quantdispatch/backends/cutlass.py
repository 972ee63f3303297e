"""sgl-kernel's CUTLASS GEMMs: native NVFP4 W4A4 (FP4 tensor cores) and FP8 W8A8.

Facts: NVFP4 needs FP4 MMA, which exists in two separate families with separate kernels, the
sm100 family (B200/GB200 10.0, B300 10.3, Thor 11.0) and the sm120 family (RTX 50xx / RTX PRO
6000 12.0, GB10 12.1); FP8 needs SM89+. Both quantize activations, so they serve W4A4 / W8A8
checkpoints only. Not bound yet: it explains itself but does not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantdispatch.backends.base import Backend
from quantdispatch.capability import FP8_MMA, SM100_FAMILY, SM120_FAMILY, fmt_sm
from quantdispatch.request import Op, Request

if TYPE_CHECKING:
    from quantdispatch.device import DeviceProfile


class CutlassBackend(Backend):
    name = "cutlass"
    title = "sgl-kernel CUTLASS native tensor-core GEMM (quantized activations)"
    supports = {"nvfp4": frozenset({Op.LINEAR}), "fp8": frozenset({Op.LINEAR})}
    implemented = {}
    provider = "sgl-kernel"
    weight_only = False

    def device_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        gpu = self.gpu_reasons(profile)
        if gpu:
            return gpu
        cc = profile.capability
        if cc is None:
            return []
        if request.format == "nvfp4":
            if cc in SM100_FAMILY:
                return []
            if cc in SM120_FAMILY:
                return []  # sgl-kernel ships separate sm120 kernels; a separate fact, same answer
            return [
                f"SM {fmt_sm(cc)} has no FP4 tensor cores (native NVFP4 needs the "
                f"{SM100_FAMILY.describe()} or the {SM120_FAMILY.describe()})"
            ]
        if cc not in FP8_MMA:
            return [f"SM {fmt_sm(cc)} has no FP8 tensor cores (needs SM 8.9+)"]
        return []

    def variant(self, request: Request, profile: DeviceProfile) -> str | None:
        cc = profile.capability
        if request.format != "nvfp4" or cc is None:
            return None
        for family in (SM100_FAMILY, SM120_FAMILY):
            if cc in family:
                return f"{family.name} kernels"
        return None

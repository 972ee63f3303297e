"""sgl-kernel's Marlin weight-only GEMM (FP4 weights dequantized in registers, 16-bit activations).

Facts (FORMATS.md): SM75+ with fp16 activations, SM80+ with bf16; NVFP4 group size exactly 16;
needs (K % 128 == 0 and N % 64 == 0) or (K % 64 == 0 and N % 128 == 0). The weight preparation
(tile repack, scale permutation, e4m3 re-encoding) and the kernel are one versioned contract:
the anchors show a newer preparation fed to an older kernel gives garbage. Until quantdispatch
binds a pinned sgl-kernel version and tests that contract on a GPU, this backend explains itself
but does not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantdispatch.backends.base import Backend
from quantdispatch.request import Op, Request

if TYPE_CHECKING:
    from quantdispatch.device import DeviceProfile


class MarlinBackend(Backend):
    name = "marlin"
    title = "sgl-kernel Marlin weight-only GEMM (FP4 weights, 16-bit activations)"
    supports = {"nvfp4": frozenset({Op.LINEAR}), "mxfp4": frozenset({Op.LINEAR})}
    implemented = {}
    provider = "sgl-kernel"
    weight_only = True

    def device_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        gpu = self.gpu_reasons(profile)
        if gpu:
            return gpu
        return self.min_sm_reasons(profile, request, fp16_min=(7, 5), bf16_min=(8, 0))

    def shape_reasons(self, request: Request) -> list[str]:
        n, k = request.n, request.k
        if n is None or k is None:
            return []
        if (k % 128 == 0 and n % 64 == 0) or (k % 64 == 0 and n % 128 == 0):
            return []
        return [
            f"shape N={n} K={k} does not fit Marlin's tiles (needs K%128==0 and N%64==0, or "
            "K%64==0 and N%128==0; tensor-parallel shards often break this)"
        ]

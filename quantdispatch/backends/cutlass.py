"""CUTLASS native NVFP4 W4A4 GEMM from an installed provider (sgl-kernel or vLLM).

Facts: NVFP4 needs FP4 MMA, which exists in two separate families with separate kernels, the
sm100 family (B200/GB200 10.0, B300 10.3, Thor 11.0) and the sm120 family (RTX 50xx / RTX PRO
6000 12.0, GB10 12.1). The bound provider builds (fp4_providers.py; sources in
docs/design/native-fp4.md) carry cubins for SM 10.0 and 12.0 (quantdispatch.capability.
CUTLASS_NVFP4); SM 10.3 and 12.1 run only if those are family builds, so they are taken only
behind the first-use self-check; Thor has no cubin. The GEMM quantizes activations, so it
serves W4A4 checkpoints only (W4A16 keeps the weight-only kernels).

Per call: activations quantized to NVFP4 with the checkpoint's encode scale (the provider's
quantizer, or ours: the same rule), the provider's GEMM with alpha = a * w fused in its
epilogue, writing the activation dtype; a bias is added in fp32. MoE: no provider offers a
fused NVFP4 MoE kernel we bind (their MoE is engine Python around grouped GEMMs), so NVFP4 MoE
stays on the triton backend. FP8 through CUTLASS is stated but not bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from quantdispatch.backends import fp4_providers
from quantdispatch.backends.base import (
    Backend,
    BackendFacts,
    CutlassFp4Meta,
    Layout,
    LinearBinding,
    PreparedWeight,
    op_view,
)
from quantdispatch.backends.prepared import named_tensors
from quantdispatch.capability import (
    CUTLASS_NVFP4,
    CUTLASS_NVFP4_UNVERIFIED,
    FP8_MMA,
    SM100_FAMILY,
    SM120_FAMILY,
    fmt_sm,
)
from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.request import Op, Request, Scheme

if TYPE_CHECKING:
    from quantdispatch.checkpoints import QuantWeight
    from quantdispatch.device import DeviceProfile

__all__ = ["NVFP4_MULTIPLE", "CutlassBackend", "CutlassFacts"]

#: K and N multiples the providers' NVFP4 GEMM checks ("Expected k / n to be divisible by 32").
NVFP4_MULTIPLE = 32


class CutlassTensors(NamedTuple):
    """The prepared operands, in order (the field names are the layer's buffer names): packed
    codes, swizzled e4m3 block scales, alpha and the activation encode scale."""

    cutlass_weight: torch.Tensor
    cutlass_weight_scale: torch.Tensor
    cutlass_alpha: torch.Tensor
    cutlass_encode_scale: torch.Tensor

    @classmethod
    def from_list(cls, tensors: Sequence[torch.Tensor]) -> CutlassTensors:
        """The op's tensor list, named, with the codes and scales viewed as the GEMM takes."""
        w, scale, alpha, encode = tensors
        return cls(op_view(w, torch.uint8), op_view(scale, torch.float8_e4m3fn), alpha, encode)


_NO_MOE = (
    "cutlass does not compute nvfp4 moe: no fused NVFP4 MoE kernel is bound: the providers "
    "ship grouped FP4 GEMMs and expert quantizers (sgl-kernel cutlass_fp4_group_mm, vLLM "
    "_C::cutlass_fp4_group_mm), while the fused MoE around them (routing, permutation, "
    "activation) is SGLang / vLLM Python; NVFP4 MoE runs on the triton backend"
)


class CutlassFacts(BackendFacts):
    """What the cutlass backend runs, by the NVFP4 GEMM provider detected in this process."""

    name = "cutlass"
    title = "CUTLASS native FP4 tensor-core GEMM from sgl-kernel / vLLM (quantized activations)"
    supports = {"nvfp4": frozenset({Op.LINEAR}), "fp8": frozenset({Op.LINEAR})}
    implemented = {"nvfp4": frozenset({Op.LINEAR})}
    provider = None  # detected by fp4_providers (package metadata, or vLLM's registered library)
    weight_only = False

    def unsupported_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        if request.format == "nvfp4" and request.op is Op.MOE:
            return [_NO_MOE]
        reasons = super().unsupported_reasons(request, profile)
        if reasons and reasons[0].startswith(f"{self.name} does not compute"):
            return reasons
        if request.format == "nvfp4" and fp4_providers.active() is None:
            found = "; ".join(s.describe() for s in fp4_providers.statuses())
            reasons.append(f"no usable NVFP4 GEMM provider ({found})")
        return reasons

    def device_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        gpu = self.gpu_reasons(profile)
        if gpu:
            return gpu
        cc = profile.capability
        if cc is None:
            return []
        if request.format == "nvfp4":
            if cc in CUTLASS_NVFP4 or cc in CUTLASS_NVFP4_UNVERIFIED:
                return []
            if cc in SM100_FAMILY or cc in SM120_FAMILY:
                return [
                    f"SM {fmt_sm(cc)} has FP4 tensor cores but the bound provider builds carry no "
                    f"NVFP4 GEMM for it (cubins for {CUTLASS_NVFP4.describe()})"
                ]
            return [
                f"SM {fmt_sm(cc)} has no FP4 tensor cores (native NVFP4 needs the "
                f"{SM100_FAMILY.describe()} or the {SM120_FAMILY.describe()})"
            ]
        if cc not in FP8_MMA:
            return [f"SM {fmt_sm(cc)} has no FP8 tensor cores (needs SM 8.9+)"]
        return []

    def scheme_reasons(self, request: Request) -> list[str]:
        reasons = super().scheme_reasons(request)
        if reasons and request.format == "nvfp4":
            reasons[0] += (
                "; the native FP4 GEMM multiplies FP4 activations, so it serves W4A4 "
                "checkpoints only (the weight-only kernels run W4A16)"
            )
        return reasons

    def shape_reasons(self, request: Request) -> list[str]:
        if request.format != "nvfp4" or request.op is not Op.LINEAR:
            return []
        return [
            f"{label}={value} is not a multiple of {NVFP4_MULTIPLE} (the provider's NVFP4 GEMM "
            "rule)"
            for label, value in (("N", request.n), ("K", request.k))
            if value is not None and value % NVFP4_MULTIPLE
        ]

    def variant(self, request: Request, profile: DeviceProfile) -> str | None:
        cc = profile.capability
        if request.format != "nvfp4" or cc is None:
            return None
        family = next((f for f in (SM100_FAMILY, SM120_FAMILY) if cc in f), None)
        if family is None:
            return None
        status = fp4_providers.active()
        if status is None or status.binding is None:
            return f"{family.name} kernels"
        b = status.binding
        quant = "its quantizer" if b.quantizer == "provider" else "quantdispatch's quantizer"
        return (
            f"{family.name} kernels: {status.name} {status.version} {b.gemm}, activations by "
            f"{quant}; binding from the provider's sources, not yet GPU-verified"
        )

    def unverified_reason(self, request: Request, profile: DeviceProfile) -> str | None:
        """Why this SM takes the native path only behind the first-use self-check (or None)."""
        cc = profile.capability
        if request.format != "nvfp4" or cc is None or cc not in CUTLASS_NVFP4_UNVERIFIED:
            return None
        return (
            f"the provider builds carry NVFP4 cubins for SM 10.0 / 12.0, none for SM {fmt_sm(cc)}: "
            "they run here only if they are family builds, which the wheels do not show"
        )

    def selfcheck_identity(self, profile: DeviceProfile) -> str:
        """The NVFP4 provider and version (the self-check's cache key)."""
        status = fp4_providers.active()
        return f"{status.name} {status.version}" if status is not None else "no provider"


class CutlassBackend(Backend):
    """The cutlass backend's life cycle: the provider's operands at load, its GEMM per call."""

    facts = CutlassFacts()

    def prepare_linear(
        self, weight: QuantWeight, request: Request, options: object
    ) -> PreparedWeight:
        from quantdispatch.formats.nvfp4_act import (
            activation_scale,
            gemm_alpha,
            swizzle_block_scales,
            swizzled_scale_shape,
        )

        if request.scheme is not Scheme.WEIGHT_ACT:
            self.cannot_prepare(request)
        if weight.input_scale is None:
            raise CheckpointError(
                format_error(
                    "the NVFP4 weight has no input_scale",
                    "the native NVFP4 GEMM quantizes activations with the checkpoint's input "
                    "scale (W4A4)",
                    "load input_scale / input_global_scale with the weight, or run the layer "
                    "weight-only (scheme='weight_only')",
                )
            )
        status = fp4_providers.active()
        if status is None:
            found = "; ".join(s.describe() for s in fp4_providers.statuses())
            status = fp4_providers.statuses()[0]
            status = fp4_providers.Fp4ProviderStatus(status.name, status.version, None, found)
        fp4_providers.load(status)  # imports / loads it now; raises with the reason
        n, k = weight.shape
        device = weight.packed.device
        scale = activation_scale(input_scale=weight.input_scale, device=device)
        w_scale = swizzle_block_scales(weight.block_scale.view(torch.float8_e4m3fn))
        names, tensors = named_tensors(
            CutlassTensors(
                weight.packed.contiguous(),
                w_scale.reshape(swizzled_scale_shape(n, k // 16)),
                gemm_alpha(scale.decode, weight.global_scale.to(device)),
                scale.encode,
            )
        )
        index = fp4_providers.BINDINGS.index(status.binding)  # type: ignore[arg-type]
        return PreparedWeight(
            names,
            tensors,
            layout=Layout.CUTLASS_FP4,
            meta=CutlassFp4Meta(index),
            out_features=n,
            in_features=k,
        )

    def make_linear(self, w: LinearBinding) -> _CutlassLinear:
        return _CutlassLinear(w.tensors, w.bias, w.meta)


class _CutlassLinear:
    """One prepared weight with its provider binding loaded and its operands viewed once; a call
    quantizes the activations, runs the provider GEMM and adds the bias."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], bias: torch.Tensor | None, meta: object
    ) -> None:
        assert isinstance(meta, CutlassFp4Meta), meta
        self.binding = binding = fp4_providers.BINDINGS[meta.binding]
        status = fp4_providers.active()
        if status is None or status.binding != binding:
            status = fp4_providers.Fp4ProviderStatus(binding.provider, None, binding)
        self.provider = fp4_providers.load(status)
        self.w, self.w_scale, self.alpha, self.encode = CutlassTensors.from_list(tensors)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from quantdispatch.formats.nvfp4_act import (
            quantize_nvfp4_activations_raw,
            swizzled_scale_shape,
        )

        provider, w, w_scale, alpha, encode = (
            self.provider, self.w, self.w_scale, self.alpha, self.encode
        )  # fmt: skip
        m, n = x.shape[0], w.shape[0]
        if m == 0:
            return x.new_empty((0, n))
        if self.binding.quantizer == "provider":
            a, a_scale = provider.scaled_fp4_quant(x, encode)
            out = provider.cutlass_scaled_fp4_mm(a, w, a_scale, w_scale, alpha, x.dtype)
        else:
            if x.is_cuda:
                from quantdispatch.kernels.native.nvfp4_quant import (
                    quantize_nvfp4_activations_triton,
                )

                a, flat = quantize_nvfp4_activations_triton(x, encode, swizzle=True)
            else:
                a, flat = quantize_nvfp4_activations_raw(x, encode, swizzle=True)
            a_scale = flat.reshape(swizzled_scale_shape(m, x.shape[1] // 16))
            out = torch.empty((m, n), dtype=x.dtype, device=x.device)
            provider(out, a, w, a_scale, w_scale, alpha)
        if self.bias is not None:
            out = (out.to(torch.float32) + self.bias.to(torch.float32)).to(x.dtype)
        return out

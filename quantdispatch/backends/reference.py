"""The reference backend: plain torch, any device, the numerical contract for every other backend.

y = x @ dequant(W).T with fp32 accumulation. The weight is dequantized ``CHUNK_ELEMENTS`` weights
(rows of K) at a time, so no full copy of a large weight ever exists: the extra memory of a call
is bounded by about ``4 * CHUNK_ELEMENTS * 4`` bytes (dequantization temporaries in fp32) plus
the fp32 copy of the activations and the output. Weight-only semantics by default; with
``emulate_activations`` a W4A4 (W8A8) checkpoint's activations are quantized to FP4 (FP8) as a
native Blackwell (Hopper) kernel does (W4A4: both operands' e2m1 * block-scale products summed in
fp32, then the two per-tensor scales), the contract native backends are compared with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from quantdispatch.backends.base import (
    Backend,
    BackendFacts,
    CheckpointMeta,
    Layout,
    LinearBinding,
    MoeCall,
    PreparedWeight,
)
from quantdispatch.request import Op, Request, Scheme

if TYPE_CHECKING:
    from quantdispatch.checkpoints import QuantWeight
    from quantdispatch.device import DeviceProfile

__all__ = ["CHUNK_ELEMENTS", "ReferenceBackend", "ReferenceFacts", "fake_quantize_fp8_activations"]

#: Weights dequantized per chunk (2M: 8 MiB as fp32). Peak extra memory ~ 4x that (32 MiB).
CHUNK_ELEMENTS = 2**21


def fake_quantize_fp8_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> torch.Tensor:
    """What a W8A8 kernel does to activations: e4m3 per token (dynamic) or per tensor (static)."""
    xf = x.float()
    if input_scale is None:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    else:
        scale = input_scale.float()
    q = (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def _trusted(cls: type, **fields: Any) -> Any:
    """Rebuild an already-validated frozen weight object without re-validating it.

    Validation (NaN / sign checks on scales) synchronizes with the GPU; it ran once at load,
    so the per-call path must not repeat it.
    """
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(obj, f.name, fields.get(f.name, f.default))
    return obj


class ReferenceFacts(BackendFacts):
    """The reference backend runs every format and op, on any device."""

    name = "reference"
    title = "plain torch, weight dequantized in bounded chunks (correct everywhere, slow)"
    supports = {
        "nvfp4": frozenset({Op.LINEAR, Op.MOE}),
        "mxfp4": frozenset({Op.LINEAR, Op.MOE}),
        "fp8": frozenset({Op.LINEAR, Op.MOE}),
    }
    implemented = {
        "nvfp4": frozenset({Op.LINEAR, Op.MOE}),
        "mxfp4": frozenset({Op.LINEAR, Op.MOE}),
        "fp8": frozenset({Op.LINEAR, Op.MOE}),
    }
    weight_only = True

    def device_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        return []


class ReferenceBackend(Backend):
    """The reference backend's life cycle: the canonical tensors as they are, dequantized in
    bounded chunks per call."""

    facts = ReferenceFacts()

    def prepare(
        self,
        weight: QuantWeight,
        request: Request,
        *,
        options: object = None,
        emulate_activations: bool = False,
    ) -> PreparedWeight:
        """The canonical tensors; ``emulate_activations``: quantize activations as a native
        W4A4 / W8A8 kernel would (the layer's flag, for W4A4 / W8A8 checkpoints)."""
        self.check_weight(weight, request)
        if emulate_activations and request.scheme is not Scheme.WEIGHT_ACT:
            from quantdispatch.errors import ConfigurationError, format_error

            raise ConfigurationError(
                format_error(
                    f"emulate_activations=True for a {request.scheme_label} checkpoint",
                    "emulation reproduces W4A4 / W8A8 checkpoints' quantized activations",
                    "drop emulate_activations, or load a checkpoint with activation scales",
                )
            )
        tensors = {k: v for k, v in weight.tensors().items() if v is not None}
        if request.format == "nvfp4" and emulate_activations and "input_scale" not in tensors:
            from quantdispatch.errors import CheckpointError, format_error

            raise CheckpointError(
                format_error(
                    "emulate_activations=True but the NVFP4 weight has no input_scale",
                    "W4A4 emulation quantizes activations with the checkpoint's input scale",
                    "load the checkpoint's input_scale / input_global_scale with the weight",
                )
            )
        block = weight.block_size if request.format == "fp8" else None  # type: ignore[union-attr]
        meta = CheckpointMeta(
            block_size=tuple(block) if block is not None else None,  # type: ignore[arg-type]
            emulate_activations=emulate_activations,
        )
        n, k = weight.shape
        return PreparedWeight(
            names=tuple(tensors),
            tensors=tuple(tensors.values()),
            layout=Layout.CHECKPOINT,
            meta=meta,
            out_features=n,
            in_features=k,
        )

    def weight_object(self, fmt: str, tensors: Sequence[torch.Tensor], meta: CheckpointMeta) -> Any:
        """The canonical weight (Nvfp4Weight, ...) behind this backend's prepared tensors."""
        from quantdispatch.backends.base import op_view
        from quantdispatch.formats import Fp8Weight, Mxfp4Weight, Nvfp4Weight

        e4m3 = torch.float8_e4m3fn
        if fmt == "nvfp4":
            names = ("packed", "block_scale", "global_scale", "input_scale")
            fields = dict(zip(names, tensors, strict=False))
            fields["block_scale"] = op_view(fields["block_scale"], e4m3)
            return _trusted(Nvfp4Weight, **fields)
        if fmt == "mxfp4":
            names = ("packed", "block_scale")
            return _trusted(Mxfp4Weight, **dict(zip(names, tensors, strict=False)))
        if fmt == "fp8":
            names = ("weight", "scale", "input_scale")
            fields = dict(zip(names, tensors, strict=False))
            fields["weight"] = op_view(fields["weight"], e4m3)
            return _trusted(Fp8Weight, block_size=meta.block_size, **fields)
        raise ValueError(f"reference backend: unknown format {fmt!r}")

    def make_linear(self, w: LinearBinding) -> Callable[[torch.Tensor], torch.Tensor]:
        meta, fmt, bias = w.meta, w.fmt, w.bias
        assert isinstance(meta, CheckpointMeta), meta  # prepare keeps the checkpoint layout
        weight = self.weight_object(fmt, w.tensors, meta)
        emulate = meta.emulate_activations

        def run(x: torch.Tensor) -> torch.Tensor:
            if emulate and fmt == "nvfp4":
                return _keep_non_finite(_w4a4_matmul(x, weight, bias), x).to(x.dtype)
            if emulate and fmt == "fp8":
                xq = fake_quantize_fp8_activations(x, weight.input_scale)
                y = _chunked_matmul(xq.float(), weight, fmt, bias)
                return _keep_non_finite(y, x).to(x.dtype)
            return _chunked_matmul(x.to(torch.float32), weight, fmt, bias).to(x.dtype)

        return run

    def moe(self, call: MoeCall) -> torch.Tensor:
        """Loop over the experts that received tokens; fp32 accumulation, chunked dequant.

        ``topk_ids`` hold local expert indices; ids outside [0, E) (experts another rank
        holds, or -1) contribute nothing, so a sum over expert-parallel ranks is the full
        layer. This path synchronizes with the device (it lists the experts in use): it is
        the contract, not a fast path, so it keeps its own per-expert sum rather than the
        finalize stage of the fast paths (:mod:`quantdispatch.kernels.common.moe_finalize`).
        """
        from quantdispatch.kernels.common.moe_finalize import local_pairs
        from quantdispatch.moe.activations import apply_activation

        x, topk_ids, topk_weights, fmt = call.x, call.topk_ids, call.topk_weights, call.fmt
        w13, w2, w13_bias, w2_bias, meta = call.w13, call.w2, call.w13_bias, call.w2_bias, call.meta
        assert isinstance(meta, CheckpointMeta), meta
        num_experts = w13[0].shape[0]
        xf = x.to(torch.float32)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        ids = topk_ids.to(torch.long)
        valid, _ = local_pairs(topk_ids, num_experts)
        for e in torch.unique(ids[valid.view_as(ids)]).tolist():
            token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
            w13_e = self.weight_object(fmt, [t[e] for t in w13], meta)
            w2_e = self.weight_object(fmt, [t[e] for t in w2], meta)
            h = _chunked_matmul(
                xf[token_idx], w13_e, fmt, None if w13_bias is None else w13_bias[e]
            )
            a = apply_activation(h, call.activation, call.params)
            y = _chunked_matmul(a, w2_e, fmt, None if w2_bias is None else w2_bias[e])
            out.index_add_(
                0, token_idx, y * topk_weights[token_idx, slot].to(torch.float32)[:, None]
            )
        return out.to(x.dtype)


def _keep_non_finite(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rows of ``out`` whose activations hold an inf or NaN become NaN. Quantizing activations
    saturates an inf to the largest code, so the emulated product would come out finite where
    the unquantized one is not; x * 0 is NaN exactly at non-finite x (no device sync)."""
    return out + (x.to(torch.float32) * 0).sum(dim=-1, keepdim=True)


def _w4a4_matmul(x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """The native W4A4 computation: x quantized by the native rule, e2m1 * block_scale of both
    operands multiplied (exact products, fp32 sums), then alpha = input_scale * global_scale."""
    from quantdispatch.formats import Nvfp4Weight
    from quantdispatch.formats.nvfp4_act import (
        dequantize_nvfp4_activations,
        gemm_alpha,
        quantize_nvfp4_activations,
    )

    q = quantize_nvfp4_activations(x, input_scale=weight.input_scale, check_finite=False)
    unit = torch.ones((), dtype=torch.float32, device=weight.global_scale.device)
    w_unscaled = _trusted(
        Nvfp4Weight, packed=weight.packed, block_scale=weight.block_scale, global_scale=unit
    )
    acc = _chunked_matmul(dequantize_nvfp4_activations(q, scaled=False), w_unscaled, "nvfp4", None)
    out = acc * gemm_alpha(q.scale.decode, weight.global_scale)
    return out if bias is None else out + bias.to(torch.float32)


def _chunked_matmul(
    xf: torch.Tensor, weight: Any, fmt: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp32 xf [M, K] @ dequant(weight).T -> fp32 [M, N], CHUNK_ELEMENTS weights at a time."""
    from quantdispatch.formats import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4

    dequant = {"nvfp4": dequantize_nvfp4, "mxfp4": dequantize_mxfp4, "fp8": dequantize_fp8}[fmt]
    n, k = weight.shape
    out = torch.empty((xf.shape[0], n), dtype=torch.float32, device=xf.device)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, rows_per_chunk):
        stop = min(n, start + rows_per_chunk)
        w = dequant(weight, dtype=torch.float32, rows=slice(start, stop))
        out[:, start:stop] = xf @ w.T
        del w
        if bias is not None:
            out[:, start:stop] += bias[start:stop].to(torch.float32)
    return out

"""The numerical check shared by ``quantdispatch verify`` and the first-use self-check.

A backend's output is compared with float64 maths on the same quantized weight: the weight is
dequantized exactly (float64), the activations are taken as given (weight-only backends) or
quantized the way a native kernel quantizes them (W4A4 / W8A8 backends: the contract the
reference backend emulates), and the measure is ||out - ref|| / ||ref|| against a bound per
activation dtype. Nothing here picks a backend; the self-check's probes run the one given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quantdispatch.backends.prepared import CheckpointMeta
    from quantdispatch.request import Request

__all__ = [
    "BOUNDS",
    "FP8_BOUND_RATIO",
    "FP8_REL_BOUND",
    "MOE_BOUNDS",
    "NATIVE_FACTOR",
    "bound_for",
    "fp8_bound_ratio",
    "linear_reference64",
    "moe_reference64",
    "probe_linear",
    "probe_moe",
    "probe_weight",
    "rel_error",
]

#: Bound on ||out - ref|| / ||ref|| per activation dtype: one rounding of the output plus fp32
#: accumulation order, with margin (bf16 half-ulp 2^-9 ~ 2e-3, fp16 2^-12 ~ 2.4e-4).
BOUNDS = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

#: MoE: three or more roundings to the activation dtype (gate/up, the activation, per-slot rows,
#: the sum). The triton MoE kernels measure 8.5e-3 (bf16) and 3.8e-4 (fp16) on the self-check's
#: probe in the interpreter; tests/gpu/test_moe_gpu.py bounds real sizes by 1.5e-2 / 4e-3. A
#: kernel that is wrong is off by 5e-2 or more, so bf16 gets 2e-2: a false failure would send
#: MoE layers to the slow reference backend.
MOE_BOUNDS = {torch.bfloat16: 2e-2, torch.float16: 4e-3}

#: Native (activation-quantizing) kernels get this factor on the bound: their reciprocals
#: (``rcp.approx``) can move a code across a rounding boundary the float64 contract does not.
NATIVE_FACTOR = 3


#: FP8 compute (lossy, opt-in) is checked apart, against the float64 W4A16 result: its relative
#: error (H200: ~3.4e-2, the e4m3 activations' rounding dominating; a per-element worst case of
#: 1/17) within this bound, and every output within its proven componentwise bound
#: (:func:`fp8_bound_ratio` <= ``FP8_BOUND_RATIO``); docs/design/fp8-prefill.md.
FP8_REL_BOUND = 0.06
FP8_BOUND_RATIO = 1.0


def bound_for(act_dtype: torch.dtype, native: bool, *, moe: bool = False) -> float:
    """The relative-error bound for ``act_dtype`` activations (native: quantized ones)."""
    return (MOE_BOUNDS if moe else BOUNDS)[act_dtype] * (NATIVE_FACTOR if native else 1)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when ``out`` has a NaN or an inf."""
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if o.shape != r.shape:
        return float("inf")
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    denom = float(r.norm())
    return float((o - r).norm()) / denom if denom > 0 else float((o - r).norm())


def probe_weight(
    fmt: str,
    n: int,
    k: int,
    gen: torch.Generator,
    *,
    input_scale: float | None = 0.05,
    fp8_kind: str = "channel",
):
    """A random quantized [N, K] weight with a tiny first row (subnormal block scales).

    ``input_scale``: NVFP4 only, the activation multiplier that makes it a W4A4 weight (None:
    weight-only). ``fp8_kind``: FP8 scale layout (tensor, channel or block).
    """
    from quantdispatch.formats import quantize_fp8, quantize_mxfp4, quantize_nvfp4

    w = torch.randn(n, k, generator=gen) * 0.02
    w[0] *= 1e-3
    if fmt == "nvfp4":
        return quantize_nvfp4(w, with_input_scale=input_scale)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    return quantize_fp8(w, kind=fp8_kind)  # type: ignore[arg-type]


def _dequant64(fmt: str, weight) -> torch.Tensor:
    from quantdispatch.formats import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4

    dequant = {"nvfp4": dequantize_nvfp4, "mxfp4": dequantize_mxfp4, "fp8": dequantize_fp8}[fmt]
    return dequant(weight.to("cpu"), dtype=torch.float64)


def _activations64(fmt: str, weight, x: torch.Tensor, emulate: bool) -> torch.Tensor:
    """x in float64, quantized first as the native kernel does when ``emulate``."""
    x = x.detach().to("cpu")
    if not emulate:
        return x.to(torch.float64)
    if fmt == "nvfp4":
        from quantdispatch.formats.nvfp4_act import (
            dequantize_nvfp4_activations,
            quantize_nvfp4_activations,
        )

        q = quantize_nvfp4_activations(x, input_scale=weight.input_scale.to("cpu"))
        return dequantize_nvfp4_activations(q, dtype=torch.float64)
    if fmt == "fp8":
        from quantdispatch.backends.reference import fake_quantize_fp8_activations

        scale = None if weight.input_scale is None else weight.input_scale.to("cpu")
        return fake_quantize_fp8_activations(x, scale).to(torch.float64)
    raise ValueError(f"no activation emulation for {fmt}")


def fp8_bound_ratio(fmt: str, weight, x: torch.Tensor, out: torch.Tensor, recipe: str) -> float:
    """max |out - x W^T| / bound over the outputs of an FP8 compute call (no bias), with the
    proven componentwise bound (docs/design/fp8-prefill.md): per element |x^ - x| <= ex =
    max(|x| / 17, 2^-10 s_x) and |w^ - w| <= ew = max(|w| / 21, 2^-10 s_w) (MXFP4's bound is
    smaller; 1/21 covers it), so |x^ w^ - x w| <= ex (|w| + ew) + |x| ew; plus 2^-10 sum
    (|x| + ex)(|w| + ew) for the accumulation and 2^-8 |y| + 2^-24 for the 16-bit output. s_x,
    s_w: the block scales of the rule (formats.fp8_prefill), in float64 on the CPU."""
    from quantdispatch.formats import fp8_prefill as rule
    from quantdispatch.kernels.native.fp8_prefill import weight_blocks

    f64 = torch.float64
    xc = x.detach().to("cpu")
    k = xc.shape[1]
    act_cols = k if recipe == "rowwise" else rule.BLOCK
    _, sx = rule.quantize_blocks_torch(xc, block_cols=act_cols)
    sx = sx.to(f64).repeat_interleave(act_cols, 1)
    w = weight.to("cpu")
    br, bc = weight_blocks(recipe, k)
    gs = w.global_scale if fmt == "nvfp4" else None
    sf = "e4m3" if fmt == "nvfp4" else "e8m0"
    _, sw = rule.reencode_fp4_torch(
        w.packed, w.block_scale.view(torch.uint8), gs, scale_format=sf, block_rows=br,
        block_cols=bc,
    )  # fmt: skip
    n = w.packed.shape[0]
    sw = sw.to(f64).repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)
    x64, w64 = xc.to(f64), _dequant64(fmt, w)
    ref = x64 @ w64.T
    ax, aw = x64.abs(), w64.abs()
    ex = torch.maximum(ax / 17, 2.0**-10 * sx)
    ew = torch.maximum(aw * rule.NVFP4_REL_BOUND, 2.0**-10 * sw)
    bound = ex @ (aw + ew).T + ax @ ew.T + 2.0**-10 * ((ax + ex) @ (aw + ew).T)
    bound += 2.0**-8 * ref.abs() + 2.0**-24
    diff = (out.detach().to("cpu", f64) - ref).abs()
    if not bool(torch.isfinite(diff).all()):
        return float("inf")
    return float((diff / bound).max())


def linear_reference64(
    fmt: str,
    weight,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    emulate: bool = False,
) -> torch.Tensor:
    """x @ W.T (+ bias) in float64 on the CPU, W dequantized exactly; ``emulate``: x quantized
    as a native W4A4 / W8A8 kernel quantizes it (the reference backend's emulation)."""
    y = _activations64(fmt, weight, x, emulate) @ _dequant64(fmt, weight).T
    if bias is not None:
        y = y + bias.detach().to("cpu", torch.float64)
    return y


def moe_reference64(
    fmt: str,
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    meta: CheckpointMeta,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str = "silu",
    params: Sequence[float] = (),
) -> torch.Tensor:
    """Routed experts in float64 (weight-only semantics) from the canonical stacks (``w13``:
    gate rows then up rows for gated activations; ``meta`` as QuantMoE gives it): out[t] =
    sum_k w[t, k] * down_e(act(w13_e x[t])) with e = topk_ids[t, k]."""
    from quantdispatch.backends import get_backend
    from quantdispatch.moe.activations import apply_activation

    ref = get_backend("reference")
    x64 = x.detach().to("cpu", torch.float64)
    ids = topk_ids.detach().to("cpu", torch.long)
    wts = topk_weights.detach().to("cpu", torch.float64)
    out = torch.zeros_like(x64)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        first = _dequant64(fmt, ref.weight_object(fmt, [t[e].cpu() for t in w13], meta))
        second = _dequant64(fmt, ref.weight_object(fmt, [t[e].cpu() for t in w2], meta))
        h = apply_activation(x64[rows] @ first.T, activation, params)
        out.index_add_(0, rows, (h @ second.T) * wts[rows, slot][:, None])
    return out


# -- the self-check's probes ----------------------------------------------------------------------

_LINEAR_M = (1, 48, 192)
_LINEAR_NK = (256, 512)
_MOE_M = (1, 48)
_MOE = {"experts": 4, "top_k": 2, "hidden": 256, "inter": 128}


def probe_linear(b, request: Request, device: torch.device) -> list[tuple[int, float]]:
    """Backend ``b`` on the linear probe (M = 1, 48, 192; N 256, K 512; a bias on M = 48)
    through the layers' custom op: [(M, rel. error vs float64)]."""
    import quantdispatch.ops  # noqa: F401  (registers torch.ops.quantdispatch.*)
    from quantdispatch.backends.base import as_op_tensors

    gen = torch.Generator().manual_seed(25)
    n, k = _LINEAR_NK
    w4a4 = request.scheme.value == "weight_act" and request.format == "nvfp4"
    weight = probe_weight(
        request.format, n, k, gen, input_scale=0.05 if w4a4 else None,
        fp8_kind=request.scale_kind or "channel",
    )  # fmt: skip
    prepared = b.prepare(weight.to(device), dataclasses.replace(request, n=n, k=k))
    tensors = as_op_tensors(list(prepared.tensors))
    meta = prepared.meta_args()
    out = []
    for i, m in enumerate(_LINEAR_M):
        x = torch.randn(m, k, generator=gen).to(request.act_dtype)
        bias = torch.randn(n, generator=gen) * 0.1 if i == 1 else None
        dev_bias = None if bias is None else bias.to(device)
        y = torch.ops.quantdispatch.linear(
            x.to(device), tensors, dev_bias, b.name, request.format, meta, n
        )
        ref = linear_reference64(request.format, weight, x, bias, emulate=not b.facts.weight_only)
        out.append((m, rel_error(y, ref)))
    return out


def probe_moe(b, request: Request, device: torch.device) -> list[tuple[int, float]]:
    """Backend ``b`` on the MoE probe (M = 1, 48; 4 experts, top-2, H 256, I 128, SiLU) through
    the layers' custom op: [(M, rel. error vs float64)]."""
    import quantdispatch.ops  # noqa: F401
    from quantdispatch.backends.base import CheckpointMeta, ExpertStacks
    from quantdispatch.moe.stacking import STACK_NAMES, stack_expert_lists

    gen = torch.Generator().manual_seed(26)
    fmt, e, top_k = request.format, _MOE["experts"], _MOE["top_k"]
    h, i = _MOE["hidden"], _MOE["inter"]
    w4a4 = request.scheme.value == "weight_act" and fmt == "nvfp4"
    kind = request.scale_kind or "channel"

    def expert(n: int, k: int):
        return probe_weight(fmt, n, k, gen, input_scale=0.05 if w4a4 else None, fp8_kind=kind)

    lists = {
        "gate": [expert(i, h) for _ in range(e)],
        "up": [expert(i, h) for _ in range(e)],
        "down": [expert(h, i) for _ in range(e)],
    }
    s13, s2, block, _ = stack_expert_lists(fmt, lists, gated=True)
    meta = CheckpointMeta(block_size=tuple(block) if block else None)  # type: ignore[arg-type]
    stacks = ExpertStacks(
        [t.to(device).contiguous() for t in s13],
        [t.to(device).contiguous() for t in s2],
        STACK_NAMES[fmt],
        meta,
        gated=True,
    )
    prepared = b.prepare_moe(stacks, dataclasses.replace(request, n=i, k=h, experts=e))
    out = []
    for m in _MOE_M:
        x = torch.randn(m, h, generator=gen).to(request.act_dtype)
        ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(m)])
        weights = torch.rand(m, top_k, generator=gen) + 0.1
        y = torch.ops.quantdispatch.moe(
            x.to(device),
            ids.to(device, torch.int32),
            weights.to(device),
            list(prepared.w13),
            list(prepared.w2),
            None,
            None,
            b.name,
            fmt,
            "silu",
            [],
            prepared.meta_args(),
        )
        ref = moe_reference64(fmt, s13, s2, meta, x, ids, weights)
        out.append((m, rel_error(y, ref)))
    return out

"""NVFP4: E2M1 codes, one FP8 E4M3 scale per 16 elements along K, one FP32 per-tensor scale.

One convention inside quantdispatch: the per-tensor ``global_scale`` is a MULTIPLIER,

    W[n, k] = e2m1(code[n, k]) * float(block_scale[n, k // 16]) * global_scale

which is ModelOpt's ``weight_scale_2``. compressed-tensors stores the reciprocal
(``weight_global_scale = 6 * 448 / amax``); convert at load time with
:func:`global_scale_from_compressed_tensors`, never inside a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantdispatch.errors import ConfigurationError, InputError
from quantdispatch.format_facts import FP4_GROUP_SIZES
from quantdispatch.formats import checks
from quantdispatch.formats.e2m1 import (
    E2M1_MAX,
    PackedFp4,
    decode_e2m1,
    encode_e2m1,
    pack_e2m1,
)
from quantdispatch.formats.nvfp4_act import (
    ACT_DTYPES,
    dequantize_nvfp4_activations,
    quantize_nvfp4_activations,
)

__all__ = [
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "NVFP4_GROUP_SIZE",
    "Nvfp4Weight",
    "dequantize_nvfp4",
    "fake_quantize_nvfp4_activations",
    "global_scale_from_compressed_tensors",
    "global_scale_to_compressed_tensors",
    "merge_nvfp4_shards",
    "quantize_nvfp4",
]

NVFP4_GROUP_SIZE: int = FP4_GROUP_SIZES["nvfp4"]
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9


def _check_e4m3_scales(bs: torch.Tensor, field: str) -> None:
    """Reject NaN (e4m3fn has no inf) and negative block scales, reading the bits directly."""
    if not checks.has_values(bs):
        return
    bits = bs.view(torch.uint8)
    mag = bits & 0x7F
    nan = mag == 0x7F
    if bool(nan.any()):
        first = tuple(nan.nonzero()[0].tolist())
        checks.fail(
            f"{field} contains {int(nan.sum())} NaN value(s) (first at index {first})",
            "a block scale must be a finite e4m3 value >= 0",
            "the checkpoint is corrupt or was written with another dtype: re-export it, or "
            "check that the raw bytes are read as float8_e4m3fn",
        )
    neg = (bits >= 0x80) & (mag != 0)
    if bool(neg.any()):
        first = tuple(neg.nonzero()[0].tolist())
        value = float(bs[first].float())
        checks.fail(
            f"{field} contains {int(neg.sum())} negative value(s) (first {value} at {first})",
            "block scales are magnitudes: >= 0 (the sign lives in the E2M1 codes)",
            "re-quantize the weight; a negative scale means the producer is broken",
        )


_NV_SCALE_FIXES = (
    "pass the block scales that belong to this weight (same TP shard / same expert)",
    "check that the scales are not swizzled/padded (un-swizzle them to [N, K/16]) "
    "and belong to this weight",
)


@dataclass(frozen=True, eq=False)
class Nvfp4Weight(PackedFp4):
    """A validated NVFP4 weight: packed codes, e4m3 block scales, per-tensor multiplier(s).

    ``input_scale`` is present only for W4A4 checkpoints (static FP4 activations); a W4A16
    checkpoint leaves it None. Validation happens once here, so kernels can trust the fields.
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        packed, n, k = checks.check_packed(
            self.packed,
            "nvfp4",
            "pass the packed codes as torch.uint8 [N, K/2] (view int8 storage as uint8)",
        )
        bs = checks.require_tensor(
            self.block_scale,
            "Nvfp4Weight.block_scale",
            torch.float8_e4m3fn,
            "pass the block scales as torch.float8_e4m3fn [N, K/16] (ModelOpt weight_scale, "
            "compressed-tensors weight_scale); a uint8 copy of the bytes needs "
            ".view(torch.float8_e4m3fn)",
        )
        checks.check_scale_grid(bs, "nvfp4", n, k, _NV_SCALE_FIXES)
        device = packed.device
        checks.require_device(bs, "Nvfp4Weight.block_scale", device, "packed")
        _check_e4m3_scales(bs, "Nvfp4Weight.block_scale")

        gs = checks.positive_scalar(
            self.global_scale, "Nvfp4Weight.global_scale", strict_dtype=True, device=device
        )
        object.__setattr__(self, "global_scale", gs.to(device))
        if self.input_scale is not None:
            s = checks.positive_scalar(
                self.input_scale, "Nvfp4Weight.input_scale", strict_dtype=True, device=device
            )
            object.__setattr__(self, "input_scale", s.to(device))

    def nbytes(self) -> int:
        """Bytes held by all tensors (what a layer keeps resident)."""
        return checks.nbytes(self.packed, self.block_scale, self.global_scale, self.input_scale)

    def to(self, device: torch.device | str) -> Nvfp4Weight:
        """Move every tensor to ``device`` (validated again on arrival)."""
        return Nvfp4Weight(
            packed=self.packed.to(device),
            block_scale=self.block_scale.to(device),
            global_scale=self.global_scale.to(device),
            input_scale=None if self.input_scale is None else self.input_scale.to(device),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (input_scale only when present)."""
        out = {
            "packed": self.packed,
            "block_scale": self.block_scale,
            "global_scale": self.global_scale,
        }
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        return out


def _block_scales_e4m3(block_amax: torch.Tensor, per_tensor: torch.Tensor) -> torch.Tensor:
    """ModelOpt's block-scale rule: amax / (6 * per_tensor) in fp32, clamped, cast to e4m3.

    All-zero blocks get 1.0 (any value decodes them to zero; ModelOpt does the same). The clamp
    keeps tiny blocks at the smallest subnormal 2**-9 instead of flushing them to zero.
    """
    s = block_amax / (E2M1_MAX * per_tensor)
    s = torch.where(block_amax == 0, torch.ones_like(s), s)
    return s.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)


def _encode_blocks(
    blocks: torch.Tensor, block_scale: torch.Tensor, per_tensor: torch.Tensor
) -> torch.Tensor:
    """Codes for ``blocks`` [..., G, 16] given e4m3 scales [..., G] and the multiplier."""
    denom = block_scale.to(torch.float32) * per_tensor
    return encode_e2m1(blocks / denom.unsqueeze(-1))


def quantize_nvfp4(
    weight: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    with_input_scale: torch.Tensor | float | None = None,
) -> Nvfp4Weight:
    """Quantize a float [N, K] weight the way ModelOpt does (for tests, tools, new checkpoints).

    * ``global_scale`` = amax(|W|) / (6 * 448) in float32 unless given, so the largest block
      scale lands on 448. An all-zero weight gets 1.0; a tiny amax is clamped so the
      multiplier stays a normal float32 (>= 2**-126).
    * block scale = block_amax / (6 * global_scale), clamped into [2**-9, 448], cast to e4m3.
    * codes = encode_e2m1(W / (block_scale * global_scale)), ties to even, saturating at 6.

    Error bound: for every element, |W - dequant| <= block_scale * global_scale (half the
    widest e2m1 step, or the saturation of a block max that the e4m3 rounding pushed above 6),
    unless a supplied ``global_scale`` is so small that a block scale was clamped at 448.
    ``with_input_scale`` (multiplier convention) marks the result as a W4A4 weight.
    """
    w = checks.check_float_matrix(weight, "quantize_nvfp4", NVFP4_GROUP_SIZE, "NVFP4")
    n, k = w.shape
    wf = w.detach().to(torch.float32)
    if global_scale is None:
        amax = wf.abs().amax()
        gs = amax / (E2M1_MAX * E4M3_MAX)
        gs = torch.where(amax == 0, torch.ones_like(gs), gs)
        gs = gs.clamp(min=torch.finfo(torch.float32).tiny)
    else:
        gs = checks.positive_scalar(global_scale, "global_scale", strict_dtype=False).to(w.device)
    blocks = wf.reshape(n, k // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    bs = _block_scales_e4m3(blocks.abs().amax(dim=-1), gs)
    codes = _encode_blocks(blocks, bs, gs).reshape(n, k)
    input_scale = None
    if with_input_scale is not None:
        input_scale = checks.positive_scalar(
            with_input_scale, "with_input_scale", strict_dtype=False
        ).to(w.device)
    return Nvfp4Weight(
        packed=pack_e2m1(codes),
        block_scale=bs,
        global_scale=gs.reshape(()).to(torch.float32),
        input_scale=input_scale,
    )


def dequantize_nvfp4(
    w: Nvfp4Weight, *, dtype: torch.dtype = torch.float32, rows: slice | None = None
) -> torch.Tensor:
    """Reference dequantization of ``rows`` (all by default) to a dense [n_rows, K] tensor.

    Computed in float32 (float64 if ``dtype`` is float64) as (e2m1 * block_scale) *
    global_scale: the first product is exact, so the result is the correctly rounded exact
    value before the final cast. ``rows`` lets callers bound the memory of the dense copy.
    """
    cd, sl = checks.dequantize_args(w, Nvfp4Weight, "dequantize_nvfp4", dtype, rows)
    packed = w.packed[sl]
    bs = w.block_scale[sl]
    n = packed.shape[0]
    vals = decode_e2m1(packed, cd).reshape(n, -1, NVFP4_GROUP_SIZE)
    out = (vals * bs.to(cd).unsqueeze(-1)) * w.global_scale.to(cd)
    return out.reshape(n, w.in_features).to(dtype)


def fake_quantize_nvfp4_activations(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """What a W4A4 kernel does to activations, quantized and dequantized back (same dtype as x).

    ``input_scale`` is the multiplier (ModelOpt convention). The quantization is the native
    kernels' rule, :func:`quantdispatch.formats.nvfp4_act.quantize_nvfp4_activations` (block
    scale rounded to e4m3 without a lower clamp, so a block whose scale rounds to 0 becomes
    zeros); the result is e2m1 * block_scale * input_scale in float32, cast to x's dtype
    (float64 input is quantized from its float32 rounding).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 1:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        checks.fail(
            f"fake_quantize_nvfp4_activations got x = {got}",
            "x must be a floating-point tensor [..., K]",
            "pass the activations in their 16/32-bit float dtype",
            InputError,
        )
    k = x.shape[-1]
    if k % NVFP4_GROUP_SIZE != 0:
        checks.fail(
            f"x has K = {k} features in its last dimension",
            f"NVFP4 activations are scaled per {NVFP4_GROUP_SIZE} elements along K",
            f"pad K to {-(-k // 16) * 16} with zeros (the weight must be padded the same way)",
            InputError,
        )
    if not bool(torch.isfinite(x).all()):
        checks.fail(
            f"x contains {int((~torch.isfinite(x)).sum())} NaN/inf value(s)",
            "only finite activations can be quantized",
            "find the layer that produced them",
            InputError,
        )
    s = checks.positive_scalar(input_scale, "input_scale", strict_dtype=False).to(x.device)
    x2 = x.detach().reshape(-1, k)
    if x2.dtype not in ACT_DTYPES:
        x2 = x2.to(torch.float32)
    q = quantize_nvfp4_activations(x2, input_scale=s, check_finite=False)
    return dequantize_nvfp4_activations(q).reshape(x.shape).to(x.dtype)


def global_scale_from_compressed_tensors(weight_global_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``weight_global_scale`` (6*448/amax, a divisor) -> our multiplier.

    The reciprocal is taken in float64 and rounded once to float32; that equals an IEEE float32
    division 1/x (double rounding is innocuous at 53 >= 2*24+2 bits), i.e. what
    compressed-tensors' own ModelOpt converter computes. Works for ``input_global_scale`` too.
    """
    ct = checks.positive_scalar(weight_global_scale, "weight_global_scale", strict_dtype=False)
    out = (1.0 / weight_global_scale.detach().reshape(()).to(torch.float64)).to(torch.float32)
    if not (math.isfinite(float(out)) and float(out) > 0):
        checks.fail(
            f"weight_global_scale {float(ct)!r} has no float32 reciprocal (gives {float(out)})",
            "the multiplier 1/weight_global_scale must be a finite, non-zero float32",
            "check the checkpoint convention: this value looks like a multiplier already",
        )
    return out.to(weight_global_scale.device)


def global_scale_to_compressed_tensors(global_scale: torch.Tensor | float) -> torch.Tensor:
    """Our multiplier -> compressed-tensors ``weight_global_scale``: [1]-shaped float32 1/x."""
    gs = checks.positive_scalar(global_scale, "global_scale", strict_dtype=False)
    out = (1.0 / gs.to(torch.float64)).to(torch.float32).reshape(1)
    if not (math.isfinite(float(out)) and float(out) > 0):
        checks.fail(
            f"global_scale {float(gs)!r} has no float32 reciprocal (gives {float(out[0])})",
            "compressed-tensors stores 1/global_scale as a finite, non-zero float32",
            "check that global_scale is the multiplier (amax / 2688), not already a reciprocal",
        )
    if isinstance(global_scale, torch.Tensor):
        out = out.to(global_scale.device)
    return out


def _check_shards(shards: Sequence[Nvfp4Weight]) -> list[bool]:
    """Refuse what merge_nvfp4_shards cannot merge; return which shards carry an input scale."""
    if isinstance(shards, Nvfp4Weight) or not isinstance(shards, Sequence) or len(shards) == 0:
        checks.fail(
            f"merge_nvfp4_shards got {type(shards).__name__}"
            + (" of length 0" if isinstance(shards, Sequence) else ""),
            "it takes a non-empty sequence of Nvfp4Weight shards, in output order",
            "pass e.g. [q, k, v] or [gate, up]",
            ConfigurationError,
        )
    for i, s in enumerate(shards):
        if not isinstance(s, Nvfp4Weight):
            checks.fail(
                f"shards[{i}] is a {type(s).__name__}",
                "every shard must be an Nvfp4Weight",
                "convert each checkpoint shard to Nvfp4Weight first",
                ConfigurationError,
            )
    first = shards[0]
    for i, s in enumerate(shards[1:], start=1):
        if s.in_features != first.in_features:
            checks.fail(
                f"shards[{i}] has K = {s.in_features} but shards[0] has K = {first.in_features}",
                "shards fused along N must share the input features K",
                "merge only projections that read the same input (q/k/v, gate/up)",
            )
        if s.packed.device != first.packed.device:
            checks.fail(
                f"shards[{i}] is on {s.packed.device} but shards[0] is on {first.packed.device}",
                "shards must be on one device to be merged",
                "move them with .to(device) first",
            )
    has_input = [s.input_scale is not None for s in shards]
    if any(has_input) and not all(has_input):
        checks.fail(
            f"only shards {[i for i, h in enumerate(has_input) if h]} of {len(shards)} carry "
            "an input_scale",
            "a fused layer is either W4A4 (every shard has an input scale) or weight-only",
            "load the input_scale of every shard, or drop all of them for weight-only use",
        )
    return has_input


def _common_global_scale(
    shards: Sequence[Nvfp4Weight],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The shards' largest global scale and every shard's block scales rescaled to it."""
    first = shards[0]
    gs_values = [float(s.global_scale) for s in shards]
    common_value = max(gs_values)
    common = torch.tensor(common_value, dtype=torch.float32, device=first.packed.device)
    scales = []
    for s, g in zip(shards, gs_values, strict=True):
        if g == common_value:
            scales.append(s.block_scale)
            continue
        ratio = torch.tensor(g / common_value, dtype=torch.float32, device=common.device)
        v = s.block_scale.to(torch.float32) * ratio
        v = torch.where(v > 0, v.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX), v)
        scales.append(v.to(torch.float8_e4m3fn))
    return common, scales


def merge_nvfp4_shards(shards: Sequence[Nvfp4Weight]) -> Nvfp4Weight:
    """Concatenate shards along N (fused q/k/v, gate/up) under ONE global scale.

    The common global scale is the max of the shards' global scales, so no rescaled block
    scale can exceed 448. Each other shard's block scales are multiplied by
    r = its_global / common (<= 1, in float32) and re-rounded to e4m3; the E2M1 codes are
    untouched. That re-rounding is the only change, with these bounds for a rescaled block
    scale v = block_scale * r (exact value) and its stored e4m3 value v':

    * v >= 2**-6 (e4m3 normal range): |v' - v| <= 2**-4 * v, so every element of the block
      changes by at most 2**-4 relative. Exact when r is a power of two.
    * 2**-9 <= v < 2**-6 (subnormal): |v' - v| <= 2**-10 absolute (half a subnormal step).
      Exact when r is a power of two and v is a multiple of 2**-9.
    * 0 < v < 2**-9: clamped to 2**-9 (never flushed to zero, which would erase the block):
      |v' - v| < 2**-9.

    In all cases |v' - v| <= max(2**-4 * v, 2**-9), so an element changes by at most
    6 * max(2**-4 * v, 2**-9) * common; the subnormal terms are below 2**-9 / 448 (~4.4e-6)
    of the merged tensor's largest representable magnitude 6 * 448 * common.

    input_scale: the max of the shards' input scales when all have one (the shards read the
    same activation, so the largest calibrated range is the one that cannot overflow), None
    when none has one. A mix raises: it would silently turn part of a W4A4 layer into W4A16.
    """
    has_input = _check_shards(shards)
    if len(shards) == 1:
        return shards[0]
    common, scales = _common_global_scale(shards)
    input_scale = None
    if all(has_input):
        input_scale = torch.stack([s.input_scale for s in shards]).amax()  # type: ignore[misc]
    return Nvfp4Weight(
        packed=torch.cat([s.packed for s in shards], dim=0),
        block_scale=torch.cat(scales, dim=0),
        global_scale=common,
        input_scale=input_scale,
    )

"""NVFP4 activation quantization (W4A4), in plain torch: the rule the native kernels apply.

Input: activations x [M, K] (bf16 / fp16; fp32 accepted), K a multiple of 16, and the layer's
per-tensor activation scale. Output: E2M1 codes packed two per byte (uint8 [M, K/2], element 2j
in the low nibble) and one e4m3 block scale per 16 elements ([M, K/16], or the swizzled 128x4
layout the block-scaled GEMM reads).

The per-tensor scale, two conventions for one number (docs/design/native-fp4.md has the sources):

* ModelOpt ``input_scale`` is a multiplier, amax / (6 * 448). Encode scale S = fl32(1 / s).
* compressed-tensors ``input_global_scale`` is the divisor 6 * 448 / amax: S = that value.

The quantizer works with S (vLLM / TensorRT-LLM ``scaled_fp4_quant`` take S). The GEMM applies
alpha = fl32(a * w) to its fp32 accumulator, with a the activations' multiplier
(``input_scale``, or fl32(1 / input_global_scale)) and w the weight's (``weight_scale_2``, or
1 / ``weight_global_scale``): y = alpha * sum(e2m1(qa) * sf_a * e2m1(qw) * sf_w).

The rule, per block of 16 consecutive elements of a row, every step an IEEE fp32 operation:

1. amax = max |x| over the block (exact);
2. sf = fl32(S * fl32(amax * fl32(1/6)));
3. sf8 = e4m3(sf): round to nearest even, saturate at 448, subnormals kept (values at or below
   2**-10 become 0, so a tiny or all-zero block gets scale 0 and all-zero codes);
4. os = 0 if sf8 == 0 else fl32(1 / fl32(sf8 * fl32(1/S)));
5. code = e2m1(fl32(x * os)): nearest, ties to the even code, saturating at 6; the sign bit is
   the sign bit of the product (so -0.0 and small negatives give code 8).

The CUDA quantizers compute the three reciprocals with ``rcp.approx.ftz.f32``; here they are
correctly rounded. The two agree except where a value lies within an ulp of a rounding boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quantdispatch.errors import ConfigurationError, InputError
from quantdispatch.formats import checks

__all__ = [
    "ACT_DTYPES",
    "E4M3_MAX",
    "ENCODE_SCALE_RANGE",
    "GROUP",
    "ActivationScale",
    "Nvfp4Activations",
    "activation_scale",
    "dequantize_nvfp4_activations",
    "e2m1_codes",
    "gemm_alpha",
    "quantize_nvfp4_activations",
    "quantize_nvfp4_activations_raw",
    "swizzle_block_scales",
    "swizzled_scale_shape",
    "unswizzle_block_scales",
]

GROUP = 16
E4M3_MAX = 448.0
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Accepted S: 1/S must stay a normal fp32 and sf8 * (1/S) >= 2**-9 * 2**-117 = 2**-126 too.
ENCODE_SCALE_RANGE = (2.0**-126, 2.0**117)

# e2m1 decision points on |y|: above 0.25, at or above 0.75, above 1.25, ... (nearest, ties to
# the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4, 5 -> 4).
_E2M1_STRICT = (0.25, 1.25, 2.5, 5.0)
_E2M1_INCLUSIVE = (0.75, 1.75, 3.5)


class ActivationScale(NamedTuple):
    """The per-tensor activation scale in both forms: ``encode`` = S, ``decode`` = a."""

    encode: torch.Tensor
    decode: torch.Tensor


@dataclass(frozen=True, eq=False)
class Nvfp4Activations:
    """Quantized activations: ``packed`` uint8 [M, K/2], ``block_scale`` e4m3 ([M, K/16], or
    flat in the swizzled layout when ``swizzled``), and the scale they were made with."""

    packed: torch.Tensor
    block_scale: torch.Tensor
    scale: ActivationScale
    swizzled: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """(M, K) of the activations."""
        return (int(self.packed.shape[0]), 2 * int(self.packed.shape[1]))


def _scalar(value: object, name: str, device: torch.device | None) -> torch.Tensor:
    """A finite, positive one-element scale as a 0-dim fp32 tensor (one device sync)."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.numel() != 1:
            checks.fail(
                f"{name} is a {value.dtype} tensor of shape {tuple(value.shape)}",
                f"{name} is one floating-point per-tensor value",
                "pass the checkpoint's single fp32 scale (shape () or (1,))",
                ConfigurationError,
            )
        t = value.detach().reshape(()).to(torch.float32)
        if device is not None:
            t = t.to(device)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        t = torch.tensor(float(value), dtype=torch.float32, device=device)
    else:
        checks.fail(
            f"{name} is a {type(value).__name__}",
            f"{name} must be a float32 tensor or a Python float",
            f"pass torch.tensor(value, dtype=torch.float32) as {name}",
            ConfigurationError,
        )
    v = float(t)
    if not (v > 0.0 and v != float("inf")):
        checks.fail(
            f"{name} is {v!r}",
            f"{name} must be finite and > 0",
            "recompute it from the calibrated activation amax; check the checkpoint convention "
            "(ModelOpt input_scale = amax/2688, compressed-tensors input_global_scale = 2688/amax)",
            ConfigurationError,
        )
    return t


def activation_scale(
    *,
    input_scale: torch.Tensor | float | None = None,
    input_global_scale: torch.Tensor | float | None = None,
    device: torch.device | str | None = None,
) -> ActivationScale:
    """Both forms of the activation scale from exactly one checkpoint convention.

    ``input_scale`` (ModelOpt multiplier): encode = fl32(1 / s), decode = s.
    ``input_global_scale`` (compressed-tensors divisor): encode = g, decode = fl32(1 / g).
    """
    if (input_scale is None) == (input_global_scale is None):
        checks.fail(
            "activation_scale got "
            + ("both input_scale and input_global_scale" if input_scale is not None else "neither"),
            "pass exactly one: input_scale (ModelOpt, a multiplier) or input_global_scale "
            "(compressed-tensors, a divisor)",
            "pick the tensor the checkpoint actually has",
            ConfigurationError,
        )
    dev = None if device is None else torch.device(device)
    if input_scale is not None:
        decode = _scalar(input_scale, "input_scale", dev)
        encode = torch.reciprocal(decode)
    else:
        encode = _scalar(input_global_scale, "input_global_scale", dev)
        decode = torch.reciprocal(encode)
    lo, hi = ENCODE_SCALE_RANGE
    s = float(encode)
    if not lo <= s <= hi:
        name = "input_scale" if input_scale is not None else "input_global_scale"
        checks.fail(
            f"{name} gives the encode scale S = {s!r}",
            "S must lie in [2**-126, 2**117] so that 1/S and the scaled block scales stay "
            "normal fp32 numbers",
            "check the checkpoint convention: a multiplier passed as a divisor is off by ~1e7",
            ConfigurationError,
        )
    return ActivationScale(encode=encode, decode=decode)


def gemm_alpha(decode: torch.Tensor, weight_global_scale: torch.Tensor) -> torch.Tensor:
    """alpha = fl32(a * w): the fp32 factor the W4A4 GEMM applies to its accumulator."""
    return (decode.to(torch.float32) * weight_global_scale.to(torch.float32)).reshape(())


def _check_x(x: object, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        checks.fail(
            f"{fn} got a {type(x).__name__}",
            "activations are a torch.Tensor [M, K]",
            "pass the layer input as a tensor",
            InputError,
        )
    if x.dtype not in ACT_DTYPES:
        checks.fail(
            f"{fn} got activations of dtype {x.dtype}",
            "NVFP4 activation quantization takes bfloat16 or float16 (float32 accepted)",
            "cast the activations to the model's bf16/fp16 dtype first",
            InputError,
        )
    if x.ndim != 2:
        checks.fail(
            f"{fn} got activations of shape {tuple(x.shape)}",
            "activations are 2-D [M, K]",
            "flatten the leading dimensions: x.reshape(-1, x.shape[-1])",
            InputError,
        )
    k = int(x.shape[1])
    if k == 0 or k % GROUP != 0:
        checks.fail(
            f"{fn} got activations with K = {k}",
            f"NVFP4 scales activations per {GROUP} elements along K: K must be a positive "
            f"multiple of {GROUP}",
            f"pad K with zeros to {max(GROUP, -(-k // GROUP) * GROUP)} (and the weight to match)",
            InputError,
        )
    return x


def _check_finite(x: torch.Tensor, fn: str) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = tuple(bad.nonzero()[0].tolist())
        checks.fail(
            f"{fn} got activations with {int(bad.sum())} NaN/inf value(s) "
            f"(first {float(x[first])!r} at {first})",
            "only finite activations can be quantized",
            "find the layer that produced them (overflow in fp16 is the usual cause)",
            InputError,
        )


def _reciprocal_six() -> torch.Tensor:
    return torch.tensor(1.0, dtype=torch.float32) / torch.tensor(6.0, dtype=torch.float32)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8, unpacked): nearest, ties to even, saturating, sign bit kept."""
    a = y.abs()
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t in _E2M1_STRICT:
        idx += a > t
    for t in _E2M1_INCLUSIVE:
        idx += a >= t
    return idx | (torch.signbit(y).to(torch.uint8) << 3)


def quantize_nvfp4_activations_raw(
    x: torch.Tensor, encode_scale: torch.Tensor, *, swizzle: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on trusted inputs: ``encode_scale`` a valid 0-dim fp32 S on x's device.

    No value checks and no device sync, for per-call paths whose scale was checked at load
    (non-finite x gives undefined codes, as in the CUDA kernels). Returns (packed, block_scale).
    """
    x = _check_x(x, "quantize_nvfp4_activations_raw")
    m, k = x.shape
    s = encode_scale.to(torch.float32).reshape(())
    blocks = x.to(torch.float32).reshape(m, k // GROUP, GROUP)
    amax = blocks.abs().amax(dim=-1)
    sf = s * (amax * _reciprocal_six().to(x.device))
    sf8 = sf.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # RNE; clamp = satfinite
    p = sf8.to(torch.float32) * torch.reciprocal(s)
    zero = p == 0
    os = torch.where(zero, torch.zeros_like(p), torch.reciprocal(torch.where(zero, 1.0, p)))
    codes = e2m1_codes(blocks * os.unsqueeze(-1)).reshape(m, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (swizzle_block_scales(sf8) if swizzle else sf8)


def quantize_nvfp4_activations(
    x: torch.Tensor,
    *,
    input_scale: torch.Tensor | float | None = None,
    input_global_scale: torch.Tensor | float | None = None,
    swizzle: bool = False,
    check_finite: bool = True,
) -> Nvfp4Activations:
    """Quantize x [M, K] to NVFP4 with the checkpoint's activation scale (either convention).

    Validates x (dtype, shape, K, and finiteness unless ``check_finite=False``) and the scale;
    both checks synchronize with the device once. ``swizzle`` returns the block scales in the
    GEMM's 128x4 layout (see :func:`swizzle_block_scales`).
    """
    x = _check_x(x, "quantize_nvfp4_activations")
    if check_finite:
        _check_finite(x, "quantize_nvfp4_activations")
    scale = activation_scale(
        input_scale=input_scale, input_global_scale=input_global_scale, device=x.device
    )
    packed, bs = quantize_nvfp4_activations_raw(x, scale.encode, swizzle=swizzle)
    return Nvfp4Activations(packed=packed, block_scale=bs, scale=scale, swizzled=swizzle)


def dequantize_nvfp4_activations(
    q: Nvfp4Activations, *, dtype: torch.dtype = torch.float32, scaled: bool = True
) -> torch.Tensor:
    """Values [M, K]: e2m1 * sf8 (exact in fp32), times the decode multiplier when ``scaled``.

    ``scaled=False`` gives exactly what the GEMM multiplies (alpha is applied after the sum).
    """
    m, k = q.shape
    bs = unswizzle_block_scales(q.block_scale, m, k // GROUP) if q.swizzled else q.block_scale
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    p = q.packed
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(m, k).long()
    mags = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), dtype=cd, device=p.device)
    vals = torch.cat([mags, -mags])[codes].reshape(m, k // GROUP, GROUP)
    out = (vals * bs.to(cd).unsqueeze(-1)).reshape(m, k)
    if scaled:
        out = out * q.scale.decode.to(cd)
    return out.to(dtype)


# ---------------------------------------------------------------------------------------------
# The block-scale layout of cuBLASLt / CUTLASS block-scaled GEMMs (VEC16_UE4M3)
# ---------------------------------------------------------------------------------------------


def swizzled_scale_shape(rows: int, groups: int) -> tuple[int, int]:
    """(rows padded to 128, scale columns padded to 4): the swizzled buffer holds their product."""
    return (-(-rows // 128) * 128, -(-groups // 4) * 4)


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """[R, G] block scales -> the flat 128x4-tiled layout (contiguous, zero padding).

    Tiles of 128 rows x 4 scale columns, row-tile major then column-tile; inside a tile of 512
    bytes the scale of row r (0..127) and column c (0..3) sits at (r % 32) * 16 + (r // 32) * 4
    + c. Same dtype out as in (e4m3, or its uint8 bits).
    """
    if not isinstance(scales, torch.Tensor) or scales.ndim != 2 or scales.element_size() != 1:
        got = (
            f"{scales.dtype} {tuple(scales.shape)}"
            if isinstance(scales, torch.Tensor)
            else type(scales).__name__
        )
        checks.fail(
            f"swizzle_block_scales got {got}",
            "block scales are a 2-D one-byte tensor [rows, K/16] (float8_e4m3fn or uint8)",
            "pass the unswizzled scales",
            ConfigurationError,
        )
    r, g = scales.shape
    rp, gp = swizzled_scale_shape(r, g)
    buf = torch.zeros((rp, gp), dtype=torch.uint8, device=scales.device)
    buf[:r, :g] = scales.view(torch.uint8)
    tiles = buf.reshape(rp // 128, 4, 32, gp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(-1).view(scales.dtype)


def unswizzle_block_scales(flat: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_block_scales`: the flat buffer -> [rows, groups] (padding cut)."""
    rp, gp = swizzled_scale_shape(rows, groups)
    if not isinstance(flat, torch.Tensor) or flat.numel() != rp * gp or flat.element_size() != 1:
        got = (
            f"{flat.dtype} with {flat.numel()} elements"
            if isinstance(flat, torch.Tensor)
            else type(flat).__name__
        )
        checks.fail(
            f"unswizzle_block_scales got {got} for rows={rows}, groups={groups}",
            f"the swizzled buffer of a [{rows}, {groups}] scale matrix holds {rp} x {gp} = "
            f"{rp * gp} one-byte elements",
            "pass the buffer made for this matrix, with its own rows and K/16",
            ConfigurationError,
        )
    u = flat.contiguous().view(torch.uint8).reshape(rp // 128, gp // 4, 32, 4, 4)
    out = u.permute(0, 3, 2, 1, 4).reshape(rp, gp)[:rows, :groups]
    return out.contiguous().view(flat.dtype)

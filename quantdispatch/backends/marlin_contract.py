"""Marlin's preparation of FP4 weights: the Python half of the provider contract, as plain torch.

The facts (with their sources) are in docs/design/marlin.md. In short, for an FP4 weight
[N, K] the Marlin kernel reads:

- the codes in GPTQ order (int32 [K/8, N], eight 4-bit codes along K per word, element 8r+i in
  bits 4i..4i+3) after the provider's compiled ``gptq_marlin_repack`` put them into its tiles;
- the block scales transposed to [K/g, N], permuted in chunks of 64 (position 8i+j takes entry
  i+8j) and then pairwise swapped inside every 4 (order 0, 2, 1, 3), because the kernel widens
  two scales from every 32-bit load;
- NVFP4 scales re-encoded (below) and the per-tensor scale times a power of two that undoes
  the kernel's unbiased FP4 decode; MXFP4 scales stay E8M0 bytes.

NVFP4 scale encoding ("S0E5M3"): a scale s becomes the top byte of fp16(s * 2^7 * f), sign
dropped (fp16 bits 14..7: 5 exponent bits, 3 mantissa bits). With fp16 activations the kernel
shifts that byte back into an fp16 (exact for every e4m3 value). With bf16 it moves the byte's
top bit to the bf16 exponent's top bit, which is right only when that bit is 1, i.e. when
s * 2^7 * f >= 2. So for bf16, f is the largest power of two keeping the largest scale
<= 448 * 2^7 and values still below 2 become 0 (they are below ~2^-14 of the largest).
The per-tensor scale becomes g * 2^(B - 7) / f with B = 14 (fp16) or 126 (bf16).

Everything here works on the canonical tensors of quantdispatch.formats and never touches a
provider; the one compiled step (the tile repack) is passed in as a callable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantdispatch.errors import WeightFormatError, format_error

__all__ = [
    "FLOAT4_E2M1F_ID",
    "MarlinLinearTensors",
    "decode_nvfp4_scale_bytes",
    "encode_nvfp4_scales",
    "fits_tiles",
    "gptq_order",
    "moe_padded_intermediate",
    "nvfp4_global_scale",
    "nvfp4_scale_factor",
    "padded_shape",
    "prepare_linear",
    "scalar_type_id",
    "scale_permutation",
]

#: (N multiple, K multiple) of Marlin's two thread-tile families (64x128 and 128x64 tiles).
TILE_FAMILIES = ((64, 128), (128, 64))
#: Power of two the S0E5M3 encoding multiplies every NVFP4 block scale by.
SCALE_SHIFT = 7
#: Exponent offset of the kernel's unbiased FP4 decode, per activation dtype.
FP4_DECODE_BIAS = {torch.float16: 14, torch.bfloat16: 126}
_E4M3_MAX = 448.0


def scalar_type_id(
    exponent: int, mantissa: int, signed: bool, bias: int, finite_only: bool, nan_repr: int
) -> int:
    """The integer a Marlin op takes for a weight type (vLLM's ScalarType.id packing:
    exponent 8 bits, mantissa 8, signed 1, bias 32, finite-values-only 1, NaN kind 8)."""
    val = 0
    offset = 0
    for value, width in (
        (exponent, 8),
        (mantissa, 8),
        (int(signed), 1),
        (bias, 32),
        (int(finite_only), 1),
        (nan_repr, 8),
    ):
        val |= (int(value) & ((1 << width) - 1)) << offset
        offset += width
    return val


#: float4_e2m1f: 2 exponent bits, 1 mantissa bit, signed, finite, no NaN (= 562949953487106).
FLOAT4_E2M1F_ID = scalar_type_id(2, 1, True, 0, True, 0)


def fits_tiles(n: int, k: int) -> bool:
    return any(n % tn == 0 and k % tk == 0 for tn, tk in TILE_FAMILIES)


def padded_shape(n: int, k: int, group: int) -> tuple[int, int]:
    """The smallest (N', K') >= (N, K) that fits one tile family, K' a multiple of ``group``
    (least area first, then least perimeter). (N, K) itself when it fits."""
    cands = [
        (-(-n // tn) * tn, -(-k // math.lcm(tk, group)) * math.lcm(tk, group))
        for tn, tk in TILE_FAMILIES
    ]
    return min(cands, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def moe_padded_intermediate(inter: int, hidden: int) -> int | None:
    """I' for a MoE layer: I rounded up to 64 when H % 128 == 0, to 128 when only H % 64 == 0
    (then w13 [2I', H] and w2 [H, I'] both fit a tile family); None when H % 64 != 0."""
    if hidden % 128 == 0:
        return -(-inter // 64) * 64
    if hidden % 64 == 0:
        return -(-inter // 128) * 128
    return None


def scale_permutation(groups: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """For every position of Marlin's scale array (row-major [groups, n]), the index of the
    entry of the row-major [groups, n] scales it holds."""
    total = groups * n
    if total % 64:
        raise ValueError(f"scale grid {groups}x{n} is not a whole number of 64-entry chunks")
    chunk = torch.tensor([i + 8 * j for i in range(8) for j in range(8)], device=device)
    idx = (torch.arange(0, total, 64, device=device)[:, None] + chunk).reshape(-1, 4)
    return idx[:, [0, 2, 1, 3]].reshape(-1)


def permute_scales(scales_kn: torch.Tensor) -> torch.Tensor:
    """[K/g, N] scale bytes (uint8) in Marlin's order, same shape."""
    g, n = scales_kn.shape
    perm = scale_permutation(g, n, scales_kn.device)
    return scales_kn.reshape(-1)[perm].reshape(g, n)


def nvfp4_scale_factor(block_scale: torch.Tensor, act_dtype: torch.dtype) -> float:
    """f: 1 for fp16; for bf16 the largest power of two with max(s) * 2^7 * f <= 448 * 2^7."""
    if act_dtype == torch.float16:
        return 1.0
    s = block_scale.float()
    nonzero = s[s > 0]
    if nonzero.numel() == 0:
        return 1.0
    largest = float(nonzero.max())
    if largest >= _E4M3_MAX:
        return 1.0
    return 2.0 ** math.floor(math.log2(_E4M3_MAX / largest))


def encode_nvfp4_scales(
    block_scale: torch.Tensor, act_dtype: torch.dtype, factor: float
) -> torch.Tensor:
    """e4m3 block scales (any shape) -> S0E5M3 bytes (uint8, same shape); see the module doc."""
    v = block_scale.float() * (2.0**SCALE_SHIFT * factor)
    if act_dtype == torch.bfloat16:
        v = torch.where(v < 2.0, torch.zeros_like(v), v)
    if bool((v > 65504.0).any()):
        raise ValueError(f"scale factor {factor} overflows the fp16 encoding")
    bits = v.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    if bool((bits & 0x7F).any()):
        raise ValueError("a block scale has more than 3 mantissa bits: not an e4m3 value")
    return ((bits >> 7) & 0xFF).to(torch.uint8)


def decode_nvfp4_scale_bytes(encoded: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """What the kernel makes of S0E5M3 bytes, as float32 (fp16: the byte shifted into an fp16;
    bf16: its top bit moved to the bf16 exponent's top bit). For documentation and checks."""
    b = encoded.to(torch.int32)
    if act_dtype == torch.float16:
        return (b << 7).to(torch.int16).view(torch.float16).float()
    exponent = ((b >> 7) << 7) | ((b >> 3) & 0xF)
    bits = (exponent << 7) | ((b & 7) << 4)
    return bits.to(torch.int16).view(torch.bfloat16).float()


def nvfp4_global_scale(global_scale: torch.Tensor, act_dtype: torch.dtype, factor: float):
    """The per-tensor scale the kernel multiplies by: g * 2^(B - 7) / f, float32 [1]."""
    g = global_scale.reshape(-1).to(torch.float32) * (
        2.0 ** (FP4_DECODE_BIAS[act_dtype] - SCALE_SHIFT) / factor
    )
    if not bool(torch.isfinite(g).all()):
        raise WeightFormatError(
            format_error(
                f"NVFP4 global scale {float(global_scale.reshape(-1)[0])} overflows float32 "
                f"after Marlin's 2^{FP4_DECODE_BIAS[act_dtype] - SCALE_SHIFT} exponent offset",
                "the Marlin kernel takes the per-tensor scale times that power of two",
                "use another backend for this weight (its block scales are tiny against the "
                "per-tensor scale; requantize with ModelOpt's amax / (6 * 448) rule)",
            )
        )
    return g


def gptq_order(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] codes (low nibble first) -> int32 [..., K/8, N], the repack input."""
    words = packed.contiguous().view(torch.int32)
    return words.transpose(-1, -2).contiguous()


def pad_rows_cols(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad the last two dims of a uint8 tensor to (rows, cols)."""
    r, c = t.shape[-2:]
    if (r, c) == (rows, cols):
        return t
    return torch.nn.functional.pad(t, (0, cols - c, 0, rows - r))


@dataclass(frozen=True)
class MarlinLinearTensors:
    qweight: torch.Tensor
    """int32 [K'/16, 2N'] from the provider's repack."""
    scales: torch.Tensor
    """float8_e4m3fn (NVFP4, S0E5M3 bytes) or float8_e8m0fnu (MXFP4) [K'/g, N']."""
    global_scale: torch.Tensor | None
    """float32 [1] (NVFP4) or None."""
    n_pad: int
    k_pad: int


Repack = Callable[[torch.Tensor, int, int], torch.Tensor]
"""(int32 [K'/8, N'] in GPTQ order, K', N') -> the provider's repacked int32 [K'/16, 2N']."""


def prepare_linear(
    fmt: str,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    act_dtype: torch.dtype,
    repack: Repack,
) -> MarlinLinearTensors:
    """One FP4 weight (canonical tensors, on the target device) in Marlin's form, zero-padded
    to the tile grid (padded codes are 0 = +0.0 and padded scales 0)."""
    group = 16 if fmt == "nvfp4" else 32
    n, k = packed.shape[0], packed.shape[1] * 2
    n_pad, k_pad = padded_shape(n, k, group)
    codes = pad_rows_cols(packed, n_pad, k_pad // 2)
    qweight = repack(gptq_order(codes), k_pad, n_pad)
    scale_bytes = pad_rows_cols(block_scale.view(torch.uint8), n_pad, k_pad // group)
    scales_kn = permute_scales(scale_bytes.t().contiguous())
    if fmt == "mxfp4":
        return MarlinLinearTensors(
            qweight, scales_kn.view(torch.float8_e8m0fnu), None, n_pad, k_pad
        )
    e4m3 = scales_kn.view(torch.float8_e4m3fn)
    factor = nvfp4_scale_factor(e4m3, act_dtype)
    encoded = encode_nvfp4_scales(e4m3, act_dtype, factor)
    assert global_scale is not None
    g = nvfp4_global_scale(global_scale, act_dtype, factor)
    return MarlinLinearTensors(qweight, encoded.view(torch.float8_e4m3fn), g, n_pad, k_pad)

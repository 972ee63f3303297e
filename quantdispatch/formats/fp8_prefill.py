"""FP8 prefill operands in plain torch: FP4 weights re-encoded to block-scaled FP8 e4m3, and
activations quantized per token and per 128 columns. The rule the Triton kernels
(:mod:`quantdispatch.kernels.native.fp8_prefill_quant`) reproduce bit for bit; sources and the
proofs of the bounds are in docs/design/fp8-prefill.md.

The rule, for one block of a matrix (128 x 128, 1 x 128 or one whole row; K a multiple of 128):

1. the block's values ``u`` are exact fp32 numbers: for a weight its *unit* values, e2m1 times
   the block-16 e4m3 scale (NVFP4) or times 2^(s - 127) (MXFP4), without the NVFP4 global
   scale; for activations the 16-bit inputs;
2. ``amax`` = max |u| (exact), and the block exponent ``e`` is the smallest integer with
   amax <= 448 * 2^e (e = 0 for an all-zero block), clamped to [-126, 126];
3. ``code = e4m3(u * 2^-e)``: the scaling is exact (a power of two), then one rounding to the
   nearest e4m3 value, ties to the even code, subnormals kept, sign kept (the canonical zero
   keeps its sign: -0 -> 0x80, +0 -> 0x00, in every kernel and on every Triton version); never
   saturates, since |u * 2^-e| <= 448; +-inf gives the NaN code 0x7F | sign, NaN gives 0x7F;
4. the block's fp32 scale is ``fl32(2^e * mult)``, with ``mult`` the NVFP4 global scale (exact
   for global scales in [2^-100, 2^100]) or 1; an all-zero block's scale is 0 (so every
   layout and multiplier gives the same bits for it).

Why a power of two and not amax / 448: the scaling step is then exact, so the only rounding is
step 3, and e2m1 x e4m3 products with at most 4 significant bits stay exact (74% of the
(code, scale) pairs; MXFP4 values have at most 2 significant bits and are all exact). Worst
relative error per weight in e4m3's normal range: 1/21 for NVFP4 (the product 5.25 = 3 x 1.75
rounds to 5), 0 for MXFP4; amax / 448 scaling gives 1/17.5 and keeps ~18% exact. The cost: the
block maximum maps into (224, 448] instead of onto 448, one binade less before e4m3's subnormal
range.
"""

from __future__ import annotations

import torch

from quantdispatch.errors import InputError, WeightFormatError, format_error

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "MX_EXPONENT_RANGE",
    "NVFP4_REL_BOUND",
    "block_exponent",
    "check_mx_exponents",
    "e4m3_codes",
    "fp4_unit_values",
    "pow2",
    "quantize_blocks_torch",
    "reencode_fp4_torch",
    "scale_grid",
]

BLOCK = 128
E4M3_MAX = 448.0
#: Worst relative error of re-encoding one NVFP4 weight whose scaled value is an e4m3 normal
#: (>= 2^-6); below that the error is at most 2^-10 * 2^e absolute (tests/numerics prove both).
NVFP4_REL_BOUND = 1.0 / 21.0
#: MXFP4 exponents (e8m0 byte - 127) the re-encoder takes: every unit value stays a normal fp32.
MX_EXPONENT_RANGE = (-100, 100)


def block_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 e per block: the smallest integer with amax <= 448 * 2^e, from the fp32 bits.

    amax = 1.f * 2^E fits under 1.75 * 2^(8 + e) with e = E - 8 when 1.f <= 1.75 (mantissa
    field <= 0x600000), else e = E - 7. Zero gives 0; the result is clamped to [-126, 126]."""
    a = amax.to(torch.float32).contiguous()
    bits = a.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = torch.where(a == 0, torch.zeros_like(e), e)
    return e.clamp(-126, 126)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as exact fp32 for int32 e in [-126, 127], built from the exponent field."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def e4m3_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 values with |v| <= 448 (or non-finite) -> e4m3 codes (uint8): nearest, ties to the
    even code, subnormals kept, sign kept; +-inf -> 0x7F | sign, NaN -> 0x7F (the GPU does not
    keep NaN signs)."""
    finite = torch.isfinite(v)
    codes = torch.where(finite, v, torch.zeros_like(v)).to(torch.float8_e4m3fn).view(torch.uint8)
    inf = torch.where(torch.signbit(v) & ~torch.isnan(v), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(finite, codes, inf)


def scale_grid(rows: int, k: int, block_rows: int, block_cols: int) -> tuple[int, int]:
    """Shape of the natural (row-block, column-block) scale grid of a [rows, k] operand."""
    return (-(-rows // block_rows), k // block_cols)


def _check_blocks(k: int, block_rows: int, block_cols: int, where: str) -> None:
    if block_rows not in (1, BLOCK) or block_cols <= 0 or k % block_cols or block_cols % BLOCK:
        raise InputError(
            format_error(
                f"{where}: blocks of {block_rows} x {block_cols} on K = {k}",
                f"blocks are 1 or {BLOCK} rows by a multiple of {BLOCK} columns dividing K",
                "use (128, 128), (1, 128) or (1, K) with K a multiple of 128",
            )
        )


def _quantize_unit(
    u: torch.Tensor, block_rows: int, block_cols: int, mult: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-4 of the rule on exact fp32 values u [rows, K] -> (codes uint8, scales fp32)."""
    rows, k = u.shape
    rb, kb = scale_grid(rows, k, block_rows, block_cols)
    pad = rb * block_rows - rows
    up = torch.cat([u, u.new_zeros(pad, k)]) if pad else u
    blocks = up.reshape(rb, block_rows, kb, block_cols)
    # a NaN anywhere makes the block's amax infinite (as the kernels' NaN-ignoring max sees it)
    amax = blocks.abs().nan_to_num(nan=float("inf"), posinf=float("inf")).amax(dim=(1, 3))
    e = block_exponent(amax)
    scaled = blocks * pow2(-e)[:, None, :, None]
    codes = e4m3_codes(scaled).reshape(rb * block_rows, k)[:rows]
    scale = pow2(e)
    if mult is not None:
        scale = scale * mult.to(torch.float32).reshape(())
    return codes, torch.where(amax == 0, torch.zeros_like(scale), scale)


def quantize_blocks_torch(
    x: torch.Tensor,
    *,
    block_rows: int = 1,
    block_cols: int = BLOCK,
    mult: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [rows, K] (bf16 / fp16 / fp32) -> (e4m3 codes uint8 [rows, K], fp32
    scales [row blocks, column blocks]) by the rule, x's values taken as they are (exact)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise InputError(
            format_error(
                f"quantize_blocks_torch: x is {getattr(x, 'dtype', type(x).__name__)} "
                f"{tuple(getattr(x, 'shape', ()))}",
                "x must be a 2-D floating-point [rows, K] tensor",
                "flatten the leading dimensions first",
            )
        )
    _check_blocks(x.shape[1], block_rows, block_cols, "quantize_blocks_torch")
    return _quantize_unit(x.to(torch.float32), block_rows, block_cols, mult)


def check_mx_exponents(block_scale_u8: torch.Tensor, where: str) -> None:
    """Reject MXFP4 scales outside :data:`MX_EXPONENT_RANGE` (one device sync; call once at
    load): with them the unit values and the kernels' fp32 steps stay exact."""
    lo, hi = MX_EXPONENT_RANGE
    e = block_scale_u8.to(torch.int32) - 127
    if e.numel() and bool(((e < lo) | (e > hi)).any()):
        raise WeightFormatError(
            format_error(
                f"{where}: MXFP4 block scales span 2^{int(e.min())} .. 2^{int(e.max())}",
                f"FP8 prefill re-encodes MXFP4 scales within 2^{lo} .. 2^{hi}",
                "run this layer weight-only (FP8 compute off for it)",
            )
        )


def fp4_unit_values(
    packed: torch.Tensor, block_scale_u8: torch.Tensor, scale_format: str
) -> torch.Tensor:
    """Exact fp32 unit values [rows, K] of an FP4 weight: e2m1 x block scale (no global scale).

    ``packed`` uint8 [rows, K/2] (element 2j in the low nibble), ``block_scale_u8`` uint8
    [rows, K/16] e4m3 bits (``scale_format="e4m3"``) or [rows, K/32] e8m0 bytes ("e8m0")."""
    rows, k = packed.shape[0], packed.shape[1] * 2
    p = packed.to(torch.int32)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(rows, k)
    lut = torch.tensor(
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
        dtype=torch.float32,
        device=packed.device,
    )
    vals = lut[codes.long()]
    if scale_format == "e4m3":
        group, scale = 16, block_scale_u8.view(torch.float8_e4m3fn).to(torch.float32)
    elif scale_format == "e8m0":
        group, scale = 32, pow2(block_scale_u8.to(torch.int32) - 127)
    else:
        raise InputError(
            format_error(
                f"fp4_unit_values: scale_format {scale_format!r}",
                "the scale format is 'e4m3' (NVFP4) or 'e8m0' (MXFP4)",
                "pass the weight's scale format",
            )
        )
    return (vals.reshape(rows, k // group, group) * scale[:, :, None]).reshape(rows, k)


def reencode_fp4_torch(
    packed: torch.Tensor,
    block_scale_u8: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    scale_format: str,
    block_rows: int = BLOCK,
    block_cols: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP4 weight's rows -> (e4m3 codes uint8 [rows, K], fp32 scales [row blocks, K /
    block_cols]) by the rule; the NVFP4 global scale is folded into the scales (step 4)."""
    k = packed.shape[1] * 2
    _check_blocks(k, block_rows, block_cols, "reencode_fp4_torch")
    u = fp4_unit_values(packed, block_scale_u8, scale_format)
    return _quantize_unit(u, block_rows, block_cols, global_scale)

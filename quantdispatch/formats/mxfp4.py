"""MXFP4 (OCP Microscaling, used by gpt-oss): E2M1 codes, one E8M0 scale per 32 elements along K.

    W[n, k] = e2m1(code[n, k]) * 2 ** (block_scale[n, k // 32] - 127)

No per-tensor scale. E8M0 is a bare biased exponent: 0..254 are 2**-127 .. 2**127, 255 is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantdispatch.format_facts import FP4_GROUP_SIZES
from quantdispatch.formats import checks
from quantdispatch.formats.e2m1 import (
    PackedFp4,
    decode_e2m1,
    encode_e2m1,
    pack_e2m1,
)

__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "FP16_MX_EXPONENTS",
    "MXFP4_GROUP_SIZE",
    "Mxfp4Weight",
    "dequantize_mxfp4",
    "e8m0_to_float",
    "mx_scale_range",
    "quantize_mxfp4",
    "rebase_mx_scales_for_fp16",
]

MXFP4_GROUP_SIZE: int = FP4_GROUP_SIZES["mxfp4"]
E8M0_BIAS = 127
E8M0_NAN = 255
# OCP MX: the shared exponent is floor(log2(block_amax)) - emax_elem, and E2M1's largest
# power of two is 4 = 2**2.
_E2M1_EMAX = 2


_MX_SCALE_FIXES = (
    "pass the scales that belong to this weight (same TP shard / same expert)",
    "check that the scales are not swizzled/padded and belong to this weight",
)


@dataclass(frozen=True, eq=False)
class Mxfp4Weight(PackedFp4):
    """A validated MXFP4 weight: packed codes [N, K/2] and E8M0 exponent bytes [N, K/32].

    ``block_scale`` may be given as torch.float8_e8m0fnu; it is stored as its uint8 bits so
    every consumer sees one dtype.
    """

    packed: torch.Tensor
    block_scale: torch.Tensor

    def __post_init__(self) -> None:
        packed, n, k = checks.check_packed(
            self.packed,
            "mxfp4",
            "pass the packed codes as torch.uint8 [N, K/2] (gpt-oss *_blocks flattened to 2-D)",
        )
        bs = self.block_scale
        if isinstance(bs, torch.Tensor) and bs.dtype == torch.float8_e8m0fnu:
            bs = bs.view(torch.uint8)
            object.__setattr__(self, "block_scale", bs)
        bs = checks.require_tensor(
            bs,
            "Mxfp4Weight.block_scale",
            torch.uint8,
            "pass the E8M0 exponents as torch.uint8 (or torch.float8_e8m0fnu) [N, K/32]",
        )
        checks.check_scale_grid(bs, "mxfp4", n, k, _MX_SCALE_FIXES)
        checks.require_device(bs, "Mxfp4Weight.block_scale", packed.device, "packed")
        nan = bs == E8M0_NAN
        if checks.has_values(bs) and bool(nan.any()):
            first = tuple(nan.nonzero()[0].tolist())
            checks.fail(
                f"Mxfp4Weight.block_scale contains {int(nan.sum())} byte(s) equal to 255 "
                f"(first at index {first})",
                "E8M0 255 is NaN; valid exponents are 0..254 (2**-127 .. 2**127)",
                "the checkpoint is corrupt or the scales are not E8M0 bytes: re-export it",
            )

    def nbytes(self) -> int:
        """Bytes held by all tensors."""
        return checks.nbytes(self.packed, self.block_scale)

    def to(self, device: torch.device | str) -> Mxfp4Weight:
        """Move every tensor to ``device``."""
        return Mxfp4Weight(packed=self.packed.to(device), block_scale=self.block_scale.to(device))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by field name."""
        return {"packed": self.packed, "block_scale": self.block_scale}


def e8m0_to_float(bits: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> exact float32 powers of two, built from the float32 bit pattern.

    Byte b in 1..254 is the float32 with exponent field b (2**(b-127)); b = 0 is the float32
    subnormal 2**-127. No pow/exp2 call, so there is no library rounding to trust.
    """
    b = bits.to(torch.int32)
    pattern = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    return pattern.view(torch.float32)


def quantize_mxfp4(weight: torch.Tensor) -> Mxfp4Weight:
    """Quantize a float [N, K] weight to MXFP4 with the OCP MX rule.

    Per 32-element block: shared exponent e = floor(log2(block_amax)) - 2 (exactly, via frexp),
    clamped to the E8M0 range [-127, 127]; codes = encode_e2m1(W / 2**e) (ties to even,
    saturating). All-zero blocks get e = 0. Scaled magnitudes lie in [0, 8): values in (6, 8)
    saturate to 6, so the per-element error is <= 2**e for |W| <= 6 * 2**e (half the widest
    step) and < 2 * 2**e above it, i.e. up to 25% of the block max: that is the format.
    """
    w = checks.check_float_matrix(weight, "quantize_mxfp4", MXFP4_GROUP_SIZE, "MXFP4")
    n, k = w.shape
    wf = w.detach().to(torch.float32)
    blocks = wf.reshape(n, k // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE)
    amax = blocks.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # amax = m * 2**exp with m in [0.5, 1): floor(log2) = exp - 1
    e = exp.to(torch.int32) - 1 - _E2M1_EMAX
    e = torch.where(amax == 0, torch.zeros_like(e), e).clamp(-E8M0_BIAS, E8M0_BIAS)
    bits = (e + E8M0_BIAS).to(torch.uint8)
    scale = e8m0_to_float(bits)
    codes = encode_e2m1(blocks / scale.unsqueeze(-1)).reshape(n, k)
    return Mxfp4Weight(packed=pack_e2m1(codes), block_scale=bits)


def dequantize_mxfp4(
    w: Mxfp4Weight, *, dtype: torch.dtype = torch.float32, rows: slice | None = None
) -> torch.Tensor:
    """Reference dequantization of ``rows`` (all by default) to a dense [n_rows, K] tensor.

    Exact in float32 (power-of-two scales), except that blocks with exponents above 2**125
    overflow float32 (never seen in real checkpoints): ask for float64 if you have them.
    """
    cd, sl = checks.dequantize_args(w, Mxfp4Weight, "dequantize_mxfp4", dtype, rows)
    packed = w.packed[sl]
    n = packed.shape[0]
    vals = decode_e2m1(packed, cd).reshape(n, -1, MXFP4_GROUP_SIZE)
    scale = e8m0_to_float(w.block_scale[sl]).to(cd)
    return (vals * scale.unsqueeze(-1)).reshape(n, w.in_features).to(dtype)


#: fp16 holds every product e2m1 * 2^E exactly for block scales 2^E with E in this range
#: (6 * 2^13 < 65504; 0.5 * 2^-23 = 2^-24 is fp16's smallest subnormal).
FP16_MX_EXPONENTS = (-23, 13)


def mx_scale_range(
    packed: torch.Tensor, e8m0_u8: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The exponent range of the block scales 2^E that MXFP4 weights [..., N, K/2] / [..., N,
    K/32] use: (smallest E, largest E) per leading index (0-d for one weight, [E] for an expert
    stack), the mask of used blocks, the codes as int32; None when no block is used. A block
    is used when it holds a non-zero code and a finite scale: all-zero blocks (codes +-0)
    contribute nothing whatever their scale; NaN codes (255) are left for the caller's checks."""
    groups = e8m0_u8.shape[-1]
    magnitude = (packed.view(torch.uint8) & 0x77).reshape(*e8m0_u8.shape[:-1], groups, -1)
    e = e8m0_u8.to(torch.int32)
    used = (magnitude != 0).any(dim=-1) & (e != 255)
    if not bool(used.any()):
        return None
    lo = torch.where(used, e, 1 << 20).amin(dim=(-2, -1)) - 127
    hi = torch.where(used, e, -(1 << 20)).amax(dim=(-2, -1)) - 127
    return lo, hi, used, e


def rebase_mx_scales_for_fp16(
    packed: torch.Tensor, e8m0_u8: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """MXFP4 block scales for kernels that round the decoded weight to fp16 (the checkpoint
    layout's tl.dot kernels): (codes, d) with codes = e - d, so that e2m1 * 2^(e - d - 127)
    fits fp16, and 2^d applied to the fp32 accumulator instead.

    d = 0 (the codes returned as they are) while every block with a non-zero code has its
    scale in :data:`FP16_MX_EXPONENTS`, as in real checkpoints. Otherwise the largest scale
    goes to 2^13 (6 * 2^13 < 65504); blocks more than 36 binades below it underflow (their
    products are below 2^-36 of the largest ones); all-zero blocks get code 0. E8M0 scales reach
    2^127, far outside fp16: without this a weight with scales of 2^14+ gave inf and tiny ones
    flushed to zero, silently. One pass over the weight at load, on its device; NaN codes (255)
    are kept for the caller's checks."""
    found = mx_scale_range(packed, e8m0_u8)
    if found is None:
        return e8m0_u8, 0
    lo, hi, used, e = found
    low, high = FP16_MX_EXPONENTS
    d = int(hi) - high
    # inside the window, or the top already at 2^13 (the blocks below round, as in fp16)
    if (int(lo) >= low and d <= 0) or d == 0:
        return e8m0_u8, 0
    shifted = torch.where(used, (e - d).clamp(0, 254), torch.zeros_like(e))
    shifted = torch.where(e == 255, e, shifted)
    return shifted.to(torch.uint8), d

"""E2M1 (FP4) element codes: the value table, nibble packing, and round-to-nearest encoding.

Shared by NVFP4 and MXFP4. A code is 4 bits: bit 3 is the sign, bits 2..0 index the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 8 is -0.0). Two codes share a byte: the element with the even
index along K sits in the LOW nibble, the odd one in the HIGH nibble (ModelOpt,
compressed-tensors, gpt-oss and PyTorch's float4_e2m1fn_x2 all agree).
"""

from __future__ import annotations

import torch

from quantdispatch.errors import WeightFormatError, format_error

__all__ = [
    "E2M1_MAX",
    "decode_e2m1",
    "e2m1_values",
    "encode_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
]

E2M1_MAX = 6.0
"""Largest E2M1 magnitude; encoding saturates here."""

_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes: a value exactly on one of these is a tie.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_values(
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Return the 16-entry code -> value table (index 8 is -0.0), for table-lookup decoding."""
    mags = torch.tensor(_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def _check_uint8(t: torch.Tensor, name: str, what_for: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise WeightFormatError(
            format_error(
                f"{name} is a {type(t).__name__}, not a torch.Tensor",
                f"{what_for} takes a uint8 tensor",
                "pass a torch.uint8 tensor",
            )
        )
    if t.dtype != torch.uint8:
        raise WeightFormatError(
            format_error(
                f"{name} has dtype {t.dtype}",
                f"{what_for} takes torch.uint8 (one E2M1 code per nibble)",
                "view or convert the tensor to torch.uint8 (t.view(torch.uint8) for int8 storage)",
            )
        )
    if t.ndim < 1:
        raise WeightFormatError(
            format_error(
                f"{name} is 0-dimensional",
                f"{what_for} works along the last dimension (K)",
                "pass a tensor with at least one dimension",
            )
        )


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [..., K] into bytes [..., K//2]: element 2j low nibble, 2j+1 high."""
    _check_uint8(codes, "codes", "pack_e2m1")
    k = codes.shape[-1]
    if k % 2 != 0:
        raise WeightFormatError(
            format_error(
                f"codes has an odd last dimension K={k}",
                "two E2M1 codes share one byte, so K must be even",
                "pad K to an even size (to a multiple of the format's group size in practice)",
            )
        )
    if codes.numel() > 0 and int(codes.max()) > 15:
        raise WeightFormatError(
            format_error(
                f"codes contains the value {int(codes.max())}",
                "an E2M1 code is 4 bits (0..15)",
                "pass codes produced by encode_e2m1, or mask with & 0xF",
            )
        )
    low = codes[..., 0::2]
    high = codes[..., 1::2]
    return low | (high << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K//2] into uint8 codes [..., K] (low nibble first)."""
    _check_uint8(packed, "packed", "unpack_e2m1")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def decode_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode packed bytes [..., K//2] to values [..., K]; exact in any float dtype."""
    codes = unpack_e2m1(packed)
    table = e2m1_values(dtype=dtype, device=packed.device)
    return table[codes.long()]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round floats to the nearest E2M1 code (uint8, one code per element, not packed).

    Rules, chosen to match the quantizers whose checkpoints we load:

    * magnitudes above 6 (and +-inf) saturate to +-6, like the hardware ``cvt.rn.satfinite``;
    * ties go to the EVEN code (round-half-to-even on the code index): 0.25 -> 0,
      0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. FORMATS.md says ModelOpt
      rounds "0.75, 1.75, 2.5 up"; that list comes from a comment in ModelOpt's
      ``NVFP4QTensor._cast_fp4``, but its code bumps the ties at ``e2m1_bounds[[1, 3, 5]]``,
      which are 0.75, 1.75 and **3.5** (2.5 is index 4 and rounds down). The executed rule is
      therefore ties-to-even, and compressed-tensors' ``cast_to_fp4`` does the same; we follow
      the code, not the comment;
    * the sign bit is set for every x < 0, so small negatives that round to zero give code 8
      (-0.0), as both producers do; -0.0 itself gives code 0.

    NaN has no E2M1 code: it raises instead of producing garbage.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise WeightFormatError(
            format_error(
                f"encode_e2m1 got {got}",
                "it rounds floating-point values",
                "pass a float16/bfloat16/float32/float64 tensor",
            )
        )
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work_dtype)
    if bool(torch.isnan(xf).any()):
        raise WeightFormatError(
            format_error(
                f"encode_e2m1 input contains {int(torch.isnan(xf).sum())} NaN value(s)",
                "NaN has no E2M1 code",
                "find where the NaN comes from (weights, scales, a zero division) and fix it",
            )
        )
    mag = xf.abs()
    bounds = torch.tensor(_MIDPOINTS, dtype=work_dtype, device=x.device)
    flat = mag.reshape(-1)
    below = torch.searchsorted(bounds, flat, right=False)  # midpoints strictly below
    below_or_at = torch.searchsorted(bounds, flat, right=True)  # midpoints at or below
    # Off a midpoint both counts agree and are the nearest code. On one, the two candidates
    # are `below` and `below + 1`: keep whichever is even.
    tie_up = (below != below_or_at) & (below % 2 == 1)
    idx = torch.where(tie_up, below_or_at, below).reshape(mag.shape).to(torch.uint8)
    sign = (xf < 0).to(torch.uint8) << 3
    return idx | sign


class PackedFp4:
    """N, K and shape of a weight held as packed E2M1 codes ``packed`` [N, K/2]."""

    packed: torch.Tensor

    @property
    def out_features(self) -> int:
        """N, the number of rows."""
        return int(self.packed.shape[0])

    @property
    def in_features(self) -> int:
        """K, the reduction dimension (two codes per byte)."""
        return int(self.packed.shape[1]) * 2

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the dense weight this represents."""
        return (self.out_features, self.in_features)

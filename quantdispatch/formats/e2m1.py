"""E2M1 (FP4) element codes: the value table, nibble packing, and round-to-nearest encoding.

Shared by NVFP4 and MXFP4. A code is 4 bits: bit 3 is the sign, bits 2..0 index the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 8 is -0.0). Two codes share a byte: the element with the even
index along K sits in the LOW nibble, the odd one in the HIGH nibble (ModelOpt,
compressed-tensors, gpt-oss and PyTorch's float4_e2m1fn_x2 all agree).
"""

from __future__ import annotations

from typing import NoReturn

import torch

from quantdispatch.errors import ConfigurationError, WeightFormatError, format_error

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


# ---------------------------------------------------------------------------------------------
# Validation helpers shared by the format modules (private: nvfp4, mxfp4 and fp8 import them).
# They live here because e2m1 is the one module every FP4 format already depends on and the
# package has no separate private module; fp8 imports them too.
# ---------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _has_values(t: torch.Tensor) -> bool:
    """False for meta tensors (shape-only: fake/meta construction skips the value checks)."""
    return t.device.type != "meta"


def _fail(what: str, rule: str, fix: str, exc: type[Exception] = WeightFormatError) -> NoReturn:
    raise exc(format_error(what, rule, fix))


def _require_tensor(value: object, field: str, dtype: torch.dtype, dtype_fix: str) -> torch.Tensor:
    """Check that a dataclass field is a tensor of exactly ``dtype``; return it."""
    if not isinstance(value, torch.Tensor):
        _fail(
            f"{field} is a {type(value).__name__}, not a torch.Tensor",
            f"{field} must be a {dtype} tensor",
            dtype_fix,
        )
    if value.dtype != dtype:
        _fail(f"{field} has dtype {value.dtype}", f"{field} must be {dtype}", dtype_fix)
    return value


def _require_ndim(t: torch.Tensor, field: str, ndim: int, layout: str) -> None:
    if t.ndim != ndim:
        _fail(
            f"{field} has shape {tuple(t.shape)} ({t.ndim}-D)",
            f"{field} must be {ndim}-D, laid out as {layout}",
            f"reshape {field} to {layout} (N = output features, K = input features)",
        )


def _require_device(t: torch.Tensor, field: str, device: torch.device, ref: str) -> None:
    if t.device != device:
        _fail(
            f"{field} is on {t.device} but {ref} is on {device}",
            "all tensors of one quantized weight must live on the same device",
            f"move them together (weight.to({str(device)!r}))",
        )


def _check_packed(
    value: object, owner: str, fmt: str, group: int, dtype_fix: str
) -> tuple[torch.Tensor, int, int]:
    """An FP4 weight's packed codes: uint8 [N, K/2], not empty, K a multiple of ``group``.
    Returns (packed, N, K)."""
    packed = _require_tensor(value, f"{owner}.packed", torch.uint8, dtype_fix)
    _require_ndim(packed, f"{owner}.packed", 2, "[N, K/2] bytes")
    n, half_k = packed.shape
    k = 2 * half_k
    if n == 0 or k == 0:
        _fail(
            f"{owner}.packed has shape {(n, half_k)}",
            f"a weight needs at least one row and one group of {group}",
            "skip empty layers",
        )
    if k % group != 0:
        _fail(
            f"{owner}.packed has shape {(n, half_k)}, so K = {k}",
            f"{fmt} needs K to be a multiple of {group}",
            f"pad K with zero columns to {-(-k // group) * group} before quantizing",
        )
    return packed, n, k


def _check_scale_grid(
    bs: torch.Tensor, owner: str, fmt: str, n: int, k: int, group: int, fixes: tuple[str, str]
) -> None:
    """An FP4 weight's block scales are [N, K/group]; ``fixes``: what to do about a wrong row
    count, a wrong group count."""
    field = f"{owner}.block_scale"
    _require_ndim(bs, field, 2, f"[N, K/{group}]")
    if bs.shape[0] != n:
        _fail(
            f"{field} has {bs.shape[0]} rows but packed has N = {n}",
            "there is one row of block scales per output feature",
            fixes[0],
        )
    if bs.shape[1] != k // group:
        scale = "e4m3" if fmt == "NVFP4" else "E8M0"
        _fail(
            f"{field} has {bs.shape[1]} groups per row but packed implies "
            f"K = {k}, i.e. {k // group} groups of {group}",
            f"{fmt} has one {scale} scale per {group} consecutive elements along K",
            fixes[1],
        )


def _positive_scalar(
    value: object,
    field: str,
    *,
    strict_dtype: bool,
    exc: type[Exception] = WeightFormatError,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Validate a per-tensor scale (multiplier): one finite value > 0. Return a 0-dim float32.

    ``strict_dtype`` (dataclass fields) requires float32 so that no precision is silently lost;
    otherwise (function arguments) Python numbers and any float tensor are accepted.
    A [1]-shaped tensor is accepted and flattened to 0-dim: checkpoints store both.
    ``device``, when given, is checked before any value is read.
    """
    if isinstance(value, torch.Tensor):
        if device is not None:
            _require_device(value, field, device, "the quantized codes")
        if strict_dtype and value.dtype != torch.float32:
            _fail(
                f"{field} has dtype {value.dtype}",
                f"{field} must be float32 (a per-tensor multiplier)",
                "convert it with .float() before building the weight, if that loses no precision",
                exc,
            )
        if not value.is_floating_point():
            _fail(
                f"{field} has dtype {value.dtype}",
                f"{field} must be a floating-point scale",
                "pass a float32 tensor or a Python float",
                exc,
            )
        if value.numel() != 1 or value.ndim > 1:
            _fail(
                f"{field} has shape {tuple(value.shape)}",
                f"{field} is one per-tensor value: shape () or (1,)",
                "pass the single per-tensor scale (fused shards: use merge_nvfp4_shards)",
                exc,
            )
        t = value.detach().reshape(()).to(torch.float32)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and not strict_dtype:
        t = torch.tensor(float(value), dtype=torch.float32)
    else:
        _fail(
            f"{field} is a {type(value).__name__}",
            f"{field} must be a float32 tensor" + ("" if strict_dtype else " or a Python float"),
            "pass torch.tensor(value, dtype=torch.float32)",
            exc,
        )
    if not _has_values(t):
        return t
    v = float(t)
    if not (v > 0.0 and v != float("inf")):
        _fail(
            f"{field} is {v!r}",
            f"{field} is a multiplier (W = codes * block_scale * {field}): finite and > 0",
            "recompute it from the tensor's amax (a reciprocal checkpoint convention needs "
            "global_scale_from_compressed_tensors)",
            exc,
        )
    return t


def _check_rows(rows: object, n: int, fn: str) -> slice:
    """Validate the ``rows`` argument of a dequantize function; return a usable slice."""
    if rows is None:
        return slice(0, n)
    if not isinstance(rows, slice):
        _fail(
            f"{fn} got rows={rows!r} ({type(rows).__name__})",
            "rows must be a slice over the output features (N)",
            "pass e.g. rows=slice(0, 1024), or None for every row",
            ConfigurationError,
        )
    if rows.step is not None and rows.step <= 0:
        _fail(
            f"{fn} got rows with step {rows.step}",
            "rows must select rows in increasing order (step >= 1)",
            "use a positive step, and flip the result if you need reversed rows",
            ConfigurationError,
        )
    return rows


def _compute_dtype(dtype: object, fn: str) -> torch.dtype:
    """Dequantize in float32, or float64 when asked for float64."""
    if dtype not in _FLOAT_DTYPES:
        _fail(
            f"{fn} got dtype={dtype!r}",
            "the output dtype must be one of float16, bfloat16, float32, float64",
            "pass e.g. dtype=torch.bfloat16",
            ConfigurationError,
        )
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dequantize_args(
    w: object, cls: type, fn: str, dtype: object, rows: object
) -> tuple[torch.dtype, slice]:
    """What every reference dequantizer checks first: ``w`` is a ``cls``, the output dtype is a
    float dtype, ``rows`` a slice. Returns (compute dtype, rows slice)."""
    if not isinstance(w, cls):
        _fail(
            f"{fn} got a {type(w).__name__}",
            f"it dequantizes an {cls.__name__}",
            f"build one with {cls.__name__}(...) or {fn.replace('dequantize_', 'quantize_')}(...)",
            ConfigurationError,
        )
    return _compute_dtype(dtype, fn), _check_rows(rows, w.out_features, fn)  # type: ignore[attr-defined]


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


def _check_float_matrix(weight: object, fn: str, group: int, group_name: str) -> torch.Tensor:
    """Check a quantizer input: finite float [N, K] with K a multiple of ``group``."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        _fail(
            f"{fn} got a weight of type {got}",
            "the weight to quantize must be a floating-point tensor",
            "pass the float16/bfloat16/float32 weight of the Linear layer",
        )
    if weight.ndim != 2:
        _fail(
            f"{fn} got a weight of shape {tuple(weight.shape)}",
            "the weight must be 2-D [N, K] (N = output features, K = input features)",
            "quantize each 2-D matrix (each expert of a MoE) separately",
        )
    n, k = weight.shape
    if n == 0 or k == 0:
        _fail(
            f"{fn} got an empty weight of shape {(n, k)}",
            "there must be at least one row and one group",
            "skip empty layers instead of quantizing them",
        )
    if k % group != 0:
        _fail(
            f"{fn} got K={k} input features",
            f"{group_name} needs K to be a multiple of the group size {group}",
            f"pad K with zero columns to {(-(-k // group)) * group} (and the activations to match)",
        )
    if not bool(torch.isfinite(weight).all()):
        bad = int((~torch.isfinite(weight)).sum())
        _fail(
            f"{fn} got a weight with {bad} NaN/inf value(s)",
            "only finite weights can be quantized",
            "fix the checkpoint or the training run that produced them",
        )
    return weight


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)

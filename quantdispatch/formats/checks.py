"""Validation shared by the format modules (nvfp4, mxfp4, fp8 and the E2M1 helpers): each
check raises the package's error with what was wrong, the rule and the fix. Internal to
``quantdispatch.formats``; the modules call ``checks.<name>``.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from quantdispatch.errors import ConfigurationError, WeightFormatError, format_error
from quantdispatch.format_facts import FP4_GROUP_SIZES

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def has_values(t: torch.Tensor) -> bool:
    """False for meta tensors (shape-only: fake/meta construction skips the value checks)."""
    return t.device.type != "meta"


def fail(what: str, rule: str, fix: str, exc: type[Exception] = WeightFormatError) -> NoReturn:
    raise exc(format_error(what, rule, fix))


def require_tensor(value: object, field: str, dtype: torch.dtype, dtype_fix: str) -> torch.Tensor:
    """Check that a dataclass field is a tensor of exactly ``dtype``; return it."""
    if not isinstance(value, torch.Tensor):
        fail(
            f"{field} is a {type(value).__name__}, not a torch.Tensor",
            f"{field} must be a {dtype} tensor",
            dtype_fix,
        )
    if value.dtype != dtype:
        fail(f"{field} has dtype {value.dtype}", f"{field} must be {dtype}", dtype_fix)
    return value


def require_ndim(t: torch.Tensor, field: str, ndim: int, layout: str) -> None:
    if t.ndim != ndim:
        fail(
            f"{field} has shape {tuple(t.shape)} ({t.ndim}-D)",
            f"{field} must be {ndim}-D, laid out as {layout}",
            f"reshape {field} to {layout} (N = output features, K = input features)",
        )


def require_device(t: torch.Tensor, field: str, device: torch.device, ref: str) -> None:
    if t.device != device:
        fail(
            f"{field} is on {t.device} but {ref} is on {device}",
            "all tensors of one quantized weight must live on the same device",
            f"move them together (weight.to({str(device)!r}))",
        )


def _fp4(fmt: str) -> tuple[str, str, int]:
    """(container name, display name, group size) of FP4 format ``fmt``."""
    return f"{fmt.capitalize()}Weight", fmt.upper(), FP4_GROUP_SIZES[fmt]


def check_packed(value: object, fmt: str, dtype_fix: str) -> tuple[torch.Tensor, int, int]:
    """The packed codes of an ``fmt`` weight: uint8 [N, K/2], not empty, K a whole number of
    scale groups. Returns (packed, N, K)."""
    owner, label, group = _fp4(fmt)
    packed = require_tensor(value, f"{owner}.packed", torch.uint8, dtype_fix)
    require_ndim(packed, f"{owner}.packed", 2, "[N, K/2] bytes")
    n, half_k = packed.shape
    k = 2 * half_k
    if n == 0 or k == 0:
        fail(
            f"{owner}.packed has shape {(n, half_k)}",
            f"a weight needs at least one row and one group of {group}",
            "skip empty layers",
        )
    if k % group != 0:
        fail(
            f"{owner}.packed has shape {(n, half_k)}, so K = {k}",
            f"{label} needs K to be a multiple of {group}",
            f"pad K with zero columns to {-(-k // group) * group} before quantizing",
        )
    return packed, n, k


def check_scale_grid(bs: torch.Tensor, fmt: str, n: int, k: int, fixes: tuple[str, str]) -> None:
    """The block scales of an ``fmt`` weight are [N, K/group]; ``fixes``: what to do about a
    wrong row count, a wrong group count."""
    owner, label, group = _fp4(fmt)
    field = f"{owner}.block_scale"
    require_ndim(bs, field, 2, f"[N, K/{group}]")
    if bs.shape[0] != n:
        fail(
            f"{field} has {bs.shape[0]} rows but packed has N = {n}",
            "there is one row of block scales per output feature",
            fixes[0],
        )
    if bs.shape[1] != k // group:
        scale = "e4m3" if fmt == "nvfp4" else "E8M0"
        fail(
            f"{field} has {bs.shape[1]} groups per row but packed implies "
            f"K = {k}, i.e. {k // group} groups of {group}",
            f"{label} has one {scale} scale per {group} consecutive elements along K",
            fixes[1],
        )


def positive_scalar(
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
            require_device(value, field, device, "the quantized codes")
        if strict_dtype and value.dtype != torch.float32:
            fail(
                f"{field} has dtype {value.dtype}",
                f"{field} must be float32 (a per-tensor multiplier)",
                "convert it with .float() before building the weight, if that loses no precision",
                exc,
            )
        if not value.is_floating_point():
            fail(
                f"{field} has dtype {value.dtype}",
                f"{field} must be a floating-point scale",
                "pass a float32 tensor or a Python float",
                exc,
            )
        if value.numel() != 1 or value.ndim > 1:
            fail(
                f"{field} has shape {tuple(value.shape)}",
                f"{field} is one per-tensor value: shape () or (1,)",
                "pass the single per-tensor scale (fused shards: use merge_nvfp4_shards)",
                exc,
            )
        t = value.detach().reshape(()).to(torch.float32)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and not strict_dtype:
        t = torch.tensor(float(value), dtype=torch.float32)
    else:
        fail(
            f"{field} is a {type(value).__name__}",
            f"{field} must be a float32 tensor" + ("" if strict_dtype else " or a Python float"),
            "pass torch.tensor(value, dtype=torch.float32)",
            exc,
        )
    if not has_values(t):
        return t
    v = float(t)
    if not (v > 0.0 and v != float("inf")):
        fail(
            f"{field} is {v!r}",
            f"{field} is a multiplier (W = codes * block_scale * {field}): finite and > 0",
            "recompute it from the tensor's amax (a reciprocal checkpoint convention needs "
            "global_scale_from_compressed_tensors)",
            exc,
        )
    return t


def check_rows(rows: object, n: int, fn: str) -> slice:
    """Validate the ``rows`` argument of a dequantize function; return a usable slice."""
    if rows is None:
        return slice(0, n)
    if not isinstance(rows, slice):
        fail(
            f"{fn} got rows={rows!r} ({type(rows).__name__})",
            "rows must be a slice over the output features (N)",
            "pass e.g. rows=slice(0, 1024), or None for every row",
            ConfigurationError,
        )
    if rows.step is not None and rows.step <= 0:
        fail(
            f"{fn} got rows with step {rows.step}",
            "rows must select rows in increasing order (step >= 1)",
            "use a positive step, and flip the result if you need reversed rows",
            ConfigurationError,
        )
    return rows


def compute_dtype(dtype: object, fn: str) -> torch.dtype:
    """Dequantize in float32, or float64 when asked for float64."""
    if dtype not in _FLOAT_DTYPES:
        fail(
            f"{fn} got dtype={dtype!r}",
            "the output dtype must be one of float16, bfloat16, float32, float64",
            "pass e.g. dtype=torch.bfloat16",
            ConfigurationError,
        )
    return torch.float64 if dtype == torch.float64 else torch.float32


def dequantize_args(
    w: object, cls: type, fn: str, dtype: object, rows: object
) -> tuple[torch.dtype, slice]:
    """What every reference dequantizer checks first: ``w`` is a ``cls``, the output dtype is a
    float dtype, ``rows`` a slice. Returns (compute dtype, rows slice)."""
    if not isinstance(w, cls):
        fail(
            f"{fn} got a {type(w).__name__}",
            f"it dequantizes an {cls.__name__}",
            f"build one with {cls.__name__}(...) or {fn.replace('dequantize_', 'quantize_')}(...)",
            ConfigurationError,
        )
    return compute_dtype(dtype, fn), check_rows(rows, w.out_features, fn)  # type: ignore[attr-defined]


def check_float_matrix(weight: object, fn: str, group: int, group_name: str) -> torch.Tensor:
    """Check a quantizer input: finite float [N, K] with K a multiple of ``group``."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        fail(
            f"{fn} got a weight of type {got}",
            "the weight to quantize must be a floating-point tensor",
            "pass the float16/bfloat16/float32 weight of the Linear layer",
        )
    if weight.ndim != 2:
        fail(
            f"{fn} got a weight of shape {tuple(weight.shape)}",
            "the weight must be 2-D [N, K] (N = output features, K = input features)",
            "quantize each 2-D matrix (each expert of a MoE) separately",
        )
    n, k = weight.shape
    if n == 0 or k == 0:
        fail(
            f"{fn} got an empty weight of shape {(n, k)}",
            "there must be at least one row and one group",
            "skip empty layers instead of quantizing them",
        )
    if k % group != 0:
        fail(
            f"{fn} got K={k} input features",
            f"{group_name} needs K to be a multiple of the group size {group}",
            f"pad K with zero columns to {(-(-k // group)) * group} (and the activations to match)",
        )
    if not bool(torch.isfinite(weight).all()):
        bad = int((~torch.isfinite(weight)).sum())
        fail(
            f"{fn} got a weight with {bad} NaN/inf value(s)",
            "only finite weights can be quantized",
            "fix the checkpoint or the training run that produced them",
        )
    return weight


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)

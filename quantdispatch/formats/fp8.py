"""FP8 E4M3 weights with per-tensor, per-channel, or 2-D block (DeepSeek-style) scales.

    W[n, k] = float(weight[n, k]) * scale            (tensor:  scale shape ())
    W[n, k] = float(weight[n, k]) * scale[n]         (channel: scale shape (N,))
    W[n, k] = float(weight[n, k]) * scale[n // bn, k // bk]
                                                     (block:   (ceil(N/bn), ceil(K/bk)))

All scales are multipliers in float32. ``input_scale`` is a static per-tensor activation scale
(W8A8 checkpoints); dynamic per-token activation scales are computed by kernels, not stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from quantdispatch.errors import ConfigurationError, WeightFormatError
from quantdispatch.formats import checks

__all__ = [
    "E4M3_MAX",
    "FP8_SCALE_KINDS",
    "Fp8Weight",
    "dequantize_fp8",
    "quantize_fp8",
]

E4M3_MAX = 448.0
FP8_SCALE_KINDS = ("tensor", "channel", "block")

ScaleKind = Literal["tensor", "channel", "block"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_block_size(block_size: object, field: str, exc: type[Exception]) -> tuple[int, int]:
    ok = (
        isinstance(block_size, (tuple, list))
        and len(block_size) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block_size)
    )
    if not ok:
        checks.fail(
            f"{field} is {block_size!r}",
            f"{field} is (rows per block along N, columns per block along K), two positive ints",
            "pass e.g. (128, 128), the DeepSeek-V3 weight_block_size",
            exc,
        )
    return (int(block_size[0]), int(block_size[1]))  # type: ignore[index]


_SHAPES_RULE = (
    "the scale is () per-tensor, (N,) or (N, 1) per-channel, or "
    "(ceil(N/bn), ceil(K/bk)) per-block with block_size=(bn, bk)"
)


def _checked_weight(weight: object) -> torch.Tensor:
    """The e4m3fn [N, K] weight: non-empty, no NaN codes."""
    w = checks.require_tensor(
        weight,
        "Fp8Weight.weight",
        torch.float8_e4m3fn,
        "pass the weight as torch.float8_e4m3fn [N, K] (a uint8 copy of the bytes needs "
        ".view(torch.float8_e4m3fn); e4m3fnuz checkpoints need converting first)",
    )
    checks.require_ndim(w, "Fp8Weight.weight", 2, "[N, K]")
    n, k = w.shape
    if n == 0 or k == 0:
        checks.fail(
            f"Fp8Weight.weight has shape {(n, k)}",
            "a weight needs at least one row and one column",
            "skip empty layers",
        )
    nan = (w.view(torch.uint8) & 0x7F) == 0x7F
    if checks.has_values(w) and bool(nan.any()):
        first = tuple(nan.nonzero()[0].tolist())
        checks.fail(
            f"Fp8Weight.weight contains {int(nan.sum())} NaN value(s) (first at {first})",
            "weights must be finite (e4m3fn has NaN but no inf)",
            "re-export the checkpoint; quantize with a saturating cast (quantize_fp8 does)",
        )
    return w


def _check_block_scale(scale: torch.Tensor, n: int, k: int, bn: int, bk: int) -> None:
    expected = (_cdiv(n, bn), _cdiv(k, bk))
    if tuple(scale.shape) != expected:
        checks.fail(
            f"Fp8Weight.scale has shape {tuple(scale.shape)} but weight {(n, k)} with "
            f"block_size {(bn, bk)} needs {expected}",
            _SHAPES_RULE,
            "check block_size against the checkpoint's weight_block_size, and that "
            "the scale belongs to this weight (TP shard)",
        )


def _tensor_or_channel_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A scale without block_size as stored: () per-tensor or (N,) per-channel."""
    if scale.ndim == 0 or (scale.ndim == 1 and scale.shape[0] == n):
        return scale  # per-tensor or per-channel as given
    if scale.ndim == 2 and tuple(scale.shape) == (n, 1):
        return scale.reshape(n)
    if scale.numel() == 1 and scale.ndim <= 2:
        return scale.reshape(())
    if scale.ndim == 2:
        checks.fail(
            f"Fp8Weight.scale has 2-D shape {tuple(scale.shape)} but block_size is None",
            _SHAPES_RULE,
            "pass block_size=(bn, bk) for block scales (DeepSeek-style: (128, 128))",
        )
    checks.fail(
        f"Fp8Weight.scale has shape {tuple(scale.shape)} for a weight of N = {n} rows",
        _SHAPES_RULE,
        "pass the scale that belongs to this weight (same TP shard) and check its layout",
    )


def _check_scale_values(scale: torch.Tensor) -> None:
    """Finite, non-negative, and a per-tensor scale above zero."""
    if not checks.has_values(scale):
        return
    if not bool(torch.isfinite(scale).all()):
        bad = int((~torch.isfinite(scale)).sum())
        checks.fail(
            f"Fp8Weight.scale contains {bad} NaN/inf value(s)",
            "scales are finite multipliers",
            "re-export the checkpoint",
        )
    if bool((scale < 0).any()):
        checks.fail(
            f"Fp8Weight.scale contains negative values (min {float(scale.min())})",
            "scales are magnitudes: >= 0",
            "re-quantize the weight; a negative scale means the producer is broken",
        )
    if scale.ndim == 0 and float(scale) == 0.0:
        checks.fail(
            "Fp8Weight.scale is 0.0 (per-tensor)",
            "a per-tensor scale must be > 0, or the whole layer is zero",
            "recompute it as amax / 448",
        )


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """A validated FP8 E4M3 weight [N, K] with its scale(s).

    Accepted scale shapes: () per-tensor (a [1] tensor is flattened to it), (N,) or (N, 1)
    per-channel (stored as (N,)), and (ceil(N/bn), ceil(K/bk)) with ``block_size=(bn, bk)``.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        w = _checked_weight(self.weight)
        n, k = w.shape
        scale = checks.require_tensor(
            self.scale,
            "Fp8Weight.scale",
            torch.float32,
            "convert the scale with .float() (checkpoints store float32, sometimes bf16)",
        )
        checks.require_device(scale, "Fp8Weight.scale", w.device, "weight")
        if self.block_size is not None:
            bn, bk = _check_block_size(self.block_size, "Fp8Weight.block_size", WeightFormatError)
            object.__setattr__(self, "block_size", (bn, bk))
            _check_block_scale(scale, n, k, bn, bk)
        else:
            scale = _tensor_or_channel_scale(scale, n)
        _check_scale_values(scale)
        object.__setattr__(self, "scale", scale)

        if self.input_scale is not None:
            s = checks.positive_scalar(
                self.input_scale, "Fp8Weight.input_scale", strict_dtype=True, device=w.device
            )
            object.__setattr__(self, "input_scale", s.to(w.device))

    @property
    def scale_kind(self) -> ScaleKind:
        """Which of the three scale layouts this weight uses."""
        if self.block_size is not None:
            return "block"
        return "tensor" if self.scale.ndim == 0 else "channel"

    @property
    def out_features(self) -> int:
        """N, the number of rows."""
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        """K, the reduction dimension."""
        return int(self.weight.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K)."""
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        """Bytes held by all tensors."""
        return checks.nbytes(self.weight, self.scale, self.input_scale)

    def to(self, device: torch.device | str) -> Fp8Weight:
        """Move every tensor to ``device``."""
        return Fp8Weight(
            weight=self.weight.to(device),
            scale=self.scale.to(device),
            block_size=self.block_size,
            input_scale=None if self.input_scale is None else self.input_scale.to(device),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (input_scale only when present)."""
        out = {"weight": self.weight, "scale": self.scale}
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        return out


def _amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448; all-zero groups get 1.0 and tiny ones stay normal float32 (> 0)."""
    s = amax / E4M3_MAX
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return s.clamp(min=torch.finfo(torch.float32).tiny)


def _expand_block_scale(
    scale: torch.Tensor, row_idx: torch.Tensor, k: int, block_size: tuple[int, int]
) -> torch.Tensor:
    """Per-element scales [len(row_idx), K] for the selected rows of a block-scaled weight."""
    bn, bk = block_size
    per_row = scale[row_idx // bn]  # [n, ceil(K/bk)]
    return per_row.repeat_interleave(bk, dim=1)[:, :k]


def quantize_fp8(
    weight: torch.Tensor,
    *,
    kind: ScaleKind = "tensor",
    block_size: tuple[int, int] = (128, 128),
) -> Fp8Weight:
    """Quantize a float [N, K] weight to E4M3 with scale = amax / 448 per tensor/row/block.

    The cast saturates (|W / scale| is clamped to 448 first) and rounds to nearest even, so the
    per-element error is at most half an e4m3 step: <= 2**-4 * |W| for |W / scale| >= 2**-6,
    and <= 2**-10 * scale below. Edge blocks of a block-scaled weight may be partial.
    """
    if kind not in FP8_SCALE_KINDS:
        checks.fail(
            f"quantize_fp8 got kind={kind!r}",
            f"kind must be one of {', '.join(FP8_SCALE_KINDS)}",
            'pass kind="tensor" (W8A8 per-tensor), "channel" or "block"',
            ConfigurationError,
        )
    w = checks.check_float_matrix(weight, "quantize_fp8", 1, "FP8")
    n, k = w.shape
    wf = w.detach().to(torch.float32)
    bs: tuple[int, int] | None = None
    if kind == "tensor":
        scale = _amax_to_scale(wf.abs().amax())
        full = scale
    elif kind == "channel":
        scale = _amax_to_scale(wf.abs().amax(dim=1))
        full = scale.unsqueeze(1)
    else:
        bs = _check_block_size(block_size, "block_size", ConfigurationError)
        bn, bk = bs
        nb, kb = _cdiv(n, bn), _cdiv(k, bk)
        padded = torch.nn.functional.pad(wf.abs(), (0, kb * bk - k, 0, nb * bn - n))
        scale = _amax_to_scale(padded.reshape(nb, bn, kb, bk).amax(dim=(1, 3)))
        full = _expand_block_scale(scale, torch.arange(n, device=w.device), k, bs)
    q = (wf / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(weight=q, scale=scale, block_size=bs)


def dequantize_fp8(
    w: Fp8Weight, *, dtype: torch.dtype = torch.float32, rows: slice | None = None
) -> torch.Tensor:
    """Reference dequantization of ``rows`` (all by default) to a dense [n_rows, K] tensor.

    One float32 multiply (e4m3 * scale) per element, so the result is correctly rounded before
    the final cast; float64 when asked. ``rows`` works with every scale layout.
    """
    cd, sl = checks.dequantize_args(w, Fp8Weight, "dequantize_fp8", dtype, rows)
    q = w.weight[sl].to(cd)
    if w.block_size is not None:
        row_idx = torch.arange(w.out_features, device=w.weight.device)[sl]
        out = q * _expand_block_scale(w.scale, row_idx, w.in_features, w.block_size).to(cd)
    elif w.scale.ndim == 0:
        out = q * w.scale.to(cd)
    else:
        out = q * w.scale[sl].to(cd).unsqueeze(1)
    return out.to(dtype)

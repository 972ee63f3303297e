"""Quantized weight formats: containers, reference quantizers and float dequantizers.

Pure torch and import-cheap. ``FORMATS`` is the one registry of format names; everything that
accepts a format name (policy files, settings, the CLI) should validate against it through
:func:`get_format`, so the list of valid names lives in exactly one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.formats.e2m1 import (
    E2M1_MAX,
    decode_e2m1,
    e2m1_values,
    encode_e2m1,
    pack_e2m1,
    unpack_e2m1,
)
from quantdispatch.formats.fp8 import (
    FP8_SCALE_KINDS,
    Fp8Weight,
    dequantize_fp8,
    quantize_fp8,
)
from quantdispatch.formats.mxfp4 import (
    MXFP4_GROUP_SIZE,
    Mxfp4Weight,
    dequantize_mxfp4,
    e8m0_to_float,
    quantize_mxfp4,
)
from quantdispatch.formats.nvfp4 import (
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    NVFP4_GROUP_SIZE,
    Nvfp4Weight,
    dequantize_nvfp4,
    fake_quantize_nvfp4_activations,
    global_scale_from_compressed_tensors,
    global_scale_to_compressed_tensors,
    merge_nvfp4_shards,
    quantize_nvfp4,
)

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "FORMATS",
    "FP8_SCALE_KINDS",
    "MXFP4_GROUP_SIZE",
    "NVFP4_GROUP_SIZE",
    "FormatSpec",
    "Fp8Weight",
    "Mxfp4Weight",
    "Nvfp4Weight",
    "decode_e2m1",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "e2m1_values",
    "e8m0_to_float",
    "encode_e2m1",
    "fake_quantize_nvfp4_activations",
    "get_format",
    "global_scale_from_compressed_tensors",
    "global_scale_to_compressed_tensors",
    "merge_nvfp4_shards",
    "pack_e2m1",
    "quantize_fp8",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "unpack_e2m1",
]


@dataclass(frozen=True)
class FormatSpec:
    """Static facts about one weight format.

    ``group_size`` is the number of elements sharing a scale along K (None for FP8, whose
    scale layout is chosen per checkpoint). ``default_scheme`` is what a checkpoint of this
    format usually means when it does not say: "weight_act" (quantized activations too) or
    "weight_only". ``bits_per_weight`` is the effective storage in BYTES per parameter,
    scales included (the name is kept for the contract): NVFP4 0.5 + 1/16, MXFP4 0.5 + 1/32,
    FP8 1 (per-tensor/channel scales are negligible).
    """

    name: str
    description: str
    group_size: int | None
    weight_type: type
    default_scheme: Literal["weight_act", "weight_only"]
    bits_per_weight: float
    dequantize: Callable[..., torch.Tensor]


FORMATS: dict[str, FormatSpec] = {
    "nvfp4": FormatSpec(
        name="nvfp4",
        description="NVIDIA FP4: E2M1 codes, e4m3 scale per 16 along K, fp32 per-tensor scale",
        group_size=NVFP4_GROUP_SIZE,
        weight_type=Nvfp4Weight,
        default_scheme="weight_act",
        bits_per_weight=0.5 + 1 / NVFP4_GROUP_SIZE,
        dequantize=dequantize_nvfp4,
    ),
    "mxfp4": FormatSpec(
        name="mxfp4",
        description="OCP MXFP4: E2M1 codes, E8M0 power-of-two scale per 32 along K",
        group_size=MXFP4_GROUP_SIZE,
        weight_type=Mxfp4Weight,
        default_scheme="weight_only",
        bits_per_weight=0.5 + 1 / MXFP4_GROUP_SIZE,
        dequantize=dequantize_mxfp4,
    ),
    "fp8": FormatSpec(
        name="fp8",
        description="FP8 E4M3 with per-tensor, per-channel or 2-D block scales",
        group_size=None,
        weight_type=Fp8Weight,
        default_scheme="weight_act",
        bits_per_weight=1.0,
        dequantize=dequantize_fp8,
    ),
}


def get_format(name: str) -> FormatSpec:
    """Look a format up by name, case-insensitively; unknown names list the valid ones."""
    if isinstance(name, str):
        spec = FORMATS.get(name.strip().lower())
        if spec is not None:
            return spec
    raise ConfigurationError(
        format_error(
            f"unknown format {name!r}",
            f"valid formats are: {', '.join(sorted(FORMATS))}",
            "use one of those names (case does not matter)",
        )
    )

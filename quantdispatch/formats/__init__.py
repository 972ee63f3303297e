"""Quantized weight formats: containers, reference quantizers and float dequantizers.

Pure torch and import-cheap. ``FORMATS`` is the one registry of format names: the facts of
:mod:`quantdispatch.format_facts` (group size, element width, scale type) with each format's
container and dequantizer. Everything that accepts a format name (policy files, settings, the
CLI) validates against it through :func:`get_format`; a module that needs a fact reads it from
here (:data:`FP4_FORMATS`, :data:`FP4_GROUP_SIZES`, :data:`SCALE_GROUP_SIZES`) instead of
restating it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.format_facts import (
    FACTS,
    FP4_FORMATS,
    FP4_GROUP_SIZES,
    SCALE_GROUP_SIZES,
    FormatFacts,
)
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
    "FP4_FORMATS",
    "FP4_GROUP_SIZES",
    "FP8_SCALE_KINDS",
    "MXFP4_GROUP_SIZE",
    "NVFP4_GROUP_SIZE",
    "SCALE_GROUP_SIZES",
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
class FormatSpec(FormatFacts):
    """One weight format: its facts (:class:`~quantdispatch.format_facts.FormatFacts`), its
    container type and its float dequantizer."""

    weight_type: type
    dequantize: Callable[..., torch.Tensor]


_CODE = {"nvfp4": (Nvfp4Weight, dequantize_nvfp4), "mxfp4": (Mxfp4Weight, dequantize_mxfp4)}
_CODE["fp8"] = (Fp8Weight, dequantize_fp8)

#: Every format by name: the facts table with each format's container and dequantizer.
FORMATS: dict[str, FormatSpec] = {
    name: FormatSpec(**vars(facts), weight_type=_CODE[name][0], dequantize=_CODE[name][1])
    for name, facts in FACTS.items()
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

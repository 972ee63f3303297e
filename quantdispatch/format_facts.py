"""The static facts of each weight format, in one table that imports nothing (the regime table
and the parsers read it without torch). ``quantdispatch.formats.FORMATS`` adds each format's
container and dequantizer to these facts; every other module reads a fact from here or from
there instead of restating it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

_Scheme = Literal["weight_act", "weight_only"]

__all__ = [
    "FACTS",
    "FP4_FORMATS",
    "FP4_GROUP_SIZES",
    "SCALE_GROUP_SIZES",
    "FormatFacts",
]


@dataclass(frozen=True)
class FormatFacts:
    """Static facts about one weight format.

    ``group_size`` is the number of elements sharing a scale along K (None for FP8, whose
    scale layout is chosen per checkpoint). ``default_scheme`` is what a checkpoint of this
    format usually means when it does not say: "weight_act" (quantized activations too) or
    "weight_only". ``bits_per_weight`` is the effective storage in BYTES per parameter,
    scales included (the name is kept for the contract): NVFP4 0.5 + 1/16, MXFP4 0.5 + 1/32,
    FP8 1 (per-tensor/channel scales are negligible). ``element_bits``: the width of one
    weight code (4: E2M1, two to a byte; 8: E4M3). ``scale_format``: the type of the per-group
    scale ("e4m3", "e8m0"; None for FP8's fp32 scales).
    """

    name: str
    description: str
    group_size: int | None
    default_scheme: _Scheme
    bits_per_weight: float
    element_bits: int
    scale_format: str | None


def _fp4(name: str, description: str, group: int, scheme: _Scheme, scale: str) -> FormatFacts:
    return FormatFacts(name, description, group, scheme, 0.5 + 1 / group, 4, scale)


#: Every format by name.
FACTS: dict[str, FormatFacts] = {
    "nvfp4": _fp4(
        "nvfp4",
        "NVIDIA FP4: E2M1 codes, e4m3 scale per 16 along K, fp32 per-tensor scale",
        16,
        "weight_act",
        "e4m3",
    ),
    "mxfp4": _fp4(
        "mxfp4",
        "OCP MXFP4: E2M1 codes, E8M0 power-of-two scale per 32 along K",
        32,
        "weight_only",
        "e8m0",
    ),
    "fp8": FormatFacts(
        "fp8",
        "FP8 E4M3 with per-tensor, per-channel or 2-D block scales",
        None,
        "weight_act",
        1.0,
        8,
        None,
    ),
}

#: The E2M1 formats, in table order: ("nvfp4", "mxfp4").
FP4_FORMATS: tuple[str, ...] = tuple(n for n, f in FACTS.items() if f.element_bits == 4)

#: Elements along K per scale group of each FP4 format.
FP4_GROUP_SIZES: dict[str, int] = {n: FACTS[n].group_size or 0 for n in FP4_FORMATS}

#: Elements along K per scale of each group-scale type ("e4m3": 16, "e8m0": 32).
SCALE_GROUP_SIZES: dict[str, int] = {
    f.scale_format: f.group_size for f in FACTS.values() if f.scale_format and f.group_size
}

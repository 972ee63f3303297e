"""Compute-capability facts as explicit sets, never a bare ``>= 100``.

"Blackwell" is not one target: kernels built for sm100a do not run on sm120 (RTX 50xx, RTX PRO
6000, DGX Spark GB10), and a check like ``capability >= 100`` sends those GPUs to the wrong
kernels. Peers have shipped exactly that bug; these sets keep the two families apart.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FP8_MMA",
    "SM100_FAMILY",
    "SM120_FAMILY",
    "CapabilitySet",
    "fmt_sm",
]


def fmt_sm(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


@dataclass(frozen=True)
class CapabilitySet:
    """A named set of compute capabilities, e.g. the sm100 family."""

    name: str
    members: frozenset[tuple[int, int]]

    def __contains__(self, cc: object) -> bool:
        return cc in self.members

    def describe(self) -> str:
        return f"{self.name} ({', '.join(fmt_sm(c) for c in sorted(self.members))})"


#: Datacenter Blackwell and Thor: B200/GB200 (10.0), B300/GB300 (10.3), Jetson Thor (11.0,
#: reported as 10.1 before CUDA 13).
SM100_FAMILY = CapabilitySet("sm100 family", frozenset({(10, 0), (10, 1), (10, 3), (11, 0)}))

#: Consumer / workstation Blackwell: RTX 50xx and RTX PRO 6000 (12.0), DGX Spark GB10 (12.1).
SM120_FAMILY = CapabilitySet("sm120 family", frozenset({(12, 0), (12, 1)}))

#: GPUs with FP8 (e4m3) tensor-core MMA: Ada (8.9), Hopper (9.0) and every Blackwell.
FP8_MMA = CapabilitySet(
    "FP8 tensor cores",
    frozenset({(8, 9), (9, 0)}) | SM100_FAMILY.members | SM120_FAMILY.members,
)

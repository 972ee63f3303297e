"""Compute-capability facts as named sets, never a bare ``>= (10, 0)``.

"Blackwell" is not one target: kernels built for sm100a do not run on sm120 (RTX 50xx, RTX PRO
6000, DGX Spark GB10), and a check like ``capability >= 100`` sends those GPUs to the wrong
kernels. Peers have shipped exactly that bug; these sets keep the two families apart. Every
capability test in the package is ``cc in SOME_SET`` with a set from here (the unit test
``test_capability_sets`` refuses bare tuple comparisons elsewhere); ``None`` (a CPU) is in no
set but :data:`ANY_DEVICE`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ANY_DEVICE",
    "CUTLASS_NVFP4",
    "CUTLASS_NVFP4_UNVERIFIED",
    "FP4_MMA",
    "FP8_MMA",
    "SM9X",
    "SM80_PLUS",
    "SM89_PLUS",
    "SM90",
    "SM90_PLUS",
    "SM100_FAMILY",
    "SM120_FAMILY",
    "TORCH_NVFP4_MIN_CUDA",
    "TORCH_NVFP4_MIN_TORCH",
    "TORCH_NVFP4_UNVERIFIED",
    "TORCH_NVFP4_VERIFIED",
    "CapabilitySet",
    "fmt_sm",
]


def fmt_sm(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


@dataclass(frozen=True)
class CapabilitySet:
    """A named set of compute capabilities: listed ``members``, every capability from
    ``at_least`` on (later GPUs included), the whole ``majors`` generations, and with
    ``any_device`` everything, a CPU (None) too."""

    name: str
    members: frozenset[tuple[int, int]] = frozenset()
    at_least: tuple[int, int] | None = None
    majors: frozenset[int] = frozenset()
    any_device: bool = False

    def __contains__(self, cc: object) -> bool:
        if self.any_device:
            return True
        if not isinstance(cc, (tuple, list)) or len(cc) != 2:
            return False
        cc = (cc[0], cc[1])
        return (
            cc in self.members
            or cc[0] in self.majors
            or (self.at_least is not None and cc >= self.at_least)
        )

    def describe(self) -> str:
        if self.any_device:
            return self.name
        parts = [fmt_sm(c) for c in sorted(self.members)]
        parts += [f"{m}.x" for m in sorted(self.majors)]
        parts += [] if self.at_least is None else [f"{fmt_sm(self.at_least)}+"]
        return f"{self.name} ({', '.join(parts)})"


#: Every device, the CPU included (regime rows that apply wherever their layout runs).
ANY_DEVICE = CapabilitySet("any", any_device=True)
#: Turing on: fp16 tensor cores (the weight-only kernels' floor with fp16 activations).
SM75_PLUS = CapabilitySet("SM 7.5+", at_least=(7, 5))

#: Ampere on: bf16 tensor cores, bf16 mma.sync, 16-bit ``cp.async``.
SM80_PLUS = CapabilitySet("SM 8.0+", at_least=(8, 0))

#: Ada on: the FP8 conversion instruction and FP8 tensor cores (torch._scaled_mm's own check).
SM89_PLUS = CapabilitySet("SM 8.9+", at_least=(8, 9))

#: Hopper on: TMA descriptors, torch._grouped_mm, programmatic dependent launches.
SM90_PLUS = CapabilitySet("SM 9.0+", at_least=(9, 0))

#: The wgmma generation (Hopper).
SM9X = CapabilitySet("SM 9.x", majors=frozenset({9}))

#: H100 / H200: torch's block-scaled FP8 GEMMs.
SM90 = CapabilitySet("SM 9.0", frozenset({(9, 0)}))


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

#: GPUs with FP4 (e2m1) block-scaled tensor-core MMA: both Blackwell families. Their kernels are
#: separate builds (tcgen05 on the sm100 family, mma.sync block-scaled on the sm120 family).
FP4_MMA = CapabilitySet("FP4 tensor cores", SM100_FAMILY.members | SM120_FAMILY.members)

# -- torch._scaled_mm with NVFP4 operands (docs/design/native-fp4.md, section 4) --------------

#: Where torch's NVFP4 ``_scaled_mm`` (cuBLASLt's block-scaled FP4 kernel) is known to run: B200
#: (pytorch PR #148792 and its tests) and GB300 (pytorch #187095 shows the sm_103 kernel).
TORCH_NVFP4_VERIFIED = CapabilitySet("torch NVFP4 verified", frozenset({(10, 0), (10, 3)}))

#: FP4 GPUs torch does not refuse (it checks only SM 8.9 / 9.0+ for every scaled-mm recipe)
#: but where nothing read shows cuBLASLt running NVFP4: Thor (11.0; 10.1 before CUDA 13) and the
#: sm120 family. The torch backend takes them only behind the first-use self-check.
TORCH_NVFP4_UNVERIFIED = CapabilitySet(
    "torch NVFP4 unverified", FP4_MMA.members - TORCH_NVFP4_VERIFIED.members
)

#: First torch release with NVFP4 ``_scaled_mm`` (float4_e2m1fn_x2 operands): 2.8 (torchao's
#: NVFP4 tests skip below it).
TORCH_NVFP4_MIN_TORCH = (2, 8)

#: The FP4 data type reaches cuBLASLt only in CUDA 12.8+ builds of torch (``CUDA_R_4F_E2M1``).
TORCH_NVFP4_MIN_CUDA = (12, 8)

# -- the providers' CUTLASS NVFP4 GEMM (docs/design/native-fp4.md, section 5) -------------------

#: SMs with cubins of ``cutlass_scaled_fp4_mm`` in the provider builds the cutlass backend binds:
#: sgl-kernel 0.3.21 (sm100/common_ops: sm_80, 89, 90, 100, 120 cubins, no PTX) and vLLM 0.33.0
#: (_C_stable_libtorch: cubins up to sm_100 and sm_120). The sm120 kernels write bf16 / fp16 only.
CUTLASS_NVFP4 = CapabilitySet("CUTLASS NVFP4 cubins", frozenset({(10, 0), (12, 0)}))

#: Same families, no cubin of their own (B300 10.3, GB10 12.1): they run only if the 10.0 / 12.0
#: cubins are family builds, which the wheels do not show. Taken only behind the self-check.
CUTLASS_NVFP4_UNVERIFIED = CapabilitySet("CUTLASS NVFP4 unverified", frozenset({(10, 3), (12, 1)}))

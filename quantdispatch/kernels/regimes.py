"""Which kernel family runs a call, as data: the regime table of the triton backend.

One linear row per (formats, weight layout, SM family): an ordered list of steps
``(max_m or None, kernel family, why)``; a call with M rows runs the first step whose ``max_m``
is at least M (None: any M). A row may define a large-weight class (its element threshold and
its own ``max_m`` per step), because the measured crossovers move with the weight's size. The
MoE rows count tokens per expert (``M * top_k / E``) instead of rows.

FP8 compute for prefill (opt-in, lossy: ``QUANTDISPATCH_FP8_COMPUTE``) is one more row per SM
family and mode (:data:`FP8_PREFILL_REGIMES`): from its ``min_m`` on it replaces whatever the
weight's linear row runs (:meth:`LinearRegime.steps_for`).

Every threshold exists here once. The backend's dispatch (backends/triton/), both MoE plans
(:mod:`.checkpoint_layout.moe_plan`, :mod:`.mma_layout.moe_plan`), ``Decision.kernel_for``,
``doctor`` and the benchmarks' labels read it. The measurements behind each number are in
docs/design/dispatch.md, docs/design/mma-layout.md, docs/design/wgmma-gemm.md and
docs/design/moe.md. Imports neither torch nor triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from quantdispatch.capability import ANY_DEVICE, SM9X, SM89_PLUS, SM90, CapabilitySet
from quantdispatch.format_facts import FP4_FORMATS

__all__ = [
    "CHECKPOINT_MOE",
    "FP8_PREFILL_REGIMES",
    "LINEAR_REGIMES",
    "MMA_LAYOUT_MOE",
    "Family",
    "Fp8PrefillRegime",
    "LargeWeights",
    "LinearRegime",
    "MoeDequant",
    "MoeDirect",
    "MoeMma",
    "MoeRegime",
    "MoeStep",
    "Step",
    "fp8_prefill_regime",
    "linear_regime",
    "m_span",
]


class Family(StrEnum):
    """A kernel family: what one kernel file's launcher runs. The value is its display text
    (``KernelRange.family``, doctor, the benchmarks' labels); :attr:`detail` says more."""

    MMA_GEMV = "mma GEMV"
    WGMMA_GEMM = "wgmma GEMM"
    CHECKPOINT_TL_DOT = "checkpoint tl.dot"
    FP8_TL_DOT = "FP8 tl.dot"
    DEQUANT_CUBLAS = "dequantize + cuBLAS"
    FP8_PREFILL = "fp8 prefill"
    MOE_TL_DOT = "checkpoint tl.dot MoE"
    MOE_MMA_PAIRS = "mma single pairs"
    MOE_MMA_BLOCKS = "mma pair blocks"
    MOE_GROUPED_GEMM = "grouped tl.dot GEMM"
    MOE_DEQUANT = "dequantize + grouped_mm"

    @property
    def detail(self) -> str:
        return _DETAIL[self]


_DETAIL = {
    Family.MMA_GEMV: "mma.sync, PTX decode, mma16x64",
    Family.WGMMA_GEMM: "tl.dot, mma16x64",
    Family.CHECKPOINT_TL_DOT: "split-K small M or tiled, checkpoint layout",
    Family.FP8_TL_DOT: "split-K small M or tiled, checkpoint layout",
    Family.DEQUANT_CUBLAS: "dequantized 16-bit slabs",
    Family.FP8_PREFILL: "lossy: FP4 weight as block-scaled e4m3, e4m3 activations per 1x128, "
    "torch._scaled_mm",
    Family.MOE_TL_DOT: "fused tl.dot MoE GEMMs",
    Family.MOE_MMA_PAIRS: "mma.sync gate/up, down kernel summing the top-k slots",
    Family.MOE_MMA_BLOCKS: "mma.sync kernels on expert-sorted pair blocks",
    Family.MOE_GROUPED_GEMM: "grouped tl.dot GEMM decoding the repacked experts",
    Family.MOE_DEQUANT: "experts dequantized per GEMM + torch._grouped_mm",
}


def m_span(first: int, last: int | None) -> str:
    """A range of M as doctor, describe and the kernel ranges write it: ``any M``,
    ``M <= 32``, ``M = 7``, ``M 33..256``, ``M >= 257``."""
    if last is None:
        return "any M" if first == 1 else f"M >= {first}"
    if first == last:
        return f"M = {first}"
    return f"M <= {last}" if first == 1 else f"M {first}..{last}"


@dataclass(frozen=True)
class Step:
    """Calls of up to ``max_m`` rows (None: any) run ``family``."""

    max_m: int | None
    family: Family
    why: str


@dataclass(frozen=True)
class LargeWeights:
    """Weights of more than ``elements`` N x K elements (at least, when not ``strict``) take
    ``max_m`` in place of the steps' own, one per step."""

    elements: int
    strict: bool
    max_m: tuple[int | None, ...]

    def holds(self, n: int, k: int) -> bool:
        return n * k > self.elements if self.strict else n * k >= self.elements

    def describe(self) -> str:
        """``2^26`` as doctor says it, with its comparison (``over`` / ``of ... +``)."""
        power = f"2^{self.elements.bit_length() - 1}"
        return f"over {power} elements" if self.strict else f"of {power}+ elements"


@dataclass(frozen=True)
class LinearRegime:
    """One row: the kernel family by M for ``formats`` on ``layout`` (a
    ``backends.base.Layout`` value) on ``sm`` GPUs. ``multiple_of`` (N, K): shapes the row
    needs (other shapes take the next row). ``when``: a flag of the prepared weight's meta the
    row needs (e.g. ``fp16_rebased``); rows without one match any weight."""

    formats: tuple[str, ...]
    layout: str
    sm: CapabilitySet
    steps: tuple[Step, ...]
    large: LargeWeights | None = None
    multiple_of: tuple[int, int] = (1, 1)
    when: str | None = None

    def matches(
        self, fmt: str, layout: str, capability: tuple[int, int] | None, n: int, k: int,
        flags: frozenset[str],
    ) -> bool:  # fmt: skip
        mn, mk = self.multiple_of
        return (
            fmt in self.formats
            and layout == self.layout
            and capability in self.sm
            and (self.when is None or self.when in flags)
            and n > 0 and k > 0 and n % mn == 0 and k % mk == 0
        )  # fmt: skip

    def max_ms(self, n: int, k: int) -> tuple[int | None, ...]:
        """Each step's largest M for an N x K weight."""
        if self.large is not None and self.large.holds(n, k):
            return self.large.max_m
        return tuple(s.max_m for s in self.steps)

    def steps_for(
        self, n: int, k: int, fp8: Fp8PrefillRegime | None = None
    ) -> tuple[tuple[int | None, Step], ...]:
        """(largest M or None, step) per step for an N x K weight; with an enabled ``fp8`` row,
        the steps end at its ``min_m`` - 1 and its step takes every larger M."""
        out: list[tuple[int | None, Step]] = []
        first = None if fp8 is None else fp8.min_m
        for step, top in zip(self.steps, self.max_ms(n, k), strict=True):
            if first is not None and (top is None or top >= first):
                return (*out, (first - 1, step), (None, fp8.step()))  # type: ignore[union-attr]
            out.append((top, step))
        return tuple(out)

    def family(self, m: int, n: int, k: int, fp8: Fp8PrefillRegime | None = None) -> Family:
        """The family a call with ``m`` rows runs."""
        for top, step in self.steps_for(n, k, fp8):
            if top is None or m <= top:
                return step.family
        raise AssertionError(f"the last step of {self.formats} {self.layout} must take any M")

    def ranges(
        self, n: int, k: int, fp8: Fp8PrefillRegime | None = None
    ) -> tuple[tuple[int, int | None, Step], ...]:
        """(first M, last M or None, step) for every step an N x K weight reaches, from M = 1."""
        out: list[tuple[int, int | None, Step]] = []
        first = 1
        for top, step in self.steps_for(n, k, fp8):
            if top is not None and top < first:
                continue
            out.append((first, top, step))
            if top is None:
                break
            first = top + 1
        return tuple(out)


_FP4 = FP4_FORMATS
_DEQUANT_WHY = "tensor-core bound: weight slabs dequantized to 16-bit, then cuBLAS"

#: The linear rows, tried in order (:func:`linear_regime`): a row for a specific SM set comes
#: before the ANY_DEVICE row of its formats and layout.
LINEAR_REGIMES: tuple[LinearRegime, ...] = (
    LinearRegime(
        _FP4, "mma16x64", SM9X,
        steps=(
            Step(32, Family.MMA_GEMV, "streams the packed weight with PTX decode; the wgmma "
                 "GEMM beats it from 64 rows on smaller weights"),
            Step(256, Family.WGMMA_GEMM, "decodes the same weight into wgmma; beats "
                 "dequantize + cuBLAS up to 256 rows on weights below 2^25 elements"),
            Step(None, Family.DEQUANT_CUBLAS, _DEQUANT_WHY),
        ),
        large=LargeWeights(2**25, strict=False, max_m=(16, 512, None)),
        multiple_of=(64, 64),  # whole 64-row weight tiles: one warpgroup's wgmma rows
    ),
    LinearRegime(
        _FP4, "mma16x64", ANY_DEVICE,
        steps=(
            Step(64, Family.MMA_GEMV, "beats dequantize + cuBLAS at 64 rows on every Llama "
                 "shape; at 128 only on weights of 2^25+ elements"),
            Step(None, Family.DEQUANT_CUBLAS, _DEQUANT_WHY),
        ),
        large=LargeWeights(2**25, strict=False, max_m=(128, None)),
    ),
    LinearRegime(
        ("mxfp4",), "checkpoint", ANY_DEVICE,
        steps=(
            Step(None, Family.CHECKPOINT_TL_DOT, "fp16-rebased scales: 2^d is applied in the "
                 "fused kernels' fp32 epilogue, which dequantized fp16 slabs cannot do"),
        ),
        when="fp16_rebased",
    ),
    LinearRegime(
        _FP4, "checkpoint", ANY_DEVICE,
        steps=(
            Step(127, Family.CHECKPOINT_TL_DOT, "memory bound: streams the packed weight"),
            Step(None, Family.DEQUANT_CUBLAS, _DEQUANT_WHY + " (from 128 rows; 512 on "
                 "weights over 2^26 elements, whose dequantization pass costs more)"),
        ),
        large=LargeWeights(2**26, strict=True, max_m=(511, None)),
    ),
    LinearRegime(
        ("fp8",), "checkpoint", ANY_DEVICE,
        steps=(
            Step(127, Family.FP8_TL_DOT, "memory bound: streams the FP8 weight"),
            Step(None, Family.DEQUANT_CUBLAS, _DEQUANT_WHY + " (from 128 rows; 512 on "
                 "weights over 2^26 elements)"),
        ),
        large=LargeWeights(2**26, strict=True, max_m=(511, None)),
    ),
)  # fmt: skip


def linear_regime(
    fmt: str,
    layout: str,
    capability: tuple[int, int] | None,
    n: int,
    k: int,
    flags: frozenset[str] = frozenset(),
) -> LinearRegime:
    """The first row for this weight (``flags``: its meta's flags, e.g. ``fp16_rebased``)."""
    for row in LINEAR_REGIMES:
        if row.matches(fmt, layout, capability, n, k, flags):
            return row
    raise LookupError(f"no regime row for {fmt} on the {layout} layout (N={n}, K={k})")


# --------------------------------------------------------------------------------------------
# FP8 compute for prefill (opt-in, lossy)

_FP8_RESULTS = "benchmarks/results/fp8-prefill-h200-2026-12-02-hw-rounding.md"


@dataclass(frozen=True)
class Fp8PrefillRegime:
    """With FP8 compute set to one of ``modes`` (``prefill``: the FP4 weight re-encoded per
    call; ``prefill-resident``: a resident FP8 copy), calls of at least ``min_m`` rows of a
    ``formats`` linear on ``sm`` GPUs run :attr:`Family.FP8_PREFILL` in place of the weight's
    own steps; ``min_m`` None: not enabled there (``why`` says why). Which weights qualify
    (shape, activation dtype, torch's recipe) is ``kernels.native.fp8_prefill.prefill_reasons``."""

    formats: tuple[str, ...]
    sm: CapabilitySet
    modes: tuple[str, ...]
    min_m: int | None
    why: str

    def step(self) -> Step:
        return Step(None, Family.FP8_PREFILL, self.why)


#: The FP8 compute rows, tried in order (:func:`fp8_prefill_regime`). Llama-3-8B and -70B shapes
#: on the H200 (bf16 activations; qkv, o, gate_up, down), in the result file named in each row.
FP8_PREFILL_REGIMES: tuple[Fp8PrefillRegime, ...] = (
    Fp8PrefillRegime(
        _FP4, SM90, ("prefill",), 2048,
        "re-encoding each call (~1 TB/s) costs more than FP8 tensor cores save below M = 2048; "
        "from there it beats our weight-only kernels on every Llama-3-8B and -70B shape "
        f"({_FP8_RESULTS})",
    ),
    Fp8PrefillRegime(
        _FP4, SM90, ("prefill-resident",), 256,
        "a resident FP8 copy beats our weight-only kernels from M = 256 on every Llama-3-8B and "
        f"-70B shape, bf16 cuBLAS from 256 on all but 8B o (from 512) ({_FP8_RESULTS})",
    ),
    Fp8PrefillRegime(
        _FP4, SM89_PLUS, ("prefill", "prefill-resident"), None,
        "row-wise FP8 recipe only, torch's block-scaled ones need SM 9.0: not measured",
    ),
)  # fmt: skip


def fp8_prefill_regime(
    fmt: str, capability: tuple[int, int] | None, mode: str
) -> Fp8PrefillRegime | None:
    """The first FP8 compute row for ``fmt`` in ``mode`` on this GPU (None: no row, e.g. below
    SM 8.9 or ``mode`` off)."""
    for row in FP8_PREFILL_REGIMES:
        if fmt in row.formats and mode in row.modes and capability in row.sm:
            return row
    return None


# --------------------------------------------------------------------------------------------
# MoE: tokens per expert (M * top_k / E)


@dataclass(frozen=True)
class MoeStep:
    """Up to ``max_tokens_per_expert`` (None: any) the GEMMs run ``family`` on blocks of
    ``block_m`` expert-sorted pairs."""

    max_tokens_per_expert: float | None
    family: Family
    block_m: int
    why: str


@dataclass(frozen=True)
class MoeDequant:
    """From ``min_tokens_per_expert`` on (experts of at least ``min_expert_elements`` I x H),
    each GEMM's experts are dequantized to 16-bit and run by torch._grouped_mm, as long as the
    16-bit copy of one GEMM's experts stays within ``max_buffer_bytes``."""

    formats: tuple[str, ...]
    min_tokens_per_expert: int
    min_expert_elements: int
    max_buffer_bytes: int
    why: str


@dataclass(frozen=True)
class MoeMma:
    """Up to ``max_tokens_per_expert`` the mma.sync kernels run (``formats``)."""

    formats: tuple[str, ...]
    max_tokens_per_expert: int
    why: str


@dataclass(frozen=True)
class MoeDirect:
    """Small experts (I x H at most ``max_expert_elements``) run one mma block per (token,
    slot) pair, no expert sort, up to ``max_tokens_per_expert``."""

    max_tokens_per_expert: float
    max_expert_elements: int
    why: str


@dataclass(frozen=True)
class MoeRegime:
    """The MoE row of one weight layout: dequantize + grouped_mm (checked first), then the
    mma.sync kernels, then ``steps``. Single pairs: ``single_pair_ratio`` x pairs <= E (at most
    1 / ratio tokens per expert: experts rarely repeat)."""

    layout: str
    dequant: MoeDequant
    mma: MoeMma
    steps: tuple[MoeStep, ...]
    single_pair_ratio: int = 4
    direct: MoeDirect | None = None

    def single_pairs(self, pairs: int, experts: int) -> bool:
        return self.single_pair_ratio * pairs <= experts

    def step(self, tokens_per_expert: float) -> MoeStep:
        for s in self.steps:
            if s.max_tokens_per_expert is None or tokens_per_expert <= s.max_tokens_per_expert:
                return s
        raise AssertionError(f"the last MoE step of the {self.layout} layout must take any")


_MOE_DEQUANT_BUFFER = 4 * 2**30

#: MoE experts on the checkpoint layout (:mod:`.checkpoint_layout.moe_plan`).
CHECKPOINT_MOE = MoeRegime(
    "checkpoint",
    dequant=MoeDequant(
        _FP4, 512, 0, _MOE_DEQUANT_BUFFER,
        "compute bound: cuBLAS-class grouped GEMMs beat the tl.dot kernels by more than the "
        "dequantization pass costs (H200, Mixtral at 1024 per expert); 512 is an estimate",
    ),
    mma=MoeMma(("nvfp4",), 4, "issue bound: the PTX decode streams faster; with more tokens "
               "per expert tl.dot reuses each decoded tile across more rows"),
    steps=(
        MoeStep(12, Family.MOE_TL_DOT, 16, "memory bound: narrow N tiles cover every SM, long "
                "K steps"),
        MoeStep(40, Family.MOE_TL_DOT, 32, "wider tiles reuse each decoded weight tile"),
        MoeStep(160, Family.MOE_TL_DOT, 64, "compute bound: 64-row blocks"),
        MoeStep(None, Family.MOE_TL_DOT, 128, "compute bound: 128-row blocks"),
    ),
)  # fmt: skip

#: Repacked (mma16x64) experts (:mod:`.mma_layout.moe_plan`).
MMA_LAYOUT_MOE = MoeRegime(
    "mma16x64",
    dequant=MoeDequant(
        _FP4, 768, 2**25, _MOE_DEQUANT_BUFFER,
        "H200 crossover for Mixtral-8x7B between 640 and 768 per expert; smaller experts keep "
        "the grouped GEMM (torch._grouped_mm over many small experts is slow itself)",
    ),
    mma=MoeMma(_FP4, 4, "at 4 per expert the mma kernels win; from 8 the grouped GEMM (its "
               "blocks hold at least 16 pairs: fewer would be mostly wgmma padding)"),
    steps=(
        MoeStep(12, Family.MOE_GROUPED_GEMM, 16, "16-pair blocks, 64-row weight tiles"),
        MoeStep(24, Family.MOE_GROUPED_GEMM, 32, "32-pair blocks at 16 per expert"),
        MoeStep(96, Family.MOE_GROUPED_GEMM, 64, "64-pair blocks at 32 and 64 per expert"),
        MoeStep(None, Family.MOE_GROUPED_GEMM, 128, "128-pair blocks on 128-row tiles from "
                "128 per expert (settled accumulators)"),
    ),
    direct=MoeDirect(0.5, 1 << 22, "blocks of 8 pairs would mostly hold one pair, and the sort "
                     "is a large part of a small expert's time"),
)  # fmt: skip

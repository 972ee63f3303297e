"""quantdispatch's own Triton weight-only kernels: FP4 / FP8 weights stay packed on the GPU and
are dequantized in registers inside the GEMM; activations stay fp16 / bf16.

Facts: any CUDA GPU from SM 7.5 with fp16 activations, from SM 8.0 with bf16 (no bf16 tensor
cores before Ampere). Scales are decoded with integer ops, so GPUs without hardware FP8
conversion (SM 7.5-8.6) work. Needs triton and a CUDA build of torch. K must be a multiple of
the format's group (16 NVFP4, 32 MXFP4). Weight-only: serves W4A16 checkpoints exactly and W4A4
ones with unquantized activations (it says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from quantdispatch.backends.base import Backend, KernelRange, PreparedMoe, PreparedWeight
from quantdispatch.errors import ConfigurationError, InputError, format_error
from quantdispatch.request import Op, Request

if TYPE_CHECKING:
    from quantdispatch.device import DeviceProfile

_GROUP = {"nvfp4": 16, "mxfp4": 32}

#: From this many activation rows on, the GEMM is tensor-core bound: dequantize bounded slabs of
#: the weight to 16-bit and run cuBLAS (kernels/dequant_gemm.py); below it, the fused Triton
#: kernels stream the packed weight. Large weights (over 64M elements, e.g. a fused 28672 x 4096
#: gate_up) switch later, because their dequantization pass costs more than the fused kernel
#: loses at mid M. From the H200 measurements in benchmarks/results/linear-h200-*.md (columns
#: NVFP4 and NVFP4 deq).
DEQUANT_GEMM_MIN_M = 128
DEQUANT_GEMM_MIN_M_LARGE_WEIGHT = 512
LARGE_WEIGHT_ELEMENTS = 2**26


#: Meta tag of an NVFP4 weight repacked into the mma16x64 layout (kernels/fp4_mma.py).
MMA_LAYOUT_TAG = 1
#: Meta tag of an MXFP4 weight on the checkpoint layout whose block scales were rebased for fp16
#: (kernels.fp4_linear.rebase_mx_scales_for_fp16); its factor 2^d is the ``rebase_factor``
#: buffer, read on the device by the fused kernels' fp32 epilogue (never from the host).
MX_FP16_REBASE_TAG = 2
#: Up to this many rows, an mma16x64 weight runs the PTX mma kernel; above, dequantize + cuBLAS.
#: From the H200 sweeps (benchmarks/results/mma-sweep-h200-*.log): at M = 64 the kernel beats
#: dequantize + cuBLAS on every Llama shape (e.g. gate_up 100 vs ~170 us); at M = 128 only on
#: weights of at least MMA_LARGE_WEIGHT_ELEMENTS (gate_up 156 vs 185, down 88 vs 103 us; qkv
#: 60 vs 41, o 42 vs 29 the other way).
MMA_MAX_M = 64
MMA_MAX_M_LARGE_WEIGHT = 128
MMA_LARGE_WEIGHT_ELEMENTS = 2**25


#: On SM 9.x (wgmma), mid M runs the tl.dot GEMM on the same mma16x64 weight
#: (kernels/fp4_mma_gemm.py) instead. From the H200 sweep (benchmarks/results/
#: gemm-sweep-h200-*.log): it beats the mma kernel from 32 rows on weights of 2^25+ elements
#: (gate_up M=32 46 vs 53 us, down 30 vs 34) and from 64 rows on smaller ones (qkv M=32 17.8 vs
#: 17.4), and dequantize + cuBLAS up to 512 rows on weights of 2^25+ elements (M=512: gate_up
#: 268 us, down 142; M=1024 the other way: 520 vs 429) and up to 256 on smaller ones (M=256:
#: qkv 42 vs 46; M=512: qkv 81 vs ~65).
GEMM_MAX_M = 256
GEMM_MAX_M_LARGE_WEIGHT = 512
#: ... and the mma kernel keeps only the smallest M there.
MMA_MAX_M_SM90 = 32
MMA_MAX_M_SM90_LARGE_WEIGHT = 16
#: The mma16x64 layout's granules: 16-row tiles, 64-column chunks (kernels/fp4_mma.py).
MMA_TILE_ROWS, MMA_CHUNK_COLS = 16, 64


def gemm_eligible(n: int, k: int, capability: tuple[int, int] | None) -> bool:
    """Whether mid M runs the tl.dot GEMM (SM 9.x, where it was measured; others keep the mma
    kernel and dequantize + cuBLAS)."""
    from quantdispatch.kernels.mma_layout.gemm_tiles import mma_gemm_supported

    return capability is not None and capability[0] == 9 and mma_gemm_supported(n, k)


def _host_descriptors() -> bool:
    """Whether the mid-M GEMM can take its activation tiles by TMA (Triton 3.3+ installed)."""
    try:
        from quantdispatch.kernels.mma_layout.gemm_tiles import has_host_descriptors
    except ImportError:  # no triton
        return False
    return has_host_descriptors()


def _rs_wgmma_note() -> str:
    """doctor's note while the installed Triton is not known to pipeline register-operand
    wgmma safely (kernels/wgmma_hazard.py)."""
    try:
        from quantdispatch.kernels.common import wgmma_guard as wh
    except ImportError:  # no triton
        return ""
    safe_from = wh.VERIFIED_SAFE_FROM
    if safe_from is not None and wh.triton_version() >= safe_from:
        return ""
    have = ".".join(map(str, wh.triton_version()))
    if wh.triton_version() < wh.UPSTREAM_FIX:
        why = f"Triton {have} overlaps register-operand wgmma unsafely (triton-lang/triton#9433)"
    else:
        why = f"Triton {have}'s fix of triton-lang/triton#9433 is not yet verified by us"
    return f", each K step waits for its wgmmas: {why}"


_CHECKPOINT_LAYOUT_TEXT = (
    "tl.dot kernels on the checkpoint layout; large M: dequantized slabs + cuBLAS"
)
_MX_SPAN_TEXT = "weights whose block scales span <= 18 binades"


def _fp4_ranges_text(mma_top: str, gemm_top: str | None) -> str:
    """doctor's words for a repacked FP4 linear's kernels by M: the mma kernel up to
    ``mma_top``, the wgmma GEMM up to ``gemm_top`` (None: no GEMM), then dequantized slabs."""
    text = (
        f"M <= {mma_top}: mma.sync kernel with PTX decode on a repacked weight (mma16x64, "
        "same bytes)"
    )
    if gemm_top is not None:
        text += f"; M <= {gemm_top}: tl.dot (wgmma) GEMM decoding the same weight"
        text += ", activation tiles by TMA" if _host_descriptors() else ""
        text += _rs_wgmma_note()
    return text + "; larger M: dequantized slabs + cuBLAS"


def _mma_ranges(n: int, k: int, capability: tuple[int, int] | None) -> tuple[int, int]:
    """(largest M for the mma kernel, largest M for the GEMM; 0 = no GEMM) of an N x K weight."""
    large = n * k >= MMA_LARGE_WEIGHT_ELEMENTS
    if gemm_eligible(n, k, capability):
        if large:
            return MMA_MAX_M_SM90_LARGE_WEIGHT, GEMM_MAX_M_LARGE_WEIGHT
        return MMA_MAX_M_SM90, GEMM_MAX_M
    return (MMA_MAX_M_LARGE_WEIGHT if large else MMA_MAX_M), 0


def mma_max_m(n: int, k: int, capability: tuple[int, int] | None = None) -> int:
    """The largest M that runs the mma kernel for an N x K weight."""
    return _mma_ranges(n, k, capability)[0]


def mma_path(m: int, n: int, k: int, capability: tuple[int, int] | None) -> str:
    """Which kernel an mma16x64 weight runs for M rows: "mma", "gemm" or "dequant"."""
    mma_top, gemm_top = _mma_ranges(n, k, capability)
    if m <= mma_top:
        return "mma"
    return "gemm" if m <= gemm_top else "dequant"


def mma_layout_eligible(
    fmt: str, n: int, k: int, act_dtype: torch.dtype, capability: tuple[int, int] | None
) -> bool:
    """Whether prepare repacks an NVFP4 or MXFP4 weight for the mma kernel: SM 8.0+ (bf16
    mma.sync), N a multiple of 16 and K of 64 (MXFP4 also needs its scales to span at most
    18 binades, checked when it repacks: kernels.fp4_mma.repack_mx). Other weights keep the
    checkpoint layout and the tl.dot kernels."""
    from quantdispatch.kernels.mma_layout.layout import mma_supported_shape

    return (
        fmt in ("nvfp4", "mxfp4")
        and capability is not None
        and capability >= (8, 0)
        and mma_supported_shape(n, k)
        and act_dtype in (torch.bfloat16, torch.float16)
    )


def use_dequant_gemm(m: int, n: int, k: int) -> bool:
    """Whether a call with M rows on an N x K weight takes the dequantize + cuBLAS path."""
    if n * k > LARGE_WEIGHT_ELEMENTS:
        return m >= DEQUANT_GEMM_MIN_M_LARGE_WEIGHT
    return m >= DEQUANT_GEMM_MIN_M


class TritonBackend(Backend):
    name = "triton"
    title = "quantdispatch Triton weight-only GEMM (weights dequantized in registers)"
    supports = {
        "nvfp4": frozenset({Op.LINEAR, Op.MOE}),
        "mxfp4": frozenset({Op.LINEAR, Op.MOE}),
        "fp8": frozenset({Op.LINEAR, Op.MOE}),
    }
    implemented = {
        "nvfp4": frozenset({Op.LINEAR, Op.MOE}),
        "mxfp4": frozenset({Op.LINEAR, Op.MOE}),
        "fp8": frozenset({Op.LINEAR, Op.MOE}),
    }
    provider = "triton"
    weight_only = True

    def device_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        gpu = self.gpu_reasons(profile)
        if gpu:
            return gpu
        return self.min_sm_reasons(profile, request, fp16_min=(7, 5), bf16_min=(8, 0))

    def variant(self, request: Request, profile: DeviceProfile) -> str | None:
        if request.format == "fp8" and request.op is Op.LINEAR:
            from quantdispatch.kernels.common.configs import SMALL_M_MAX

            return (
                "W8A16: a tl.dot kernel with K split inside each program or a tiled one, per "
                f"shape and M from the tuned table or the heuristics (these split up to M = "
                f"{SMALL_M_MAX} below 16384 rows); from M = {DEQUANT_GEMM_MIN_M} "
                f"({DEQUANT_GEMM_MIN_M_LARGE_WEIGHT} for weights over 2^26 elements): "
                "dequantized slabs + cuBLAS"
            )
        if request.format not in ("nvfp4", "mxfp4"):
            return None
        if request.op is Op.MOE:
            if profile.capability is None or profile.capability < (8, 0):
                return "fused tl.dot kernels on the checkpoint layout"
            try:
                from quantdispatch.kernels.mma_layout import moe_plan

                few = f"<= {moe_plan.MMA_MAX_TOKENS_PER_EXPERT}"
                many = (
                    f"{moe_plan.DEQUANT_MIN_TOKENS_PER_EXPERT}+ tokens per expert on "
                    f"experts of 2^{moe_plan.DEQUANT_MIN_EXPERT_ELEMENTS.bit_length() - 1}+ "
                    "elements"
                )
            except ImportError:  # no triton here: say it without the numbers
                few, many = "few", "very many tokens per expert on large experts"
            spans = " whose scales span <= 18 binades" if request.format == "mxfp4" else ""
            text = (
                f"gated layers with I and H multiples of 64{spans}: experts repacked once "
                f"(mma16x64, same bytes); {few} tokens per expert: mma.sync kernels with PTX "
                "decode (the top-k sum inside the down kernel where each pair has its own "
                "expert); more: a grouped tl.dot GEMM decoding the same weight"
            )
            if profile.capability >= (9, 0):
                text += (
                    f"; {many}: experts dequantized per GEMM + torch._grouped_mm; the "
                    "single-pair down kernel is a programmatic dependent launch (it loads its "
                    "weights while gate/up runs)"
                )
            return text + "; other layers: the checkpoint layout and fused tl.dot kernels"
        if request.op is not Op.LINEAR:
            return None
        text = self._fp4_linear_text(request, profile)
        if request.format == "mxfp4" and request.act_dtype == torch.float16:
            text += (
                "; fp16 on the checkpoint layout: a weight whose block scales leave "
                "2^-23..2^13 is rebased at load (2^d in the fused kernels' fp32 epilogue, "
                "which it then runs at every M)"
            )
        return text

    def _fp4_linear_text(self, request: Request, profile: DeviceProfile) -> str:
        if request.n is None or request.k is None:
            return self._linear_ranges(request, profile)
        n, k = request.n, request.k
        if not mma_layout_eligible(request.format, n, k, request.act_dtype, profile.capability):
            return _CHECKPOINT_LAYOUT_TEXT
        mma_top, gemm_top = _mma_ranges(n, k, profile.capability)
        text = _fp4_ranges_text(str(mma_top), str(gemm_top) if gemm_top else None)
        if request.format == "mxfp4":
            return f"{_MX_SPAN_TEXT}: {text}; wider spans: tl.dot kernels on the checkpoint layout"
        return text

    def _linear_ranges(self, request: Request, profile: DeviceProfile) -> str:
        """The kernel ranges of an FP4 linear whose shape is not given (doctor without
        ``--shape``): the rules by weight size, not one made-up shape's answer."""
        cap = profile.capability
        granule = (MMA_TILE_ROWS, MMA_CHUNK_COLS)
        if not mma_layout_eligible(request.format, *granule, request.act_dtype, cap):
            return _CHECKPOINT_LAYOUT_TEXT
        big = "for weights of 2^25+ elements"
        if cap is not None and cap[0] == 9:
            text = _fp4_ranges_text(
                f"{MMA_MAX_M_SM90} ({MMA_MAX_M_SM90_LARGE_WEIGHT} {big})",
                f"{GEMM_MAX_M} ({GEMM_MAX_M_LARGE_WEIGHT} {big}) where N is a multiple of 64",
            )
        else:
            text = _fp4_ranges_text(f"{MMA_MAX_M} ({MMA_MAX_M_LARGE_WEIGHT} {big})", None)
        where = f"N a multiple of {MMA_TILE_ROWS} and K of {MMA_CHUNK_COLS}"
        if request.format == "mxfp4":
            where = f"{_MX_SPAN_TEXT}, {where}"
        return (
            f"{where}: {text}; other shapes: tl.dot kernels on the checkpoint layout (doctor "
            "--shape NxK answers for one layer)"
        )

    def kernel_ranges(
        self, request: Request, profile: DeviceProfile, *, top_k: int | None = None
    ) -> tuple[KernelRange, ...]:
        """Linear: needs the request's N and K. MoE: needs ``top_k``, the request's experts,
        N = I and K = H (gated experts assumed)."""
        if request.op is Op.MOE:
            return self._moe_ranges(request, profile, top_k)
        if request.n is None or request.k is None:
            raise ConfigurationError(
                format_error(
                    f"{request.describe()} has no weight shape",
                    "the triton backend's kernel for a given M depends on N x K",
                    "pass n= and k= to select() (doctor: --shape NxK)",
                )
            )
        n, k, cap = request.n, request.k, profile.capability
        dequant = KernelRange(0, None, "dequantize + cuBLAS", "dequantized 16-bit slabs")
        fp4 = request.format in ("nvfp4", "mxfp4")
        if fp4 and mma_layout_eligible(request.format, n, k, request.act_dtype, cap):
            mma_top, gemm_top = _mma_ranges(n, k, cap)
            out = [KernelRange(1, mma_top, "mma GEMV", "mma.sync, PTX decode, mma16x64")]
            if gemm_top:
                out.append(KernelRange(mma_top + 1, gemm_top, "wgmma GEMM", "tl.dot, mma16x64"))
            top = out[-1].last_m
        else:
            top = (DEQUANT_GEMM_MIN_M_LARGE_WEIGHT if n * k > LARGE_WEIGHT_ELEMENTS
                   else DEQUANT_GEMM_MIN_M) - 1  # fmt: skip
            family = "checkpoint tl.dot" if fp4 else "FP8 tl.dot"
            out = [KernelRange(1, top, family, "split-K small M or tiled, checkpoint layout")]
        assert top is not None
        return (*out, KernelRange(top + 1, None, dequant.family, dequant.detail))

    def _moe_ranges(
        self, request: Request, profile: DeviceProfile, top_k: int | None
    ) -> tuple[KernelRange, ...]:
        e, inter, hidden, cap = request.experts, request.n, request.k, profile.capability
        if top_k is None or e is None or inter is None or hidden is None:
            raise ConfigurationError(
                format_error(
                    f"{request.describe()} with top_k={top_k}",
                    "the MoE kernel for a given M depends on experts, top-k, I and H",
                    "pass experts=, n=I, k=H to select() and top_k= here (doctor: --moe)",
                )
            )
        fused = (KernelRange(1, None, "checkpoint tl.dot MoE", "fused tl.dot MoE GEMMs"),)
        if (request.format not in ("nvfp4", "mxfp4") or cap is None or cap < (8, 0)
                or inter % 64 or hidden % 64):  # fmt: skip
            return fused
        from quantdispatch.kernels.checkpoint_layout.moe_plan import DequantMoeConfig, MmaMoeConfig
        from quantdispatch.kernels.mma_layout.moe_plan import (
            MoeDeviceFacts,
            MoeGemmTile,
            SmallMoeConfig,
            describe_moe_config,
            moe_kernel_ranges,
            moe_plan,
        )

        if profile.kind == "cuda" and not profile.simulated and profile.torch_cuda:
            facts = MoeDeviceFacts.of(torch.device("cuda", profile.index or 0))
        else:
            facts = MoeDeviceFacts.for_capability(cap)
        names = {
            SmallMoeConfig: "mma single pairs",
            MmaMoeConfig: "mma pair blocks",
            MoeGemmTile: "grouped tl.dot GEMM",
            DequantMoeConfig: "dequantize + grouped_mm",
        }
        ranges = moe_kernel_ranges(top_k, e, inter, hidden, facts)
        out = []
        for i, (lo, hi, words) in enumerate(ranges):
            cfg = moe_plan(lo, top_k, e, inter, hidden, facts)
            assert describe_moe_config(cfg) == words
            last = None if i == len(ranges) - 1 else hi
            out.append(KernelRange(lo, last, names[type(cfg)], words))
        return tuple(out)

    def shape_reasons(self, request: Request) -> list[str]:
        group = _GROUP.get(request.format)
        if group and request.k is not None and request.k % group != 0:
            return [f"K={request.k} is not a multiple of the {request.format} group size {group}"]
        return []

    def prepare(self, weight: object, request: Request) -> PreparedWeight:
        from quantdispatch.formats.fp8 import Fp8Weight
        from quantdispatch.formats.mxfp4 import Mxfp4Weight
        from quantdispatch.formats.nvfp4 import Nvfp4Weight

        if isinstance(weight, Nvfp4Weight):
            n, k = weight.shape
            device = weight.packed.device
            capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
            if mma_layout_eligible("nvfp4", n, k, request.act_dtype, capability):
                from quantdispatch.kernels.mma_layout.layout import repack

                words, scales = repack(
                    weight.packed, weight.block_scale.view(torch.uint8), request.act_dtype
                )
                names = ["mma_words", "mma_scales", "global_scale"]
                tensors = [words, scales, weight.global_scale]
                if weight.input_scale is not None:
                    names.append("input_scale")
                    tensors.append(weight.input_scale)
                bf16 = request.act_dtype == torch.bfloat16
                return PreparedWeight(
                    names=tuple(names),
                    tensors=tuple(tensors),
                    meta=(MMA_LAYOUT_TAG, int(bf16)),
                    out_features=n,
                    in_features=k,
                )
            names, tensors = (
                ["packed", "block_scale", "global_scale"],
                [
                    weight.packed,
                    weight.block_scale,
                    weight.global_scale,
                ],
            )
            if weight.input_scale is not None:  # kept so the state dict keeps the checkpoint's
                names.append("input_scale")
                tensors.append(weight.input_scale)
            return PreparedWeight(
                names=tuple(names), tensors=tuple(tensors), out_features=n, in_features=k
            )
        if isinstance(weight, Mxfp4Weight):
            n, k = weight.shape
            device = weight.packed.device
            capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
            if mma_layout_eligible("mxfp4", n, k, request.act_dtype, capability):
                from quantdispatch.errors import WeightFormatError
                from quantdispatch.kernels.mma_layout.layout import repack_mx

                try:
                    words, scales, global_scale = repack_mx(
                        weight.packed, weight.block_scale, request.act_dtype
                    )
                except WeightFormatError:  # scales too wide apart: the checkpoint layout
                    pass
                else:
                    return PreparedWeight(
                        names=("mma_words", "mma_scales", "global_scale"),
                        tensors=(words, scales, global_scale),
                        meta=(MMA_LAYOUT_TAG, int(request.act_dtype == torch.bfloat16)),
                        out_features=n,
                        in_features=k,
                    )
            if request.act_dtype == torch.float16:
                from quantdispatch.formats.mxfp4 import rebase_mx_scales_for_fp16

                codes, d = rebase_mx_scales_for_fp16(weight.packed, weight.block_scale)
                if d:  # scales outside fp16's exact range: rebased, 2^d in the fp32 epilogue
                    factor = torch.tensor(2.0**d, dtype=torch.float32, device=device)
                    return PreparedWeight(
                        names=("packed", "block_scale_fp16_rebased", "rebase_factor"),
                        tensors=(weight.packed, codes, factor),
                        meta=(MX_FP16_REBASE_TAG,),
                        out_features=n,
                        in_features=k,
                    )
            return PreparedWeight(
                names=("packed", "block_scale"),
                tensors=(weight.packed, weight.block_scale),
                out_features=n,
                in_features=k,
            )
        if isinstance(weight, Fp8Weight):
            n, k = weight.shape
            extra = () if weight.input_scale is None else (weight.input_scale,)
            return PreparedWeight(
                names=("weight", "scale", "input_scale")[: 2 + len(extra)],
                tensors=(weight.weight, weight.scale, *extra),
                meta=tuple(weight.block_size or ()),
                out_features=n,
                in_features=k,
            )
        return super().prepare(weight, request)

    def prepare_moe(
        self,
        w13: Sequence[torch.Tensor],
        w2: Sequence[torch.Tensor],
        names: Sequence[str],
        meta: Sequence[int],
        request: Request,
        *,
        gated: bool,
    ) -> PreparedMoe:
        """NVFP4 and MXFP4 experts of a gated layer on an SM 8.0+ GPU (I and H multiples of 64;
        MXFP4: each expert's scales spanning <= 18 binades) are repacked into the mma16x64
        layout (kernels/fp4_mma_moe.py; same bytes, one copy that every token count reads);
        everything else keeps the canonical stacks."""
        if request.format not in ("nvfp4", "mxfp4"):
            return self._canonical_moe(w13, w2, names, meta, request, gated=gated)
        from quantdispatch.kernels.mma_layout.moe_plan import moe_layout_supported
        from quantdispatch.kernels.mma_layout.moe_stacks import repack_experts, repack_experts_mx

        device = w13[0].device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        inter, hidden = w2[0].shape[2] * 2, w2[0].shape[1]  # w2 is [E, H, I/2] packed
        if not moe_layout_supported(inter, hidden, gated, capability):
            return self._canonical_moe(w13, w2, names, meta, request, gated=gated)
        tag = (MMA_LAYOUT_TAG, int(request.act_dtype == torch.bfloat16))
        if request.format == "mxfp4":
            from quantdispatch.errors import WeightFormatError

            try:
                m13 = repack_experts_mx(w13[0], w13[1], request.act_dtype)
                m2 = repack_experts_mx(w2[0], w2[1], request.act_dtype)
            except WeightFormatError:  # an expert's scales too wide apart: canonical stacks
                return self._canonical_moe(w13, w2, names, meta, request, gated=gated)
            return PreparedMoe(("mma_words", "mma_scales", "global_scale"), m13, m2, tag)
        r13 = repack_experts(w13[0], w13[1], request.act_dtype)
        r2 = repack_experts(w2[0], w2[1], request.act_dtype)
        return PreparedMoe(
            ("mma_words", "mma_scales", "global_scale"),
            (*r13, w13[2]),
            (*r2, w2[2]),
            (MMA_LAYOUT_TAG, int(request.act_dtype == torch.bfloat16)),
        )

    def _canonical_moe(
        self,
        w13: Sequence[torch.Tensor],
        w2: Sequence[torch.Tensor],
        names: Sequence[str],
        meta: Sequence[int],
        request: Request,
        *,
        gated: bool,
    ) -> PreparedMoe:
        """The stacked checkpoint tensors for the fused tl.dot MoE kernels. Those round each
        decoded MXFP4 weight to the activation dtype: in fp16, experts whose block scales leave
        fp16's exact range are refused here rather than run into inf (linear layers rebase
        their scales instead: kernels.fp4_linear.rebase_mx_scales_for_fp16)."""
        if request.format == "mxfp4" and request.act_dtype == torch.float16:
            from quantdispatch.errors import WeightFormatError
            from quantdispatch.formats.mxfp4 import FP16_MX_EXPONENTS, mx_scale_range

            low, high = FP16_MX_EXPONENTS
            for which, stack in (("w13", w13), ("w2", w2)):
                found = mx_scale_range(stack[0], stack[1].view(torch.uint8))
                if found is None:
                    continue
                lo, hi = found[0], found[1]  # per expert (an expert using no block: in range)
                bad = ((lo < low) | (hi > high)).nonzero().flatten().tolist()
                if bad:
                    e = bad[0]
                    raise WeightFormatError(
                        format_error(
                            f"MXFP4 expert {e} of {which} has block scales 2^{int(lo[e])} .. "
                            f"2^{int(hi[e])} ({len(bad)} experts of {which} outside "
                            f"2^{low} .. 2^{high})",
                            "the fused MoE kernels of the checkpoint layout round each "
                            "decoded weight to fp16, which holds e2m1 x scale exactly only "
                            f"for scales 2^{low} .. 2^{high}",
                            "run the layer in bfloat16 (SM 8.0+), or force the reference "
                            "backend for mxfp4 (QUANTDISPATCH_BACKEND_MXFP4=reference)",
                        )
                    )
        return super().prepare_moe(w13, w2, names, meta, request, gated=gated)

    def linear(
        self,
        x: torch.Tensor,
        tensors: Sequence[torch.Tensor],
        bias: torch.Tensor | None,
        fmt: str,
        meta: Sequence[int],
    ) -> torch.Tensor:
        """Fused weight-streaming kernels for small M, dequantized slabs + cuBLAS for large M.

        The path depends only on M (a host-side shape), so nothing synchronizes.
        """
        from quantdispatch.backends.base import op_view

        if fmt in ("nvfp4", "mxfp4") and len(meta) == 2 and int(meta[0]) == MMA_LAYOUT_TAG:
            from quantdispatch.kernels.mma_layout.dequant import mma_dequant_rows
            from quantdispatch.kernels.mma_layout.gemv import mma_linear
            from quantdispatch.kernels.mma_layout.layout import TILE_N

            words, scales, global_scale = tensors[0], tensors[1], tensors[2]
            packed_for = torch.bfloat16 if int(meta[1]) else torch.float16
            if x.dtype != packed_for:
                raise InputError(
                    format_error(
                        f"input is {x.dtype} but this weight was repacked for {packed_for}",
                        "the mma16x64 layout places the codes for one 16-bit format",
                        f"pass {packed_for} activations (QuantLinear checks this itself)",
                    )
                )
            from quantdispatch.kernels.common.configs import device_info

            n = words.shape[0] * TILE_N
            path = mma_path(x.shape[0], n, x.shape[1], device_info(x.device)[1])
            if path == "mma":
                return mma_linear(x, words, scales, global_scale, bias)
            if path == "gemm":
                from quantdispatch.kernels.mma_layout.gemm import mma_gemm

                return mma_gemm(x, words, scales, global_scale, bias)
            from quantdispatch.kernels.common.slabs import dequant_gemm

            def mma_rows(a: int, b: int, out: torch.Tensor) -> None:
                mma_dequant_rows(words, scales, global_scale, a, b, out)

            return dequant_gemm(x, n, x.shape[1], mma_rows, bias)
        large = use_dequant_gemm(x.shape[0], tensors[0].shape[0], x.shape[1])
        if fmt in ("nvfp4", "mxfp4"):
            scale_format = "e4m3" if fmt == "nvfp4" else "e8m0"
            packed, block_scale = tensors[0], op_view(tensors[1], torch.uint8)
            rebase = fmt == "mxfp4" and len(meta) == 1 and int(meta[0]) == MX_FP16_REBASE_TAG
            global_scale = tensors[2] if fmt == "nvfp4" or rebase else None
            # A rebased MXFP4 weight keeps the fused kernels at every M: their fp32 epilogue
            # applies 2^d, where dequantized fp16 slabs would need it inside cuBLAS (a host
            # scalar, and fp16 partial sums of 2^|d| times the output when d < 0).
            if large and not rebase:
                from quantdispatch.kernels.checkpoint_layout.dequant import dequant_fp4_rows
                from quantdispatch.kernels.common.slabs import dequant_gemm

                def rows(a: int, b: int, out: torch.Tensor) -> None:
                    dequant_fp4_rows(
                        packed[a:b], block_scale[a:b], global_scale, out, scale_format=scale_format
                    )

                return dequant_gemm(x, packed.shape[0], packed.shape[1] * 2, rows, bias)
            from quantdispatch.kernels.checkpoint_layout.linear import fp4_linear

            return fp4_linear(
                x, packed, block_scale, global_scale, scale_format=scale_format, bias=bias
            )
        if fmt == "fp8":
            weight, scale = op_view(tensors[0], torch.uint8), tensors[1]
            block = (int(meta[0]), int(meta[1])) if len(meta) == 2 else None
            if large:
                from quantdispatch.kernels.checkpoint_layout.dequant import dequant_fp8_rows
                from quantdispatch.kernels.common.slabs import dequant_gemm

                def rows8(a: int, b: int, out: torch.Tensor) -> None:
                    dequant_fp8_rows(weight[a:b], scale, a, out, block_size=block)

                return dequant_gemm(x, weight.shape[0], weight.shape[1], rows8, bias)
            from quantdispatch.kernels.checkpoint_layout.fp8 import fp8_weight_only_linear

            return fp8_weight_only_linear(x, weight, scale, block_size=block, bias=bias)
        return super().linear(x, tensors, bias, fmt, meta)

    def moe(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: Sequence[torch.Tensor],
        w2: Sequence[torch.Tensor],
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        fmt: str,
        activation: str,
        params: Sequence[float],
        meta: Sequence[int],
    ) -> torch.Tensor:
        """Fused MoE on the stacked canonical expert tensors (see quantdispatch.moe), or on the
        repacked ones prepare_moe made (meta tag MMA_LAYOUT_TAG)."""
        if fmt in ("nvfp4", "mxfp4") and len(meta) == 2 and int(meta[0]) == MMA_LAYOUT_TAG:
            from quantdispatch.kernels.mma_layout.moe_gemm import mma_layout_moe

            return mma_layout_moe(
                x,
                topk_ids,
                topk_weights,
                w13,
                w2,
                w13_bias,
                w2_bias,
                activation=activation,
                params=params,
                packed_for=torch.bfloat16 if int(meta[1]) else torch.float16,
            )
        from quantdispatch.kernels.checkpoint_layout.moe import fused_moe

        return fused_moe(
            x,
            topk_ids,
            topk_weights,
            list(w13),
            list(w2),
            w13_bias,
            w2_bias,
            fmt=fmt,
            activation=activation,
            params=list(params),
            meta=list(meta),
        )

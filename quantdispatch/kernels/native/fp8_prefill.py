"""FP8 prefill: FP4 weights on FP8 tensor cores through ``torch._scaled_mm`` (lossy, opt-in).

Per call, the FP4 weight (which stays resident) is re-encoded slab by slab into block-scaled
e4m3 (:mod:`.fp8_prefill_quant`, rule and bounds in :mod:`quantdispatch.formats.fp8_prefill`),
the activations are quantized per token and per 128 columns, and each slab runs one
``torch._scaled_mm`` whose fp32 epilogue applies both block scales (the NVFP4 global scale is
folded exactly into the weight's power-of-two scales) and the bias, rounding once to the output
dtype. Optionally the re-encoded weight is kept (:func:`make_resident`): 1 B per weight more,
no re-encoding per call. Weights in the mma16x64 layout (what the triton backend holds on SM
8.0+) are re-encoded straight from its words (:func:`fp8_prefill_linear_mma`, same bits).

Recipes (``torch._scaled_mm`` scale layouts, docs/design/fp8-prefill.md has the sources):

* ``"128x128"`` (SM 9.0, CUDA >= 12.9): activations 1x128, weight 128x128. Weight scales
  [ceil(N/128), K/128] row-major, passed transposed; needs K % 512 == 0 here, where the two
  stride conventions torch versions check coincide.
* ``"1x128"`` (SM 9.0, CUDA >= 12.9): activations and weight 1x128; weight scales [K/128, N]
  row-major, passed as is; the finer weight blocks also bound fewer weights to subnormals.
* ``"rowwise"`` (SM 8.9+): one scale per token and per output row over all of K (CUTLASS in
  torch); the fallback on Ada, with coarser weight blocks.

Workspace: at most ``workspace_bytes`` of e4m3 weight rows per slab (multiples of 128 rows),
taken per call from torch's caching allocator (stream-ordered, graph-capturable), as the
16-bit dequantize path does (:mod:`..common.slabs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantdispatch.capability import SM89_PLUS, SM90
from quantdispatch.errors import BackendUnavailableError, InputError, format_error
from quantdispatch.formats import FP4_FORMATS
from quantdispatch.formats import fp8_prefill as rule
from quantdispatch.kernels.common.checks import check_native_call
from quantdispatch.kernels.native.fp8_handoff import ActivationHandoff

__all__ = [
    "RECIPES",
    "WORKSPACE_BYTES",
    "PrefillWeight",
    "block_recipe",
    "default_recipe",
    "fp8_prefill_linear",
    "fp8_prefill_linear_mma",
    "gemm_notes",
    "make_resident",
    "make_resident_mma",
    "prefill_reasons",
    "quantize_activations",
    "reencode_rows",
    "resident_nbytes",
    "weight_blocks",
]

RECIPES = ("128x128", "1x128", "rowwise")
WORKSPACE_BYTES = 64 << 20
_WHERE = "fp8_prefill_linear"
#: GEMM forms that failed once in this process (recipe, out dtype, bias?) -> the error text;
#: those calls go straight to the fp32-output form with the epilogue in torch.
_FALLBACKS: dict[tuple[str, torch.dtype, bool], str] = {}


def gemm_notes() -> dict[str, str]:
    """Which fused GEMM forms fell back in this process, and why (for benchmarks / doctor)."""
    return {f"{r} {d} bias={b}": why for (r, d, b), why in _FALLBACKS.items()}


def _cuda_version() -> tuple[int, int]:
    v = torch.version.cuda
    return tuple(int(p) for p in v.split(".")[:2]) if v else (0, 0)  # type: ignore[return-value]


def block_recipe(k: int) -> str:
    """The block-scaled recipe for K: 128x128 where K % 512 == 0 (module doc), else 1x128."""
    return "128x128" if k % 512 == 0 else "1x128"


def default_recipe(
    k: int, capability: tuple[int, int], cuda_version: tuple[int, int] | None = None
) -> str:
    """The recipe for K on a GPU: block scales (:func:`block_recipe`) on SM 9.0 with CUDA
    12.9+, row-wise elsewhere (SM 8.9, 10.x, 12.x: torch's block-scaled FP8 recipes are SM 9.0
    only). ``cuda_version``: torch's CUDA build (None: this torch's)."""
    cuda = cuda_version if cuda_version is not None else _cuda_version()
    if capability in SM90 and cuda >= (12, 9):
        return block_recipe(k)
    return "rowwise"


def weight_blocks(recipe: str, k: int) -> tuple[int, int]:
    """(block rows, block columns) of the weight's scales for a recipe."""
    return {"128x128": (128, 128), "1x128": (1, 128), "rowwise": (1, k)}[recipe]


def _act_blocks(recipe: str, k: int) -> int:
    return k if recipe == "rowwise" else 128


def prefill_reasons(
    fmt: str,
    n: int,
    k: int,
    act_dtype: torch.dtype,
    capability: tuple[int, int] | None,
    recipe: str | None = None,
    cuda_version: tuple[int, int] | None = None,
) -> list[str]:
    """Why FP8 prefill cannot run this linear here (empty: it can). Shape and device only;
    MXFP4 scale ranges are checked once at load (:func:`rule.check_mx_exponents`).
    ``cuda_version``: torch's CUDA build (None: this torch's)."""
    cuda = cuda_version if cuda_version is not None else _cuda_version()
    out = []
    if fmt not in FP4_FORMATS:
        out.append(f"FP8 prefill re-encodes NVFP4 / MXFP4 weights, not {fmt}")
    if capability not in SM89_PLUS:
        out.append(f"FP8 tensor cores need SM 8.9+ (device: {capability})")
    if k % 128 or n % 16:
        out.append(f"needs K % 128 == 0 and N % 16 == 0 (weight {n}x{k})")
    if act_dtype not in (torch.bfloat16, torch.float16):
        out.append(f"activations must be bf16 or fp16, not {act_dtype}")
    if recipe is not None:
        if recipe not in RECIPES:
            out.append(f"unknown recipe {recipe!r} (one of {', '.join(RECIPES)})")
        elif recipe != "rowwise" and capability is not None:
            if capability not in SM90 or cuda < (12, 9):
                out.append(f"recipe {recipe} needs SM 9.0 and CUDA 12.9+ in torch")
            if recipe == "128x128" and k % 512:
                out.append(f"recipe 128x128 needs K % 512 == 0 here (K = {k})")
    return out


@dataclass(frozen=True, eq=False)
class PrefillWeight:
    """Re-encoded rows of a weight: ``q`` e4m3 [rows, K] and ``scale`` fp32 [row blocks,
    K / block columns] (natural indexing; its strides are the GEMM's layout, so ``scale.t()``
    is ``torch._scaled_mm``'s ``scale_b``)."""

    q: torch.Tensor
    scale: torch.Tensor
    recipe: str

    def nbytes(self) -> int:
        """Bytes held (what a resident copy costs on top of the FP4 weight)."""
        return self.q.numel() + self.scale.numel() * 4


def resident_nbytes(n: int, k: int, recipe: str) -> int:
    """:meth:`PrefillWeight.nbytes` of an N x K weight's resident copy, without building it."""
    rb, kb = rule.scale_grid(n, k, *weight_blocks(recipe, k))
    return n * k + rb * kb * 4


def _scale_buffer(rows: int, k: int, recipe: str, device: torch.device) -> torch.Tensor:
    """Natural-indexed fp32 scales whose strides are the GEMM's (module doc)."""
    br, bc = weight_blocks(recipe, k)
    rb, kb = rule.scale_grid(rows, k, br, bc)
    if recipe == "1x128":
        return torch.empty((kb, rb), dtype=torch.float32, device=device).t()
    return torch.empty((rb, kb), dtype=torch.float32, device=device)


def reencode_rows(
    packed: torch.Tensor,
    block_scale_u8: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    fmt: str,
    recipe: str,
    q: torch.Tensor | None = None,
    impl: str = "triton",
) -> PrefillWeight:
    """Re-encode checkpoint-layout FP4 rows (``packed`` [rows, K/2] uint8, scales uint8 e4m3
    bits [rows, K/16] or e8m0 [rows, K/32]) into ``q`` (a workspace [rows, K], or new)."""
    rows, k = packed.shape[0], packed.shape[1] * 2
    br, bc = weight_blocks(recipe, k)
    fmt_scale = "e4m3" if fmt == "nvfp4" else "e8m0"
    gs = global_scale if fmt == "nvfp4" else None
    if q is None:
        q = torch.empty((rows, k), dtype=torch.uint8, device=packed.device)
    scale = _scale_buffer(rows, k, recipe, packed.device)
    if impl == "torch":
        codes, s = rule.reencode_fp4_torch(
            packed, block_scale_u8, gs, scale_format=fmt_scale, block_rows=br, block_cols=bc
        )
        q.view(torch.uint8).copy_(codes)
        scale.copy_(s)
    else:
        from quantdispatch.kernels.native.fp8_prefill_quant import reencode_fp4_triton

        reencode_fp4_triton(
            packed, block_scale_u8, gs, q, scale, scale_format=fmt_scale, block_rows=br,
            block_cols=bc,
        )  # fmt: skip
    return PrefillWeight(q.view(torch.float8_e4m3fn), scale, recipe)


def _quantize_dense(
    x: torch.Tensor,
    rows: int,
    block_rows: int,
    block_cols: int,
    scale: torch.Tensor,
    mult: torch.Tensor | None,
    impl: str,
) -> torch.Tensor:
    """x [M, K] -> e4m3 [rows >= M, K] (zero rows after M) with scales written into ``scale``."""
    k = x.shape[1]
    q = torch.empty((rows, k), dtype=torch.uint8, device=x.device)
    if impl == "torch":
        xp = x if rows == x.shape[0] else torch.cat([x, x.new_zeros(rows - x.shape[0], k)])
        codes, s = rule.quantize_blocks_torch(
            xp, block_rows=block_rows, block_cols=block_cols, mult=mult
        )
        q.copy_(codes)
        scale.copy_(s)
    else:
        from quantdispatch.kernels.native.fp8_prefill_quant import quantize_blocks_triton

        xc = x if x.stride(1) == 1 else x.contiguous()
        quantize_blocks_triton(
            xc, q, scale, block_rows=block_rows, block_cols=block_cols, mult=mult
        )
    return q.view(torch.float8_e4m3fn)


def quantize_activations(
    x: torch.Tensor, recipe: str, impl: str = "triton"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [Mp, K], ``scale_a``): per token and per 128 columns (per token over
    all K for ``rowwise``). Block recipes pad M to a multiple of 16 with zero rows; ``scale_a``
    is [Mp, K/128] with strides (1, Mp) (or [Mp, 1]), as ``torch._scaled_mm`` takes it."""
    m, k = x.shape
    bc = _act_blocks(recipe, k)
    mp = m if recipe == "rowwise" else -(-m // 16) * 16
    if bc == k:
        scale = torch.empty((mp, 1), dtype=torch.float32, device=x.device)
    else:
        scale = torch.empty((k // bc, mp), dtype=torch.float32, device=x.device).t()
    return _quantize_dense(x, mp, 1, bc, scale, None, impl), scale


def _gemm(
    xq: torch.Tensor,
    scale_a: torch.Tensor,
    w: PrefillWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """out [Mp, rows] (a column slice of the output) = the scaled GEMM + bias, fp32 epilogue."""
    key = (w.recipe, out.dtype, bias is not None)
    scale_b = w.scale.t()
    if key not in _FALLBACKS:
        try:
            torch._scaled_mm(
                xq, w.q.t(), scale_a, scale_b,
                bias=None if bias is None else bias.to(out.dtype), out_dtype=out.dtype, out=out,
            )  # fmt: skip
            return
        except RuntimeError as exc:  # a form this torch / cuBLAS build lacks: not again
            _FALLBACKS[key] = str(exc).splitlines()[0][:200]
    try:
        y = torch._scaled_mm(xq, w.q.t(), scale_a, scale_b, out_dtype=torch.float32)
    except RuntimeError:  # row-wise CUTLASS builds without fp32 output
        y = torch._scaled_mm(xq, w.q.t(), scale_a, scale_b, out_dtype=torch.bfloat16).float()
    if bias is not None:
        y = y + bias.to(torch.float32)
    out.copy_(y)


def _plan(
    x: torch.Tensor, fmt: str, n: int, k: int, recipe: str | None, capability
) -> tuple[str, tuple[int, int]]:
    if capability is None:
        if x.device.type != "cuda":
            raise InputError(
                format_error(
                    f"{_WHERE}: x is on {x.device}",
                    "torch._scaled_mm runs on CUDA only",
                    "move x and the layer to an SM 8.9+ GPU",
                )
            )
        capability = torch.cuda.get_device_capability(x.device)
    recipe = recipe or default_recipe(k, capability)
    reasons = prefill_reasons(fmt, n, k, x.dtype, capability, recipe)
    if reasons:
        raise BackendUnavailableError(
            format_error(
                f"{_WHERE}: {fmt} {n}x{k}, {x.dtype}, recipe {recipe}",
                "; ".join(reasons),
                "run this layer weight-only (FP8 compute off)",
            )
        )
    return recipe, tuple(capability)


def _slab_rows(n: int, k: int, workspace_bytes: int) -> int:
    rows = max(128, workspace_bytes // k // 128 * 128)
    return min(n, rows)


def _run_slabs(
    x: torch.Tensor,
    n: int,
    k: int,
    recipe: str,
    bias: torch.Tensor | None,
    workspace_bytes: int,
    impl: str,
    encode: Callable[[int, int, torch.Tensor], PrefillWeight] | None,
    resident: PrefillWeight | None = None,
    handoff: ActivationHandoff | None = None,
) -> torch.Tensor:
    """Quantize x once (or take its codes from ``handoff``), then per slab: encode
    rows a..b into the workspace and run its GEMM into the output's columns a..b (or one GEMM
    on a resident copy)."""
    m = x.shape[0]
    out_dtype = x.dtype
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=x.device)
    if recipe == "rowwise" or handoff is None:
        xq, scale_a = quantize_activations(x, recipe, impl)
    else:  # both block recipes take the 1x128 form: shared with x's other readers
        xq, scale_a = handoff.quantized(x, lambda v: quantize_activations(v, recipe, impl))
    out = torch.empty((xq.shape[0], n), dtype=out_dtype, device=x.device)
    if resident is not None:
        _gemm(xq, scale_a, resident, bias, out)
        return out[:m]
    rows = _slab_rows(n, k, workspace_bytes)
    ws = torch.empty((rows, k), dtype=torch.uint8, device=x.device)  # per call: module doc
    for a in range(0, n, rows):
        b = min(n, a + rows)
        w = encode(a, b, ws[: b - a])
        _gemm(xq, scale_a, w, None if bias is None else bias[a:b], out[:, a:b])
    return out[:m]


def fp8_prefill_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale_u8: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    fmt: str,
    bias: torch.Tensor | None = None,
    recipe: str | None = None,
    resident: PrefillWeight | None = None,
    workspace_bytes: int = WORKSPACE_BYTES,
    capability: tuple[int, int] | None = None,
    impl: str = "triton",
    handoff: ActivationHandoff | None = None,
) -> torch.Tensor:
    """y [M, N] (x.dtype) = x @ W.T (+ bias) on FP8 tensor cores, W a checkpoint-layout NVFP4
    (``block_scale_u8`` e4m3 bits, fp32 ``global_scale``) or MXFP4 (e8m0 bytes) weight.

    ``resident``: the weight already re-encoded (:func:`make_resident`, same recipe), so no
    per-call re-encoding. ``handoff``: where x's codes may come from and go to (its caller's,
    :class:`.fp8_handoff.ActivationHandoff`; None: quantized here). ``capability`` /
    ``impl="torch"`` exist for tests on the CPU (with ``torch._scaled_mm`` emulated)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    check_native_call(x, n, k, bias, _WHERE)
    recipe, _ = _plan(x, fmt, n, k, recipe if resident is None else resident.recipe, capability)
    if resident is not None:
        if resident.q.shape != (n, k):
            raise InputError(
                format_error(
                    f"{_WHERE}: resident copy {tuple(resident.q.shape)} for weight {n}x{k}",
                    "the resident FP8 copy must be this weight's",
                    "rebuild it with make_resident(...)",
                )
            )
        return _run_slabs(x, n, k, recipe, bias, 0, impl, None, resident, handoff)

    def encode(a: int, b: int, ws: torch.Tensor) -> PrefillWeight:
        return reencode_rows(
            packed[a:b], block_scale_u8[a:b], global_scale, fmt=fmt, recipe=recipe, q=ws,
            impl=impl,
        )  # fmt: skip

    return _run_slabs(x, n, k, recipe, bias, workspace_bytes, impl, encode, None, handoff)


def fp8_prefill_linear_mma(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    fmt: str,
    bias: torch.Tensor | None = None,
    recipe: str | None = None,
    resident: PrefillWeight | None = None,
    workspace_bytes: int = WORKSPACE_BYTES,
    capability: tuple[int, int] | None = None,
    handoff: ActivationHandoff | None = None,
) -> torch.Tensor:
    """:func:`fp8_prefill_linear` for a weight in the mma16x64 layout (``words``, ``scales``,
    ``global_scale`` as the triton backend holds them, packed for ``x.dtype``): re-encoded
    straight from the layout's words, the same bits as from the checkpoint layout."""
    n, k = words.shape[0] * 16, words.shape[1] * 64
    check_native_call(x, n, k, bias, _WHERE)
    recipe, _ = _plan(x, fmt, n, k, recipe if resident is None else resident.recipe, capability)
    if resident is not None:
        return _run_slabs(x, n, k, recipe, bias, 0, "triton", None, resident, handoff)

    def encode(a: int, b: int, ws: torch.Tensor) -> PrefillWeight:
        return _reencode_mma(words, scales, global_scale, a, b, ws, recipe, x.dtype)

    return _run_slabs(x, n, k, recipe, bias, workspace_bytes, "triton", encode, None, handoff)


def _reencode_mma(words, scales, global_scale, a, b, q, recipe, act_dtype) -> PrefillWeight:
    from quantdispatch.kernels.native.fp8_prefill_mma import reencode_mma_triton

    k = words.shape[1] * 64
    br, bc = weight_blocks(recipe, k)
    scale = _scale_buffer(b - a, k, recipe, words.device)
    reencode_mma_triton(words, scales, global_scale, a, b, q, scale, act_dtype=act_dtype,
                        block_rows=br, block_cols=bc)  # fmt: skip
    return PrefillWeight(q.view(torch.float8_e4m3fn), scale, recipe)


def make_resident(
    packed: torch.Tensor,
    block_scale_u8: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    fmt: str,
    recipe: str,
    impl: str = "triton",
) -> PrefillWeight:
    """The whole weight re-encoded once (N*K bytes + its scales: :meth:`PrefillWeight.nbytes`),
    for users who trade memory for prefill speed."""
    if fmt == "mxfp4":
        rule.check_mx_exponents(block_scale_u8, "make_resident")
    return reencode_rows(packed, block_scale_u8, global_scale, fmt=fmt, recipe=recipe, impl=impl)


def make_resident_mma(
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    recipe: str,
    act_dtype: torch.dtype,
) -> PrefillWeight:
    """:func:`make_resident` for an mma16x64 weight packed for ``act_dtype``."""
    n, k = words.shape[0] * 16, words.shape[1] * 64
    q = torch.empty((n, k), dtype=torch.uint8, device=words.device)
    return _reencode_mma(words, scales, global_scale, 0, n, q, recipe, act_dtype)

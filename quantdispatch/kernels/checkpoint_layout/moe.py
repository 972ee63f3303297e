"""Fused MoE in Triton on packed expert weights (NVFP4, MXFP4, FP8), weight-only.

``out[t] = sum_j topk_weights[t, j] * down_e(act(gate_up_e(x[t])))`` with ``e = topk_ids[t, j]``,
for the stacked canonical expert tensors of :mod:`quantdispatch.moe` (gate rows then up rows in
w13). Four steps, every shape static given (M, top_k, E), no host synchronization, so one call
is CUDA-graph capturable and opaque to torch.compile (it runs behind a custom op):

1. **Align** (sorted path): the M * top_k (token, slot) pairs are grouped by expert and each
   expert's group is padded to a multiple of ``block_m``, written into a worst-case-sized
   buffer (``max_blocks * block_m`` entries, pads hold the sentinel T), with one expert id per
   block and the number of used blocks in a one-element device tensor. One Triton program does
   it when all pairs fit one chunk (a one-hot [chunk, E] matrix: counts are its column sums,
   the rank of a pair inside its expert its column prefix sum); bigger inputs take three
   launches (per-chunk counts, one program turning them into offsets, per-chunk scatter).
   Ids outside [0, E) (experts another rank holds, -1) get no slot at all.
   **Direct** path (few pairs per expert, M=1 decode): no alignment; each pair is its own
   block, its expert read straight from ``topk_ids`` (one launch fewer). (A variant that also
   fused steps 3 and 4, one program per (token, N tile) walking the token's slots, has only
   H / BN programs at M=1, far from the streaming floor (docs/design/moe.md), so the down GEMM
   keeps one program per (pair, N tile).) Kernels: :mod:`.moe_align`.
2. **Gate/up GEMM** per (block, N tile): rows of x gathered by token, the packed weights of
   the block's expert decoded in registers (integer-op decoders of :mod:`..common.decode`), two fp32
   accumulators (gate and up tiles), per-expert global scale / FP8 scale and bias in fp32,
   the activation fused, the intermediate stored in x.dtype in sorted order.
3. **Down GEMM** per (block, N tile) on that intermediate; fp32 epilogue applies scale, bias
   and the pair's routing weight and writes one row per (token, slot) pair.
4. **Reduce**: out[t] = the fp32 sum of its valid slots' rows (deterministic: no atomics),
   cast to x.dtype. Slots with ids outside [0, E) are skipped, so their rows are never read.
   Kernels of steps 2-4: :mod:`.moe_gemm`.

Which kernels run is :func:`.moe_plan.checkpoint_layout_moe_plan`'s choice from the static
sizes: NVFP4 with few tokens per expert on SM 8.0+ runs steps 2-3 as the ``mma.sync`` kernels
of :mod:`.moe_mma` (8-pair blocks or single pairs); very many tokens per expert on SM 9.0+
dequantize each GEMM's experts and run ``torch._grouped_mm``
(:func:`..common.slabs.run_dequant_moe`); everything else takes the tl.dot kernels.
(``QuantMoE`` on an SM 8.0+ GPU repacks NVFP4 experts of gated layers and runs
:mod:`..mma_layout.moe_gemm` instead, which reuses the alignment, the activations and step 4.)

Tiles: few tokens per expert take 16-row blocks, narrow N tiles (enough programs to cover
the GPU) and long K steps; many tokens per expert take 64/128-row blocks. K and N need not be
multiples of the tiles (masked K tail, clamped N rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from quantdispatch.errors import InputError, WeightFormatError, format_error
from quantdispatch.kernels.checkpoint_layout.dequant import dequant_experts
from quantdispatch.kernels.checkpoint_layout.moe_align import moe_align
from quantdispatch.kernels.checkpoint_layout.moe_gemm import (
    moe_gemm1_kernel,
    moe_gemm2_kernel,
    moe_reduce,
)
from quantdispatch.kernels.checkpoint_layout.moe_mma import run_mma_moe
from quantdispatch.kernels.checkpoint_layout.moe_plan import (
    DequantMoeConfig,
    MmaMoeConfig,
    MoeConfig,
    MoeGemmConfig,
    checkpoint_layout_moe_plan,
    grouped_mm_capable,
    mma_capable,
)
from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.checks import check_moe_call, interpreting, rows_aligned
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.common.launch import launch
from quantdispatch.kernels.common.slabs import run_dequant_moe
from quantdispatch.moe.activations import get_activation

__all__ = ["fused_moe", "weights_aligned"]


_FMT = {"nvfp4": 0, "mxfp4": 1, "fp8": 2}
_GROUP = {"nvfp4": 16, "mxfp4": 32, "fp8": 1}


def _fail(what: str, rule: str, fix: str, exc: type[Exception] = WeightFormatError) -> None:
    raise exc(format_error(f"fused_moe: {what}", rule, fix))


def weights_aligned(fmt: str, w13_codes: torch.Tensor, w2_codes: torch.Tensor) -> bool:
    """Whether the mma kernels may take these stacks: NVFP4 with 16-byte aligned weight rows
    (they load 8 bytes per row; the plan checks format, GPU and shapes)."""
    return fmt == "nvfp4" and rows_aligned(w13_codes) and rows_aligned(w2_codes)


def _unpack_weights(
    fmt: str, w: Sequence[torch.Tensor], which: str, block_size: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int, int]:
    """(codes, scales, global scale, E, N, K) of one stacked weight, checked."""
    need = {"nvfp4": 3, "mxfp4": 2, "fp8": 2}[fmt]
    if len(w) != need:
        _fail(
            f"{which} has {len(w)} tensors",
            f"{fmt} expert weights are {need} stacked tensors",
            "pass the stacked canonical tensors (see quantdispatch.moe)",
        )
    codes, scale = w[0], w[1]
    if codes.dim() != 3 or codes.stride(-1) != 1:
        _fail(
            f"{which}[0] has shape {tuple(codes.shape)}",
            "stacked expert weights are [E, N, K/2] (fp4) or [E, N, K] (fp8), rows contiguous",
            "stack the experts' weights with torch.stack",
        )
    e, n = codes.shape[0], codes.shape[1]
    if fmt == "fp8":
        if codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
            _fail(f"{which}[0] is {codes.dtype}", "FP8 weights are float8_e4m3fn", "")
        k = codes.shape[2]
        if scale.dtype != torch.float32:
            _fail(f"{which}[1] is {scale.dtype}", "FP8 scales are float32", "convert at load")
        per_expert = scale.dim() == 1 and scale.shape[0] == e
        if per_expert or (scale.dim() == 2 and tuple(scale.shape) == (e, n)):
            pass
        elif scale.dim() == 3 and block_size is not None:
            bn, bk = block_size
            want = (e, triton.cdiv(n, bn), triton.cdiv(k, bk))
            if tuple(scale.shape) != want or bk % 16 != 0:
                _fail(
                    f"{which}[1] has shape {tuple(scale.shape)} with block {(bn, bk)}",
                    f"block scales are [E, ceil(N/bn), ceil(K/bk)] = {list(want)}, bk % 16 == 0",
                    "pass block_size=(bn, bk) matching the checkpoint's weight_block_size",
                )
        else:
            _fail(
                f"{which}[1] has shape {tuple(scale.shape)} (block_size {block_size})",
                "FP8 expert scales are [E] (tensor), [E, N] (channel) or [E, nb, kb] with "
                "block_size=(bn, bk) (block)",
                "pass the stacked scales of this layer",
            )
        return codes.view(torch.uint8), scale, None, e, n, k
    group = _GROUP[fmt]
    if codes.dtype != torch.uint8:
        _fail(f"{which}[0] is {codes.dtype}", "packed FP4 codes are uint8 [E, N, K/2]", "")
    k = codes.shape[2] * 2
    want_dt = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    if (
        scale.dtype not in (want_dt, torch.uint8)
        or tuple(scale.shape) != (e, n, k // group)
        or scale.stride(-1) != 1
    ):
        _fail(
            f"{which}[1] is {scale.dtype} {tuple(scale.shape)}",
            f"{fmt} block scales are {want_dt} [E, N, K/{group}] = [{e}, {n}, {k // group}]",
            "pass the stacked block scales of this layer",
        )
    gs = None
    if fmt == "nvfp4":
        gs = w[2]
        if gs.dtype != torch.float32 or tuple(gs.shape) != (e,):
            _fail(
                f"{which}[2] is {gs.dtype} {tuple(gs.shape)}",
                f"NVFP4 experts have one float32 global scale (multiplier) each: [{e}]",
                "stack the per-expert global scales (merged gate/up share one)",
            )
    return codes, scale.view(torch.uint8), gs, e, n, k


def _strides(fmt: str, scale: torch.Tensor) -> tuple[int, int, int, int]:
    """(stride_se, stride_sn, stride_sk, scale kind) for the kernels."""
    if fmt != "fp8":
        return scale.stride(0), scale.stride(1), 0, 0
    if scale.dim() == 1:
        return scale.stride(0), 0, 0, 0
    if scale.dim() == 2:
        return scale.stride(0), scale.stride(1), 0, 1
    return scale.stride(0), scale.stride(1), scale.stride(2), 2


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: list[torch.Tensor],
    w2: list[torch.Tensor],
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    *,
    fmt: str,
    activation: str,
    params: Sequence[float],
    block_size: tuple[int, int] | None = None,
    config: MoeConfig | MmaMoeConfig | DequantMoeConfig | None = None,
    facts: DeviceFacts | None = None,
) -> torch.Tensor:
    """Routed experts on packed stacked weights: [M, H] in x.dtype (see the module docstring).

    ``topk_ids`` hold local expert ids; ids outside [0, E) contribute nothing. ``topk_weights``
    (float32) are final. ``block_size``: FP8 block scales' (rows, columns). ``config``: the
    plan's choice (None: :func:`.moe_plan.checkpoint_layout_moe_plan` here). ``facts``: x's
    device (None: asked here).
    """
    if fmt not in _FMT:
        _fail(f"format {fmt!r}", f"formats: {', '.join(_FMT)}", "", InputError)
    spec = get_activation(activation)
    half = (torch.float16, torch.bfloat16)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in half:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        _fail(f"x is {got}", "x is float16/bfloat16 [M, H]", "flatten and cast it", InputError)
    m, hidden = x.shape
    c13, s13, g13, e, n13, k13 = _unpack_weights(fmt, w13, "w13", block_size)
    c2, s2, g2, e2, n2, k2 = _unpack_weights(fmt, w2, "w2", block_size)
    inter = n13 // 2 if spec.gated else n13
    if e2 != e or k13 != hidden or n2 != hidden or k2 != inter or (spec.gated and n13 % 2):
        _fail(
            f"w13 is [E={e}, N={n13}, K={k13}] and w2 [E={e2}, N={n2}, K={k2}] for x with "
            f"H={hidden} ({activation}: {'gated' if spec.gated else 'not gated'})",
            "w13 is [E, 2I (gated) or I, H] and w2 [E, H, I]",
            "pass the weights that belong to this layer",
        )
    top_k = check_moe_call(x, topk_ids, topk_weights, e, n13, n2, w13_bias, w2_bias, c13, c2)
    out = checks.empty((m, hidden), x.dtype, x.device)
    if m == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    tw = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    pairs = m * top_k
    # the mma kernels load 8 bytes per weight row (the plan checks format, GPU and shapes)
    aligned = weights_aligned(fmt, c13, c2)
    facts = facts or device_facts(x.device)
    cfg = config or checkpoint_layout_moe_plan(
        m, top_k, e, inter, hidden, fmt, facts, gated=spec.gated, allow_mma=aligned
    )
    alpha, limit = 0.0, 0.0
    if spec.name == "swiglu_oai":
        alpha, limit = (tuple(params) or spec.default_params)[:2]
    if isinstance(cfg, DequantMoeConfig):
        if fmt not in ("nvfp4", "mxfp4") or not grouped_mm_capable(facts):
            _fail(
                f"a dequantize + grouped-GEMM config for {fmt} on {x.device}",
                "that path needs NVFP4 or MXFP4 and torch._grouped_mm on an SM 9.0+ GPU",
                "leave config=None (the heuristic picks the Triton kernels then)",
                InputError,
            )
        run_dequant_moe(
            x, ids, tw, e,
            lambda: dequant_experts(fmt, c13, s13, g13, x.dtype),
            lambda: dequant_experts(fmt, c2, s2, g2, x.dtype),
            w13_bias, w2_bias, spec.code, spec.gated, alpha, limit, out,
        )  # fmt: skip
        return out
    if not isinstance(cfg, MoeConfig):
        if not (aligned and mma_capable(fmt, spec.gated, inter, hidden, facts)):
            _fail(
                f"an mma config for {fmt} {activation} I={inter} H={hidden} on {x.device}",
                "the mma kernels need NVFP4, a gated activation, SM 8.0+, I and H multiples "
                "of 64 and 16-byte aligned weight rows",
                "leave config=None (the heuristic picks the tl.dot kernels then)",
                InputError,
            )
        run_mma_moe(x, ids, tw, (c13, s13, g13), (c2, s2, g2), w13_bias, w2_bias, spec.code,
                 alpha, limit, cfg, out, inter)  # fmt: skip
        return out
    bm = cfg.block_m
    if cfg.direct:
        n_blocks = pairs
        a = checks.empty((pairs, inter), x.dtype, x.device)
        sorted_ids = block_expert = num_blocks = ids  # unused by the direct kernels
    else:
        sorted_ids, block_expert, num_blocks = moe_align(ids, e, bm)
        n_blocks = block_expert.shape[0]
        a = checks.empty((n_blocks * bm, inter), x.dtype, x.device)

    fcode = _FMT[fmt]
    group = _GROUP[fmt]
    bsn, bsk = block_size if fmt == "fp8" and block_size is not None else (1, 1)
    dot_f32 = interpreting()
    bf16 = x.dtype == torch.bfloat16
    deq16 = fmt == "nvfp4" and not dot_f32

    def block_k(c: MoeGemmConfig, k: int, kind: int) -> int:
        bk = max(c.block_k, 2 * group if fmt != "fp8" else 16)
        if kind == 2:  # a K step must not straddle two scale blocks
            while bsk % bk:
                bk //= 2
        return bk

    se13, sn13, sk13, kind13 = _strides(fmt, s13)
    bk1 = block_k(cfg.gemm1, hidden, kind13)
    grid1 = (n_blocks, triton.cdiv(inter, cfg.gemm1.block_n))
    launch(moe_gemm1_kernel, grid1,
        x, ids, sorted_ids, block_expert, num_blocks,
        c13, s13, g13 if g13 is not None else s13, w13_bias if w13_bias is not None else x, a,
        pairs, inter, hidden, e, top_k,
        x.stride(0), c13.stride(0), c13.stride(1), se13, sn13, sk13,
        w13_bias.stride(0) if w13_bias is not None else 0, a.stride(0),
        float(alpha), float(limit),
        FMT=fcode, GROUP=group, SCALE_KIND=kind13, BLOCK_SN=bsn, BLOCK_SK=bsk,
        GATED=spec.gated, ACT=spec.code, HAS_BIAS=w13_bias is not None, DIRECT=cfg.direct,
        EVEN_K=hidden % bk1 == 0, DOT_F32=dot_f32, DEQ16=deq16, BF16=bf16,
        BM=bm, BN=cfg.gemm1.block_n, BK=bk1,
        num_warps=cfg.gemm1.num_warps, num_stages=cfg.gemm1.num_stages,
    )  # fmt: skip

    se2, sn2, sk2, kind2 = _strides(fmt, s2)
    bk2 = block_k(cfg.gemm2, inter, kind2)
    b2_arg = w2_bias if w2_bias is not None else x
    b2_stride = w2_bias.stride(0) if w2_bias is not None else 0
    y = checks.empty((pairs, hidden), x.dtype, x.device)
    grid2 = (n_blocks, triton.cdiv(hidden, cfg.gemm2.block_n))
    launch(moe_gemm2_kernel, grid2,
        a, ids, sorted_ids, block_expert, num_blocks, tw,
        c2, s2, g2 if g2 is not None else s2, b2_arg, y,
        pairs, hidden, inter, e,
        a.stride(0), c2.stride(0), c2.stride(1), se2, sn2, sk2, b2_stride, y.stride(0),
        FMT=fcode, GROUP=group, SCALE_KIND=kind2, BLOCK_SN=bsn, BLOCK_SK=bsk,
        HAS_BIAS=w2_bias is not None, DIRECT=cfg.direct, EVEN_K=inter % bk2 == 0,
        DOT_F32=dot_f32, DEQ16=deq16, BF16=bf16, BM=bm, BN=cfg.gemm2.block_n, BK=bk2,
        num_warps=cfg.gemm2.num_warps, num_stages=cfg.gemm2.num_stages,
    )  # fmt: skip

    moe_reduce(y, ids, out, e)
    return out

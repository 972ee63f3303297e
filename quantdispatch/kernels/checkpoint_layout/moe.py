"""Fused MoE in Triton on packed expert weights (NVFP4, MXFP4, FP8), weight-only.

``out[t] = sum_j topk_weights[t, j] * down_e(act(gate_up_e(x[t])))`` with ``e = topk_ids[t, j]``,
for the stacked canonical expert tensors of :mod:`quantdispatch.moe` (gate rows then up rows in
w13). The stages of :mod:`..common.moe_stages` (prepare, align, experts, finalize), every shape
static given (M, top_k, E), no host synchronization, so one call is CUDA-graph capturable and
opaque to torch.compile (it runs behind a custom op):

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
   keeps one program per (pair, N tile).) Kernels: :mod:`..common.moe_align`.
2. **Gate/up GEMM** per (block, N tile): rows of x gathered by token, the packed weights of
   the block's expert decoded in registers (integer-op decoders of :mod:`..common.decode`), two fp32
   accumulators (gate and up tiles), per-expert global scale / FP8 scale and bias in fp32,
   the activation fused, the intermediate stored in x.dtype in sorted order.
3. **Down GEMM** per (block, N tile) on that intermediate; fp32 epilogue applies scale, bias
   and the pair's routing weight and writes one row per (token, slot) pair.
4. **Reduce**: out[t] = the fp32 sum of its valid slots' rows (deterministic: no atomics),
   cast to x.dtype. Slots with ids outside [0, E) are skipped, so their rows are never read.
   Kernels: steps 2-3 :mod:`.moe_gemm` (:class:`.moe_gemm.TlDotExperts`), step 4
   :mod:`..common.moe_stages`.

Which kernels run is :func:`.moe_plan.checkpoint_layout_moe_plan`'s choice from the static
sizes: NVFP4 with few tokens per expert on SM 8.0+ runs steps 2-3 as the ``mma.sync`` kernels
of :mod:`..common.moe_mma` (8-pair blocks or single pairs); very many tokens per expert on SM
9.0+ dequantize each GEMM's experts and run ``torch._grouped_mm`` (:mod:`..common.moe_dequant`);
everything else takes the tl.dot kernels.
(``QuantMoE`` on an SM 8.0+ GPU repacks NVFP4 experts of gated layers and runs
:mod:`..mma_layout.moe_gemm` instead, through the same stages.)

Tiles: few tokens per expert take 16-row blocks, narrow N tiles (enough programs to cover
the GPU) and long K steps; many tokens per expert take 64/128-row blocks. K and N need not be
multiples of the tiles (masked K tail, clamped N rows).
"""


from __future__ import annotations

from collections.abc import Sequence

import torch

from quantdispatch.errors import InputError
from quantdispatch.kernels.checkpoint_layout.dequant import dequant_experts
from quantdispatch.kernels.checkpoint_layout.moe_gemm import TlDotExperts
from quantdispatch.kernels.checkpoint_layout.moe_plan import (
    MoeConfig,
    checkpoint_layout_moe_plan,
    mma_capable,
)
from quantdispatch.kernels.checkpoint_layout.moe_stacks import (
    FORMAT_CODES,
    ExpertStack,
    fail,
    unpack_stack,
    weights_aligned,
)
from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts
from quantdispatch.kernels.common.moe_activations import ActivationArgs, activation_args
from quantdispatch.kernels.common.moe_dequant import DequantExperts
from quantdispatch.kernels.common.moe_mma import MmaExperts
from quantdispatch.kernels.common.moe_plan import DequantMoeConfig, MmaMoeConfig, grouped_mm_capable
from quantdispatch.kernels.common.moe_stages import (
    ExpertWeights,
    MoeExperts,
    MoeInputs,
    prepare_inputs,
    run_stages,
)

__all__ = ["fused_moe"]


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
    if fmt not in FORMAT_CODES:
        fail(f"format {fmt!r}", f"formats: {', '.join(FORMAT_CODES)}", "", InputError)
    act = activation_args(activation, params)
    s13, s2, inter = _checked_stacks(x, fmt, w13, w2, block_size, act)
    stacks = (s13.e, s13.n, s2.n, s13.codes, s2.codes)
    inp = prepare_inputs(x, topk_ids, topk_weights, act, stacks, w13_bias, w2_bias, whole_x=False)
    out = checks.empty((inp.m, inp.hidden), x.dtype, x.device)
    if inp.m == 0:
        return out
    # the mma kernels load 8 bytes per weight row (the plan checks format, GPU and shapes)
    aligned = weights_aligned(fmt, s13.codes, s2.codes)
    facts = facts or device_facts(x.device)
    cfg = config or checkpoint_layout_moe_plan(
        inp.m, inp.top_k, s13.e, inter, inp.hidden, fmt, facts, gated=act.gated, allow_mma=aligned
    )
    weights = ExpertWeights(s13, s2, w13_bias, w2_bias)
    experts = _experts(cfg, fmt, weights, block_size, aligned, facts, inp)
    return run_stages(experts, inp, out)


def _checked_stacks(
    x: torch.Tensor,
    fmt: str,
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    block_size: tuple[int, int] | None,
    act: ActivationArgs,
) -> tuple[ExpertStack, ExpertStack, int]:
    """x and both stacks checked against each other; returns the stacks and I."""
    half = (torch.float16, torch.bfloat16)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in half:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        fail(f"x is {got}", "x is float16/bfloat16 [M, H]", "flatten and cast it", InputError)
    hidden = x.shape[1]
    s13 = unpack_stack(fmt, w13, "w13", block_size)
    s2 = unpack_stack(fmt, w2, "w2", block_size)
    e, n13, k13 = s13.e, s13.n, s13.k
    inter = n13 // 2 if act.gated else n13
    if s2.e != e or k13 != hidden or s2.n != hidden or s2.k != inter or (act.gated and n13 % 2):
        fail(
            f"w13 is [E={e}, N={n13}, K={k13}] and w2 [E={s2.e}, N={s2.n}, K={s2.k}] for x with "
            f"H={hidden} ({act.name}: {'gated' if act.gated else 'not gated'})",
            "w13 is [E, 2I (gated) or I, H] and w2 [E, H, I]",
            "pass the weights that belong to this layer",
        )
    return s13, s2, inter


def _experts(
    cfg: object,
    fmt: str,
    weights: ExpertWeights,
    block_size: tuple[int, int] | None,
    aligned: bool,
    facts: DeviceFacts,
    inp: MoeInputs,
) -> MoeExperts:
    """The experts of the config's kernel family, after checking the config suits this call."""
    x, act, hidden = inp.x, inp.act, inp.hidden
    s13, s2, b13, b2 = weights
    inter = s13.n // 2 if act.gated else s13.n
    if isinstance(cfg, DequantMoeConfig):
        if fmt not in ("nvfp4", "mxfp4") or not grouped_mm_capable(facts):
            fail(
                f"a dequantize + grouped-GEMM config for {fmt} on {x.device}",
                "that path needs NVFP4 or MXFP4 and torch._grouped_mm on an SM 9.0+ GPU",
                "leave config=None (the heuristic picks the Triton kernels then)",
                InputError,
            )
        return DequantExperts(
            ExpertWeights(
                lambda dt: dequant_experts(fmt, *s13[:3], dt),
                lambda dt: dequant_experts(fmt, *s2[:3], dt), b13, b2,
            )
        )  # fmt: skip
    if isinstance(cfg, MoeConfig):
        return TlDotExperts(fmt, weights, block_size, cfg, inter)
    mma = isinstance(cfg, MmaMoeConfig) and aligned
    if not (mma and mma_capable(fmt, act.gated, inter, hidden, facts)):
        fail(
            f"an mma config for {fmt} {act.name} I={inter} H={hidden} on {x.device}",
            "the mma kernels need NVFP4, a gated activation, SM 8.0+, I and H multiples "
            "of 64 and 16-byte aligned weight rows",
            "leave config=None (the heuristic picks the tl.dot kernels then)",
            InputError,
        )
    return MmaExperts(ExpertWeights(s13[:3], s2[:3], b13, b2), cfg, inter)

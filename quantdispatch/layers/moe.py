"""``QuantMoE``: a quantized mixture-of-experts layer, plus the routing it runs.

Same life cycle as :class:`~quantdispatch.layers.QuantLinear`: the kernel decision is made once
at construction (``select(fmt, op="moe", ...)``), the layer keeps only the stacked packed
expert tensors as the backend prepared them (its buffers: a state-dict round trip restores it;
the triton backend on an SM 8.0+ GPU repacks NVFP4 experts, same bytes), and ``forward`` runs
``torch.ops.quantdispatch.moe`` (a custom op: torch.compile(fullgraph=True) and CUDA graphs see
one opaque call).

Stacked canonical tensors (what every MoE backend takes; E = experts held, H = hidden,
I = intermediate; gated w13 rows are [gate (I rows); up (I rows)]):

| format | w13 (w2: the same over [E, H, I]) |
|---|---|
| nvfp4 | packed uint8 [E, 2I, H/2], block_scale e4m3 [E, 2I, H/16], global_scale f32 [E] |
| mxfp4 | packed uint8 [E, 2I, H/2], block_scale uint8 e8m0 [E, 2I, H/32] |
| fp8 | weight e4m3 [E, 2I, H], scale f32 [E] / [E, 2I] / [E, nb, kb] (meta [0, bn, bk]) |

Per expert, gate and up are merged under ONE per-tensor scale exactly
(:func:`~quantdispatch.formats.merge_nvfp4_shards`: the other shard's block scales are
rescaled, the codes untouched). gpt-oss checkpoints interleave gate and up rows
([gate0, up0, gate1, up1, ...]); they are de-interleaved at load, so kernels see one layout.

Routing (:func:`route`) turns router logits into (global expert ids, final weights): softmax or
sigmoid scores, optional DeepSeek grouped top-k (``e_score_correction_bias`` is used to choose,
never as a weight), optional renormalization, and the routed scaling factor applied exactly
once, here. Expert parallelism: a layer may hold a subset of the experts (``expert_ids``); pairs
routed to experts it does not hold contribute nothing, so the sum over ranks is the full layer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

import quantdispatch.ops  # noqa: F401  (registers torch.ops.quantdispatch.*)
from quantdispatch.api import select
from quantdispatch.backends import get_backend
from quantdispatch.checkpoints import LoadedLinear, QuantWeight, merge_shards, read_linear
from quantdispatch.errors import CheckpointError, ConfigurationError, InputError, format_error
from quantdispatch.formats import (
    Fp8Weight,
    Mxfp4Weight,
    Nvfp4Weight,
    get_format,
    merge_nvfp4_shards,
)
from quantdispatch.layers import (
    FixedDtypeBuffers,
    activations_2d,
    format_of,
    profile_for,
    resolve_quant_config,
    target_device,
)
from quantdispatch.moe_math import get_activation
from quantdispatch.policy import Policy
from quantdispatch.request import Scheme, dtype_name, parse_act_dtype
from quantdispatch.resolver import Decision
from quantdispatch.settings import Settings

__all__ = ["QuantMoE", "RoutingConfig", "route", "to_local_ids"]

logger = logging.getLogger("quantdispatch")

Scoring = Literal["softmax", "sigmoid"]

#: Buffer names of the stacked tensors per format (w13_* then w2_*), in the op's order.
_NAMES = {
    "nvfp4": ("packed", "block_scale", "global_scale"),
    "mxfp4": ("packed", "block_scale"),
    "fp8": ("weight", "scale"),
}


# ---------------------------------------------------------------------------------------------
# Routing


@dataclass(frozen=True)
class RoutingConfig:
    """How router logits become (expert ids, weights); see :func:`route`."""

    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def check(self, num_experts: int) -> None:
        """Shape rules, on host integers only (no device synchronization)."""
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigurationError(
                format_error(
                    f"unknown router scoring {self.scoring!r}",
                    "scoring is 'softmax' (Qwen, Mixtral, gpt-oss) or 'sigmoid' (DeepSeek-V3)",
                    "pass the model config's scoring_func",
                )
            )
        if not isinstance(self.top_k, int) or self.top_k < 1 or self.top_k > num_experts:
            raise ConfigurationError(
                format_error(
                    f"top_k={self.top_k!r} with {num_experts} experts",
                    "each token picks 1 <= top_k <= num_experts distinct experts",
                    "pass the model config's num_experts_per_tok and num_experts",
                )
            )
        if (self.n_group is None) != (self.topk_group is None):
            raise ConfigurationError(
                format_error(
                    f"n_group={self.n_group} but topk_group={self.topk_group}",
                    "grouped top-k needs both (DeepSeek: n_group=8, topk_group=4)",
                    "pass both or neither",
                )
            )
        if self.n_group is not None and self.topk_group is not None:
            ng, tg = self.n_group, self.topk_group
            if ng < 1 or num_experts % ng or not 1 <= tg <= ng:
                raise ConfigurationError(
                    format_error(
                        f"n_group={ng}, topk_group={tg} with {num_experts} experts",
                        "n_group divides the expert count and 1 <= topk_group <= n_group",
                        "pass the model config's values",
                    )
                )
            if self.top_k > tg * (num_experts // ng):
                raise ConfigurationError(
                    format_error(
                        f"top_k={self.top_k} but the {tg} chosen groups hold only "
                        f"{tg * (num_experts // ng)} experts",
                        "top_k <= topk_group * experts per group",
                        "check n_group / topk_group / top_k",
                    )
                )
        f = self.routed_scaling_factor
        if not isinstance(f, (int, float)) or not f > 0 or f != f or f == float("inf"):
            raise ConfigurationError(
                format_error(
                    f"routed_scaling_factor={f!r}",
                    "it is a finite positive number (1.0 = none)",
                    "pass the model config's routed_scaling_factor",
                )
            )


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: Scoring = "softmax",
    renormalize: bool = False,
    n_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [M, E] -> (global expert ids int32 [M, top_k], weights float32 [M, top_k]).

    * scores = softmax(logits) or sigmoid(logits), in float32;
    * choice = scores + e_score_correction_bias (if given: it only steers the choice);
    * grouped top-k (n_group, topk_group): experts split into n_group groups, a group scores
      the sum of its top 2 choice values (its max without a correction bias), only the experts
      of the best topk_group groups stay eligible;
    * ids = top_k of choice; weights = scores at those ids (never the biased values);
    * renormalize: weights / their sum (softmax + renormalize = softmax over the top-k
      logits: Mixtral, Qwen, gpt-oss);
    * weights *= routed_scaling_factor, exactly once (the weights are final: backends never
      scale again).

    Static shapes, no host synchronization: safe in CUDA graphs and torch.compile.
    """
    if router_logits.dim() != 2:
        raise InputError(
            format_error(
                f"router_logits has shape {tuple(router_logits.shape)}",
                "router logits are [tokens, num_experts]",
                "flatten leading dimensions first",
            )
        )
    m, num_experts = router_logits.shape
    cfg = RoutingConfig(top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor)
    cfg.check(num_experts)
    logits = router_logits.to(torch.float32)
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores
    if e_score_correction_bias is not None:
        if tuple(e_score_correction_bias.shape) != (num_experts,):
            raise InputError(
                format_error(
                    f"e_score_correction_bias has shape {tuple(e_score_correction_bias.shape)}",
                    f"it has one value per expert: ({num_experts},)",
                    "pass the router's e_score_correction_bias",
                )
            )
        choice = scores + e_score_correction_bias.to(torch.float32)
    if n_group is not None and topk_group is not None and n_group > 1:
        per = num_experts // n_group
        grouped = choice.view(m, n_group, per)
        if e_score_correction_bias is not None and per >= 2:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand(m, n_group, per).reshape(m, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * float(routed_scaling_factor)
    return ids.to(torch.int32), weights


def to_local_ids(global_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global expert ids -> this layer's local ids (-1 for experts it does not hold)."""
    if expert_map is None:
        return global_ids
    return expert_map[global_ids.to(torch.long)]


def _tracing(t: torch.Tensor) -> bool:
    """True under torch.compile tracing or CUDA-graph capture (no data-dependent checks)."""
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------------
# Stacking per-expert weights


def _fail(what: str, rule: str, fix: str, exc: type[Exception] = ConfigurationError) -> None:
    raise exc(format_error(what, rule, fix))


def _fp8_stack_scales(ws: Sequence[Fp8Weight], which: str) -> tuple[torch.Tensor, tuple | None]:
    """Stack per-expert FP8 scales: [E] if all per-tensor, [E, N] (exact) if any per-channel,
    [E, nb, kb] if all block-scaled with one block size."""
    kinds = {w.scale_kind for w in ws}
    if "block" in kinds:
        blocks = {w.block_size for w in ws}
        if kinds != {"block"} or len(blocks) != 1:
            _fail(
                f"{which} experts mix FP8 scale layouts {sorted(kinds)} / blocks {blocks}",
                "block-scaled experts stack only with block-scaled experts of one block size",
                "re-export the checkpoint with one FP8 scheme for all experts",
                CheckpointError,
            )
        return torch.stack([w.scale for w in ws]), ws[0].block_size
    if kinds == {"tensor"}:
        return torch.stack([w.scale.reshape(()) for w in ws]), None
    return torch.stack([w.scale.expand(w.shape[0]) for w in ws]), None


def _stack(fmt: str, fused: Sequence[QuantWeight], which: str) -> tuple[list[torch.Tensor], tuple]:
    """Stack per-expert weights of one format into the canonical tensors (+ fp8 block size)."""
    shapes = {w.shape for w in fused}
    if len(shapes) != 1:
        _fail(
            f"{which} experts have different shapes {sorted(shapes)}",
            "every expert of a layer has the same [N, K]",
            "pass the experts of one layer",
            CheckpointError,
        )
    if fmt == "nvfp4":
        ws: Any = fused
        return [
            torch.stack([w.packed for w in ws]),
            torch.stack([w.block_scale for w in ws]),
            torch.stack([w.global_scale.reshape(()).to(torch.float32) for w in ws]),
        ], ()
    if fmt == "mxfp4":
        ws = fused
        return [torch.stack([w.packed for w in ws]), torch.stack([w.block_scale for w in ws])], ()
    ws = fused
    scale, block = _fp8_stack_scales(ws, which)
    return [torch.stack([w.weight for w in ws]), scale], (tuple(block) if block else ())


def _merge_gate_up(gate: QuantWeight, up: QuantWeight, e: int) -> QuantWeight:
    """One expert's gate and up as one [2I, H] weight under one per-tensor scale (exact)."""
    if type(gate) is not type(up):
        _fail(
            f"expert {e}: gate is {type(gate).__name__} but up is {type(up).__name__}",
            "gate and up of an expert share one format",
            "check the checkpoint",
            CheckpointError,
        )
    if gate.shape != up.shape:
        _fail(
            f"expert {e}: gate has shape {gate.shape} but up {up.shape}",
            "gate and up projections have the same [I, H]",
            "pass the gate and up weights of the same expert",
            CheckpointError,
        )
    if isinstance(gate, Nvfp4Weight):
        return merge_nvfp4_shards([gate, up])  # type: ignore[list-item]
    scheme = Scheme.WEIGHT_ONLY
    merged = merge_shards(
        [LoadedLinear(gate, scheme, None, "moe"), LoadedLinear(up, scheme, None, "moe")]
    )
    return merged.weight


def _validate_stacked(fmt: str, w: Sequence[torch.Tensor], which: str, block: tuple) -> None:
    """Dtype / shape / value checks of stacked tensors, in bulk (once, at load)."""
    names = _NAMES[fmt]
    if len(w) != len(names):
        _fail(
            f"{which} has {len(w)} tensors",
            f"stacked {fmt} expert weights are {len(names)} tensors: {', '.join(names)}",
            "pass them in that order",
            CheckpointError,
        )
    codes = w[0]
    if not isinstance(codes, torch.Tensor) or codes.dim() != 3:
        _fail(
            f"{which}[0] has shape {tuple(getattr(codes, 'shape', ()))}",
            "stacked expert weights are 3-D [E, N, K/2] (fp4) or [E, N, K] (fp8)",
            "stack the experts with torch.stack",
            CheckpointError,
        )
    e, n = codes.shape[:2]
    flat_codes = codes.reshape(e * n, codes.shape[2])
    scale = w[1]
    if fmt == "nvfp4":
        if scale.dim() != 3 or scale.shape[:2] != codes.shape[:2]:
            _fail(
                f"{which}[1] has shape {tuple(scale.shape)}",
                "block scales are [E, N, K/16]",
                "stack the experts' scales",
                CheckpointError,
            )
        Nvfp4Weight(flat_codes, scale.reshape(e * n, -1), torch.ones((), device=codes.device))
        gs = w[2]
        if gs.dtype != torch.float32 or tuple(gs.shape) != (e,):
            _fail(
                f"{which}[2] is {gs.dtype} {tuple(gs.shape)}",
                f"NVFP4 global scales are float32 [E] = [{e}] (multipliers)",
                "stack one merged global scale per expert",
                CheckpointError,
            )
        if e and not bool((torch.isfinite(gs) & (gs > 0)).all()):
            _fail(
                f"{which}[2] has non-finite or non-positive values",
                "global scales are finite positive multipliers",
                "convert compressed-tensors weight_global_scale with 1/x",
                CheckpointError,
            )
    elif fmt == "mxfp4":
        if scale.dim() != 3 or scale.shape[:2] != codes.shape[:2]:
            _fail(
                f"{which}[1] has shape {tuple(scale.shape)}",
                "block scales are [E, N, K/32]",
                "stack the experts' scales",
                CheckpointError,
            )
        Mxfp4Weight(flat_codes, scale.reshape(e * n, -1))
    else:
        Fp8Weight(flat_codes, torch.ones((), device=codes.device))
        k = codes.shape[2]
        ok = (scale.dim() == 1 and scale.shape[0] == e) or (
            scale.dim() == 2 and tuple(scale.shape) == (e, n)
        )
        if block:
            bn, bk = block
            ok = tuple(scale.shape) == (e, -(-n // bn), -(-k // bk))
        if not ok or scale.dtype != torch.float32:
            _fail(
                f"{which}[1] is {scale.dtype} {tuple(scale.shape)} (block {block or None})",
                "FP8 expert scales are float32 [E] (tensor), [E, N] (channel) or "
                "[E, ceil(N/bn), ceil(K/bk)] with fp8_block_size=(bn, bk)",
                "pass the stacked scales and the checkpoint's weight_block_size",
                CheckpointError,
            )
        if scale.numel() and not bool((torch.isfinite(scale) & (scale >= 0)).all()):
            _fail(
                f"{which}[1] has NaN/inf or negative values",
                "scales are finite, >= 0",
                "re-export the checkpoint",
                CheckpointError,
            )


def _dims(fmt: str, w: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    """(E, N, K) of a stacked weight."""
    e, n, kk = w[0].shape
    return e, n, kk if fmt == "fp8" else 2 * kk


def _scale_kind(fmt: str, w: Sequence[torch.Tensor]) -> str | None:
    if fmt != "fp8":
        return None
    return {1: "tensor", 2: "channel", 3: "block"}[w[1].dim()]


# ---------------------------------------------------------------------------------------------
# Checkpoint reading


class _Subset(Mapping[str, torch.Tensor]):
    """A view of a state dict restricted to some keys (read_linear scans only those)."""

    def __init__(self, base: Mapping[str, torch.Tensor], keys: Sequence[str]) -> None:
        self._base = base
        self._keys = list(keys)
        self._set = set(keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._set:
            raise KeyError(key)
        return self._base[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._set


_NAMINGS = (
    ("gate_proj", "up_proj", "down_proj"),  # Qwen, DeepSeek, most HF MoEs
    ("w1", "w3", "w2"),  # Mixtral: w1 = gate, w3 = up, w2 = down
)


# ---------------------------------------------------------------------------------------------
# The layer


class QuantMoE(FixedDtypeBuffers):
    """Routed experts with quantized weights (NVFP4, MXFP4 or FP8) on the kernel ``select()``
    picks; the router itself (a small unquantized linear) stays the engine's.

    Build it from per-expert weights (``gate``, ``up``, ``down``: lists of Nvfp4Weight /
    Mxfp4Weight / Fp8Weight, one per expert held; non-gated activations take ``up`` and
    ``down`` only), from stacked canonical tensors (``w13``, ``w2`` and ``format``), or with
    :meth:`from_checkpoint`.

    ``num_experts`` is the router's width (all experts of the model); ``expert_ids`` the global
    ids this layer holds, in local order (default: all of them). Routing options as in
    :func:`route`. ``w13_bias`` [E, 2I] (gate then up) and ``w2_bias`` [E, H] are float32.
    """

    def __init__(
        self,
        gate: Sequence[QuantWeight] | None = None,
        up: Sequence[QuantWeight] | None = None,
        down: Sequence[QuantWeight] | None = None,
        *,
        w13: Sequence[torch.Tensor] | None = None,
        w2: Sequence[torch.Tensor] | None = None,
        format: str | None = None,
        fp8_block_size: tuple[int, int] | None = None,
        top_k: int,
        num_experts: int | None = None,
        expert_ids: Sequence[int] | torch.Tensor | None = None,
        activation: str = "silu",
        activation_params: Sequence[float] | None = None,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        scoring: Scoring = "softmax",
        renormalize: bool = False,
        n_group: int | None = None,
        topk_group: int | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        routed_scaling_factor: float = 1.0,
        scheme: Scheme | str | None = None,
        act_dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str | None = None,
        policy: Policy | str | Path | None = None,
        settings: Settings | None = None,
        validate_ids: bool = True,
    ) -> None:
        super().__init__()
        spec = get_activation(activation)
        self.activation = spec.name
        params = tuple(activation_params) if activation_params is not None else ()
        self._params = [float(p) for p in (params or spec.default_params)]
        self.act_dtype = parse_act_dtype(act_dtype)
        self.validate_ids = validate_ids

        stacked13, stacked2, fmt, block, scheme_guess = self._canonical(
            gate, up, down, w13, w2, format, fp8_block_size, spec.gated
        )
        self.format = fmt
        _validate_stacked(fmt, stacked13, "w13", block)
        _validate_stacked(fmt, stacked2, "w2", block)
        e, n13, hidden = _dims(fmt, stacked13)
        e2, n2, k2 = _dims(fmt, stacked2)
        inter = n13 // 2 if spec.gated else n13
        if e2 != e:
            _fail(
                f"w13 holds {e} experts but w2 holds {e2}",
                "gate/up and down stacks have one entry per expert held",
                "pass the same experts to both",
                CheckpointError,
            )
        if (spec.gated and n13 % 2) or n2 != hidden or k2 != inter:
            _fail(
                f"w13 is [E, {n13}, {hidden}] and w2 is [E, {n2}, {k2}] for a "
                f"{'gated' if spec.gated else 'non-gated'} activation ({spec.name})",
                "w13 is [E, 2I (gated) or I, H] and w2 is [E, H, I]",
                "check the activation and that down belongs to the same layer",
                CheckpointError,
            )
        self.num_local_experts, self.hidden_size, self.intermediate_size = e, hidden, inter
        self.num_experts = int(num_experts) if num_experts is not None else e
        held = self._held(expert_ids, e, self.num_experts)
        self.routing = RoutingConfig(
            int(top_k),
            scoring,
            bool(renormalize),
            n_group,
            topk_group,
            float(routed_scaling_factor),
        )
        self.routing.check(self.num_experts)
        self.top_k = self.routing.top_k

        if scheme is None:
            scheme = scheme_guess
        target = target_device(device, stacked13[0].device)
        profile = profile_for(target, device)
        decision = select(
            fmt,
            "moe",
            self.act_dtype,
            scheme,
            n=inter,
            k=hidden,
            experts=e,
            scale_kind=_scale_kind(fmt, stacked13),
            device=profile,
            settings=settings,
            policy=policy,
        )
        get_backend(decision.backend).refuse_simulated(decision.device)
        self.decision: Decision = decision
        self.backend = decision.backend
        # the backend's own stacks (the triton backend repacks NVFP4 experts; same bytes)
        prepared = get_backend(decision.backend).prepare_moe(
            [t.detach().to(target).contiguous() for t in stacked13],
            [t.detach().to(target).contiguous() for t in stacked2],
            _NAMES[fmt],
            [0, *block],
            decision.request,
            gated=spec.gated,
        )
        self._meta = list(prepared.meta)
        self._names13 = tuple(f"w13_{n}" for n in prepared.names)
        self._names2 = tuple(f"w2_{n}" for n in prepared.names)
        for name, t in zip(
            self._names13 + self._names2, [*prepared.w13, *prepared.w2], strict=True
        ):
            self.register_buffer(name, t)
        self.register_buffer("w13_bias", self._bias(w13_bias, (e, n13), "w13_bias", target))
        self.register_buffer("w2_bias", self._bias(w2_bias, (e, hidden), "w2_bias", target))
        if e_score_correction_bias is not None:
            if tuple(e_score_correction_bias.shape) != (self.num_experts,):
                _fail(
                    f"e_score_correction_bias has shape {tuple(e_score_correction_bias.shape)}",
                    f"it has one value per expert of the model: ({self.num_experts},)",
                    "pass the router's e_score_correction_bias",
                    CheckpointError,
                )
            e_score_correction_bias = e_score_correction_bias.detach().to(target, torch.float32)
        self.register_buffer("e_score_correction_bias", e_score_correction_bias)
        self.expert_ids: tuple[int, ...] = tuple(held)
        expert_map = None
        if list(held) != list(range(self.num_experts)):
            expert_map = torch.full((self.num_experts,), -1, dtype=torch.int32)
            expert_map[torch.tensor(held, dtype=torch.long)] = torch.arange(e, dtype=torch.int32)
            expert_map = expert_map.to(target)
        self.register_buffer("expert_map", expert_map)

    # -- construction helpers -------------------------------------------------------------------

    @staticmethod
    def _canonical(
        gate: Sequence[QuantWeight] | None,
        up: Sequence[QuantWeight] | None,
        down: Sequence[QuantWeight] | None,
        w13: Sequence[torch.Tensor] | None,
        w2: Sequence[torch.Tensor] | None,
        fmt: str | None,
        fp8_block_size: tuple[int, int] | None,
        gated: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], str, tuple, Scheme]:
        """Stacked tensors, format, fp8 block and the scheme the weights imply."""
        if w13 is not None or w2 is not None:
            if gate is not None or up is not None or down is not None or w13 is None or w2 is None:
                _fail(
                    "QuantMoE got both per-expert weights and stacked tensors (or only one stack)",
                    "pass either gate/up/down lists or both w13 and w2 stacks (with format)",
                    "pick one form",
                )
            if fmt is None:
                _fail(
                    "stacked tensors without format=",
                    "say which format they are",
                    "pass format='nvfp4', 'mxfp4' or 'fp8'",
                )
            name = get_format(fmt).name  # type: ignore[arg-type]
            block = tuple(int(v) for v in fp8_block_size) if fp8_block_size else ()
            default = Scheme.WEIGHT_ACT if name == "fp8" else Scheme.WEIGHT_ONLY
            return list(w13), list(w2), name, block, default  # type: ignore[arg-type]
        first = up if not gated else gate
        if first is None or down is None or (gated and up is None):
            need = "gate, up and down" if gated else "up and down"
            _fail(
                "QuantMoE got no expert weights",
                f"a {'gated' if gated else 'non-gated'} MoE takes per-expert {need} lists, or "
                "w13 / w2 stacks",
                "pass them, or use QuantMoE.from_checkpoint",
            )
        if not gated and gate is not None:
            _fail(
                "gate weights given for a non-gated activation",
                "non-gated experts have one first projection (pass it as up=)",
                "drop gate=, or pick a gated activation",
            )
        lists = {"down": list(down)}  # type: ignore[arg-type]
        lists["up"] = list(up)  # type: ignore[arg-type]
        if gated:
            lists["gate"] = list(gate)  # type: ignore[arg-type]
        counts = {k: len(v) for k, v in lists.items()}
        if len(set(counts.values())) != 1 or counts["down"] == 0:
            _fail(
                f"expert counts differ or are zero: {counts}",
                "there is one gate, up and down weight per expert held",
                "pass complete per-expert lists",
                CheckpointError,
            )
        fmts = {format_of(w) for v in lists.values() for w in v}
        if len(fmts) != 1:
            _fail(
                f"experts mix formats {sorted(fmts)}",
                "one format per MoE layer",
                "re-export the checkpoint",
                CheckpointError,
            )
        name = fmts.pop()
        if gated:
            fused = [
                _merge_gate_up(g, u, i)
                for i, (g, u) in enumerate(zip(lists["gate"], lists["up"], strict=True))
            ]
        else:
            fused = lists["up"]
        s13, b13 = _stack(name, fused, "w13")
        s2, b2 = _stack(name, lists["down"], "w2")
        if b13 != b2 and b13 and b2:
            _fail(
                f"w13 FP8 blocks {b13} differ from w2 blocks {b2}",
                "one block size per layer",
                "re-export the checkpoint",
                CheckpointError,
            )
        block = b13 or b2
        if bool(b13) != bool(b2):
            _fail(
                "only one of gate/up and down is block-scaled FP8",
                "both stacks of a layer use one FP8 scale layout family",
                "re-export the checkpoint",
                CheckpointError,
            )
        has_input = any(
            getattr(w, "input_scale", None) is not None for v in lists.values() for w in v
        )
        scheme = Scheme.WEIGHT_ACT if (has_input or name == "fp8") else Scheme.WEIGHT_ONLY
        return s13, s2, name, block, scheme

    @staticmethod
    def _held(expert_ids: Sequence[int] | torch.Tensor | None, e: int, total: int) -> list[int]:
        if expert_ids is None:
            if e != total:
                _fail(
                    f"the layer holds {e} experts but num_experts={total}",
                    "holding a subset (expert parallelism) needs the global ids held",
                    "pass expert_ids=[...] (global ids, in local order)",
                    CheckpointError,
                )
            return list(range(e))
        ids = [
            int(i)
            for i in (expert_ids.tolist() if isinstance(expert_ids, torch.Tensor) else expert_ids)
        ]
        if len(ids) != e:
            _fail(
                f"expert_ids lists {len(ids)} experts but the weights hold {e}",
                "one global id per expert held, in local order",
                "pass the ids of the experts whose weights you passed",
                CheckpointError,
            )
        bad = [i for i in ids if not 0 <= i < total]
        if bad or len(set(ids)) != len(ids):
            _fail(
                f"expert_ids {ids[:8]}{'...' if len(ids) > 8 else ''} has out-of-range "
                f"({bad[:4]}) or repeated ids",
                f"distinct global ids in [0, num_experts={total})",
                "pass this rank's expert ids",
                ConfigurationError,
            )
        return ids

    @staticmethod
    def _bias(
        bias: torch.Tensor | None, shape: tuple[int, int], name: str, target: torch.device
    ) -> torch.Tensor | None:
        if bias is None:
            return None
        if tuple(bias.shape) != shape or not bias.is_floating_point():
            _fail(
                f"{name} is {bias.dtype} {tuple(bias.shape)}",
                f"{name} is a float tensor {list(shape)} (gate then up rows for w13)",
                "stack the experts' biases",
                CheckpointError,
            )
        if not bool(torch.isfinite(bias).all()):
            _fail(
                f"{name} contains NaN/inf",
                "biases are finite",
                "check the checkpoint",
                CheckpointError,
            )
        return bias.detach().to(device=target, dtype=torch.float32).contiguous()

    @classmethod
    def from_checkpoint(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        prefix: str,
        quant_config: object = None,
        *,
        num_experts: int,
        top_k: int,
        activation: str = "silu",
        expert_ids: Sequence[int] | None = None,
        act_dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> QuantMoE:
        """Load the experts under ``prefix`` (e.g. ``model.layers.3.mlp``).

        Per-expert tensors ``{prefix}.experts.{e}.gate_proj/up_proj/down_proj`` (Qwen,
        DeepSeek) or ``.w1/.w3/.w2`` (Mixtral), any convention ``read_linear`` reads (ModelOpt
        or compressed-tensors NVFP4, MXFP4, FP8), or gpt-oss's fused
        ``{prefix}.experts.gate_up_proj_blocks/_scales/_bias`` (interleaved gate/up rows,
        de-interleaved here) and ``down_proj_blocks/_scales/_bias``. Only the experts in
        ``expert_ids`` (default: all) are read. ``{prefix}.gate.e_score_correction_bias`` is
        picked up when present. Other keyword arguments go to the constructor.
        """
        config = resolve_quant_config(quant_config)
        prefix = prefix.rstrip(".")
        held = list(range(num_experts)) if expert_ids is None else [int(i) for i in expert_ids]
        spec = get_activation(activation)
        base = f"{prefix}.experts"
        corr_key = f"{prefix}.gate.e_score_correction_bias"
        if "e_score_correction_bias" not in kwargs and corr_key in state_dict:
            kwargs["e_score_correction_bias"] = state_dict[corr_key]
        common = dict(
            top_k=top_k,
            num_experts=num_experts,
            expert_ids=held,
            activation=activation,
            act_dtype=act_dtype,
            device=device,
        )
        if f"{base}.gate_up_proj_blocks" in state_dict or f"{base}.down_proj_blocks" in state_dict:
            w13, w2, b13, b2 = _read_gpt_oss(state_dict, base, held, num_experts, config)
            kwargs.setdefault("scheme", Scheme.WEIGHT_ONLY)
            return cls(w13=w13, w2=w2, format="mxfp4", w13_bias=b13, w2_bias=b2, **common, **kwargs)

        by_expert: dict[str, list[str]] = {}
        dot = base + "."
        for key in state_dict:
            if key.startswith(dot):
                idx, _, _ = key[len(dot) :].partition(".")
                by_expert.setdefault(idx, []).append(key)
        naming = _detect_naming(by_expert, base, held, spec.gated)
        gate_n, up_n, down_n = naming
        projections = (("gate", gate_n), ("up", up_n), ("down", down_n))
        if not spec.gated:
            projections = (("up", up_n), ("down", down_n))
        loaded: dict[str, list[LoadedLinear]] = {p: [] for p, _ in projections}
        for e in held:
            keys = by_expert.get(str(e), [])
            sub = _Subset(state_dict, keys)
            for role, name in projections:
                module = f"{base}.{e}.{name}"
                if not any(k.startswith(module + ".") for k in keys):
                    _fail(
                        f"missing expert tensors: nothing under '{module}.' (expert {e} of "
                        f"{num_experts}, {role} projection)",
                        f"every expert held has {', '.join(n for _, n in projections)}",
                        "pass the complete state dict (all shards), or the expert_ids this "
                        "rank really holds",
                        CheckpointError,
                    )
                quant = None
                if config is not None:
                    quant = config.layer(module)
                    if quant is None:
                        _fail(
                            f"{module!r} is not quantized in this checkpoint ({config.producer} "
                            "config excludes it or lists no scheme for it)",
                            "QuantMoE loads quantized experts only",
                            "run these experts with the engine's unquantized MoE",
                            CheckpointError,
                        )
                loaded[role].append(read_linear(sub, module, quant))
        schemes = {ld.scheme for v in loaded.values() for ld in v}
        if len(schemes) != 1:
            _fail(
                f"experts mix schemes {sorted(s.value for s in schemes)}",
                "one scheme per MoE layer",
                "check the checkpoint",
                CheckpointError,
            )
        kwargs.setdefault("scheme", schemes.pop())
        first = "gate" if spec.gated else "up"
        n_first = loaded[first][0].weight.shape[0]
        b13 = _stack_bias(
            [[ld.bias for ld in loaded[r]] for r in (("gate", "up") if spec.gated else ("up",))],
            n_first,
        )
        b2 = _stack_bias([[ld.bias for ld in loaded["down"]]], loaded["down"][0].weight.shape[0])
        kwargs.setdefault("w13_bias", b13)
        kwargs.setdefault("w2_bias", b2)
        return cls(
            [ld.weight for ld in loaded["gate"]] if spec.gated else None,
            [ld.weight for ld in loaded["up"]],
            [ld.weight for ld in loaded["down"]],
            **common,
            **kwargs,
        )

    # -- running ----------------------------------------------------------------------------------

    def _w13(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self._names13]

    def _w2(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self._names2]

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's routing of ``router_logits`` [M, num_experts]: global ids, weights."""
        r = self.routing
        if router_logits.dim() != 2 or router_logits.shape[-1] != self.num_experts:
            raise InputError(
                format_error(
                    f"router_logits has shape {tuple(router_logits.shape)}",
                    f"router logits are [tokens, num_experts={self.num_experts}]",
                    "pass the router's output for all experts of the model",
                )
            )
        return route(
            router_logits,
            r.top_k,
            scoring=r.scoring,
            renormalize=r.renormalize,
            n_group=r.n_group,
            topk_group=r.topk_group,
            e_score_correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=r.routed_scaling_factor,
        )

    def forward(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., H] -> [..., H]. Pass ``router_logits`` [tokens, num_experts] (routed here,
        the scaling factor applied once) or precomputed GLOBAL ``topk_ids`` and final
        ``topk_weights`` [tokens, k] (used as given: nothing is rescaled)."""
        ref = getattr(self, self._names13[0])
        x2 = activations_2d(x, self.act_dtype, self.hidden_size, "hidden_size", ref.device)
        lead = x.shape[:-1]
        m = x2.shape[0]
        if (router_logits is None) == (topk_ids is None):
            raise InputError(
                format_error(
                    "forward got "
                    + (
                        "both router_logits and topk_ids"
                        if topk_ids is not None
                        else "neither router_logits nor topk_ids"
                    ),
                    "pass router logits (routed by this layer) or precomputed topk_ids and "
                    "topk_weights",
                    "pass exactly one of them",
                )
            )
        if router_logits is not None:
            logits = router_logits.reshape(-1, router_logits.shape[-1])
            if logits.shape[0] != m:
                raise InputError(
                    format_error(
                        f"router_logits has {logits.shape[0]} rows but x has {m} tokens",
                        "one row of router logits per token",
                        "pass the router's output for this x",
                    )
                )
            ids, weights = self.route(logits)
        else:
            ids, weights = self._check_topk(topk_ids, topk_weights, m)  # type: ignore[arg-type]
        local = to_local_ids(ids, self.expert_map)
        y = torch.ops.quantdispatch.moe(
            x2,
            local,
            weights,
            self._w13(),
            self._w2(),
            self.w13_bias,
            self.w2_bias,
            self.backend,
            self.format,
            self.activation,
            self._params,
            self._meta,
        )
        return y.reshape(*lead, self.hidden_size)

    def _check_topk(
        self, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, m: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if topk_weights is None:
            raise InputError(
                format_error(
                    "topk_ids given without topk_weights",
                    "precomputed routing is ids and weights",
                    "pass both",
                )
            )
        ids = topk_ids.reshape(m, -1) if topk_ids.dim() != 2 else topk_ids
        if (
            ids.dim() != 2
            or ids.shape[0] != m
            or ids.dtype not in (torch.int32, torch.int64)
            or tuple(topk_weights.shape) != tuple(ids.shape)
            or not topk_weights.is_floating_point()
        ):
            raise InputError(
                format_error(
                    f"topk_ids is {ids.dtype} {tuple(ids.shape)} and topk_weights "
                    f"{topk_weights.dtype} {tuple(topk_weights.shape)} for {m} tokens",
                    "precomputed routing is int32/int64 ids and float weights, both [tokens, k]",
                    "pass the router's top-k ids and weights",
                )
            )
        if ids.shape[1] > self.num_experts:
            raise InputError(
                format_error(
                    f"topk_ids has k={ids.shape[1]} slots but the model has "
                    f"{self.num_experts} experts",
                    "top_k <= num_experts",
                    "pass the router's top-k",
                )
            )
        if ids.device != topk_weights.device or ids.device != self.w13_device:
            raise InputError(
                format_error(
                    f"topk_ids on {ids.device}, topk_weights on {topk_weights.device}, layer on "
                    f"{self.w13_device}",
                    "one device",
                    "move the routing tensors",
                )
            )
        if self.validate_ids and ids.numel() and not _tracing(ids):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_experts:
                raise InputError(
                    format_error(
                        f"topk_ids has values in [{lo}, {hi}]",
                        f"global expert ids are in [0, num_experts={self.num_experts})",
                        "pass global ids (this layer maps them to the experts it holds)",
                    )
                )
        return ids, topk_weights.to(torch.float32)

    @property
    def w13_device(self) -> torch.device:
        return getattr(self, self._names13[0]).device

    # -- reporting --------------------------------------------------------------------------------

    def device_bytes(self) -> int:
        """Bytes this layer holds (packed weights, scales, biases, maps)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        r = self.decision.request
        held = (
            f"{self.num_local_experts}/{self.num_experts}"
            if self.expert_map is not None
            else str(self.num_experts)
        )
        return (
            f"experts={held}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, format={self.format}, "
            f"scheme={r.scheme_label}, act_dtype={dtype_name(self.act_dtype)}, "
            f"activation={self.activation}, backend={self.backend}, "
            f"bias={self.w13_bias is not None or self.w2_bias is not None}, "
            f"scoring={self.routing.scoring}"
        )


def _detect_naming(
    by_expert: Mapping[str, list[str]], base: str, held: Sequence[int], gated: bool
) -> tuple[str, str, str]:
    """Which per-expert naming this checkpoint uses (from the first expert held)."""
    for e in held:
        keys = by_expert.get(str(e))
        if not keys:
            continue
        names = {k[len(f"{base}.{e}.") :].split(".")[0] for k in keys}
        for naming in _NAMINGS:
            if (naming[0] in names and gated) or naming[1] in names or naming[2] in names:
                return naming
        break
    found = sorted(by_expert)[:4]
    raise CheckpointError(
        format_error(
            f"missing expert tensors: found no experts {list(held)[:4]}... under '{base}.' "
            f"(expert indices present: {found or 'none'})",
            "experts are stored as {prefix}.experts.{e}.gate_proj/up_proj/down_proj, "
            ".w1/.w3/.w2 (Mixtral), or gpt-oss's {prefix}.experts.gate_up_proj_blocks",
            "check the prefix (e.g. model.layers.3.mlp, Mixtral: model.layers.3.block_sparse_moe)",
        )
    )


def _stack_bias(parts: list[list[torch.Tensor | None]], n: int) -> torch.Tensor | None:
    """Per-expert biases of each role (gate, up or down) -> [E, sum N] float32, or None."""
    if all(b is None for role in parts for b in role):
        return None
    experts = len(parts[0])
    device = next(b for role in parts for b in role if b is not None).device
    rows = []
    for e in range(experts):
        pieces = []
        for role in parts:
            b = role[e]
            pieces.append(b.to(torch.float32) if b is not None else torch.zeros(n, device=device))
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def _read_gpt_oss(
    sd: Mapping[str, torch.Tensor],
    base: str,
    held: Sequence[int],
    num_experts: int,
    config: Any,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """gpt-oss fused expert tensors -> canonical stacks (gate/up de-interleaved)."""
    if config is not None:
        quant = config.layer(f"{base}.gate_up_proj")
        if quant is not None and quant.format != "mxfp4":
            _fail(
                f"the quant config says {base} is {quant.format} but its tensors are gpt-oss "
                "MXFP4 blocks",
                "config and tensors describe one format",
                "pass this checkpoint's config",
                CheckpointError,
            )
    need = [f"{base}.{p}_{s}" for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales")]
    missing = [k for k in need if k not in sd]
    if missing:
        _fail(
            f"missing expert tensors {missing}",
            "gpt-oss experts are {prefix}.experts.gate_up_proj_blocks/_scales and "
            "down_proj_blocks/_scales (biases optional)",
            "pass the complete state dict",
            CheckpointError,
        )
    idx = torch.tensor(list(held), dtype=torch.long)

    def take(key: str, ndim: int) -> torch.Tensor:
        t = sd[key]
        if t.dim() != ndim or t.shape[0] != num_experts:
            _fail(
                f"{key} has shape {tuple(t.shape)}",
                f"gpt-oss stacks experts first: {ndim}-D with {num_experts} experts",
                "check num_experts and the checkpoint",
                CheckpointError,
            )
        return t.index_select(0, idx.to(t.device))

    gu_blocks = take(f"{base}.gate_up_proj_blocks", 4)
    gu_scales = take(f"{base}.gate_up_proj_scales", 3)
    d_blocks = take(f"{base}.down_proj_blocks", 4)
    d_scales = take(f"{base}.down_proj_scales", 3)
    if gu_blocks.shape[-1] != 16 or d_blocks.shape[-1] != 16 or gu_blocks.shape[1] % 2:
        _fail(
            f"gate_up_proj_blocks {tuple(gu_blocks.shape)}, down_proj_blocks "
            f"{tuple(d_blocks.shape)}",
            "gpt-oss blocks are [E, N, K/32, 16] bytes and gate_up has an even N (2I rows)",
            "check the checkpoint",
            CheckpointError,
        )
    e = len(held)

    def deinterleave(t: torch.Tensor) -> torch.Tensor:
        # rows [gate0, up0, gate1, up1, ...] -> [gate0, gate1, ...; up0, up1, ...]
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)

    w13 = [
        deinterleave(gu_blocks).reshape(e, gu_blocks.shape[1], -1).contiguous(),
        deinterleave(gu_scales).contiguous(),
    ]
    w2 = [d_blocks.reshape(e, d_blocks.shape[1], -1).contiguous(), d_scales.contiguous()]
    b13 = b2 = None
    if f"{base}.gate_up_proj_bias" in sd:
        b13 = deinterleave(take(f"{base}.gate_up_proj_bias", 2)).to(torch.float32)
    if f"{base}.down_proj_bias" in sd:
        b2 = take(f"{base}.down_proj_bias", 2).to(torch.float32)
    return w13, w2, b13, b2

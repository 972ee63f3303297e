"""``QuantMoE``: a quantized mixture-of-experts layer.

Same life cycle as :class:`~quantdispatch.layers.QuantLinear`: the kernel decision is made once
at construction (``select(fmt, op="moe", ...)``), the layer keeps only the stacked packed
expert tensors as the backend prepared them (its buffers: a state-dict round trip restores it;
the triton backend on an SM 8.0+ GPU repacks NVFP4 experts, same bytes), and ``forward`` runs
``torch.ops.quantdispatch.moe`` (a custom op: torch.compile(fullgraph=True) and CUDA graphs see
one opaque call).

The stacks' layout and checks are :mod:`quantdispatch.moe.stacking`; routing is
:mod:`quantdispatch.moe.routing`; reading a rank's experts from a checkpoint (expert and tensor
parallel) is :func:`quantdispatch.checkpoints.read_moe_shard`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from quantdispatch import ops  # noqa: F401 (registers torch.ops.quantdispatch.*)
from quantdispatch.backends import get_backend
from quantdispatch.backends.base import BoundMoe, CheckpointMeta, ExpertStacks, MoeCall
from quantdispatch.checkpoints import MoeShard, QuantWeight, read_moe_shard
from quantdispatch.checkpoints.split_plan import tp_of_group
from quantdispatch.errors import CheckpointError, ConfigurationError, InputError, format_error
from quantdispatch.layers.base import (
    QuantLayer,
    activations_2d,
    direct_call_ok,
    format_of,
    resolve_quant_config,
)
from quantdispatch.moe.activations import get_activation
from quantdispatch.moe.routing import (
    RoutingConfig,
    Scoring,
    build_expert_map,
    check_topk,
    held_experts,
    route,
    to_local_ids,
)
from quantdispatch.moe.stacking import (
    STACK_NAMES,
    check_bias,
    expert_lists,
    given_stacks,
    layer_dims,
    scale_kind,
    stack_expert_lists,
    validate_stacked,
)
from quantdispatch.policy import Policy
from quantdispatch.request import Scheme, dtype_name, parse_act_dtype
from quantdispatch.settings import Settings

__all__ = ["QuantMoE"]

logger = logging.getLogger("quantdispatch")


class QuantMoE(QuantLayer):
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

        stacked13, stacked2, fmt, block, scheme_guess = _canonical(
            gate, up, down, w13, w2, format, fp8_block_size, spec.gated
        )
        self.format = fmt
        validate_stacked(fmt, stacked13, "w13", block)
        validate_stacked(fmt, stacked2, "w2", block)
        e, _, hidden, inter = layer_dims(fmt, stacked13, stacked2, spec.gated, spec.name)
        self.num_local_experts, self.hidden_size, self.intermediate_size = e, hidden, inter
        self.num_experts = int(num_experts) if num_experts is not None else e
        held = held_experts(expert_ids, e, self.num_experts)
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
        backend, target = self._decide(
            fmt,
            "moe",
            self.act_dtype,
            scheme,
            n=inter,
            k=hidden,
            experts=e,
            scale_kind=scale_kind(fmt, stacked13),
            device=device,
            weight_device=stacked13[0].device,
            settings=settings,
            policy=policy,
        )
        self._hold_experts(
            backend, target, fmt, block, spec.gated, (stacked13, stacked2), (w13_bias, w2_bias)
        )
        self._hold_router(e_score_correction_bias, held, target)

    def _hold_experts(
        self,
        backend: Any,
        target: torch.device,
        fmt: str,
        block: Sequence[int] | None,
        gated: bool,
        stacks: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
        biases: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> None:
        """The backend's own expert stacks (the triton backend repacks NVFP4 experts; same
        bytes) and the expert biases, as buffers."""
        stacked13, stacked2 = stacks
        stacks = ExpertStacks(
            [t.detach().to(target).contiguous() for t in stacked13],
            [t.detach().to(target).contiguous() for t in stacked2],
            STACK_NAMES[fmt],
            CheckpointMeta(block_size=tuple(block) if block else None),  # type: ignore[arg-type]
            gated,
        )
        prepared = backend.prepare_moe(stacks, self.decision.request)
        self._names13 = tuple(f"w13_{n}" for n in prepared.names)
        self._names2 = tuple(f"w2_{n}" for n in prepared.names)
        held = [*prepared.w13, *prepared.w2]
        self._hold(self._names13 + self._names2, held, prepared.layout, prepared.meta)
        e, n13 = self.num_local_experts, self.intermediate_size * (2 if gated else 1)
        self.register_buffer("w13_bias", check_bias(biases[0], (e, n13), "w13_bias", target))
        self.register_buffer(
            "w2_bias", check_bias(biases[1], (e, self.hidden_size), "w2_bias", target)
        )

    def _hold_router(
        self, correction: torch.Tensor | None, held: Sequence[int], target: torch.device
    ) -> None:
        """The router's score correction bias and the global -> local expert map, as buffers."""
        if correction is not None:
            if tuple(correction.shape) != (self.num_experts,):
                raise CheckpointError(
                    format_error(
                        f"e_score_correction_bias has shape {tuple(correction.shape)}",
                        f"it has one value per expert of the model: ({self.num_experts},)",
                        "pass the router's e_score_correction_bias",
                    )
                )
            correction = correction.detach().to(target, torch.float32)
        self.register_buffer("e_score_correction_bias", correction)
        self.expert_ids: tuple[int, ...] = tuple(held)
        self.register_buffer("expert_map", build_expert_map(held, self.num_experts, target))

    # -- construction helpers -------------------------------------------------------------------

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
        tp_rank: int | None = None,
        tp_size: int | None = None,
        process_group: object = None,
        align: int = 1,
        act_dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> QuantMoE:
        """Load the experts under ``prefix`` (e.g. ``model.layers.3.mlp``): per-expert
        ``{prefix}.experts.{e}.gate_proj/up_proj/down_proj`` (Qwen, DeepSeek) or ``.w1/.w3/.w2``
        (Mixtral) in any convention ``read_linear`` reads, or gpt-oss's fused
        ``{prefix}.experts.gate_up_proj_*`` / ``down_proj_*`` (gate/up de-interleaved at load).

        Expert parallel: only the experts in ``expert_ids`` (global ids; default: all) are read.
        Tensor parallel: ``tp_rank`` of ``tp_size`` reads only its slice of the intermediate size
        I (whole scale groups, as even as possible; ``align``: whole multiples of it too, 64
        keeps every rank on the repacked MoE kernels); w2's bias is rank 0's; ``process_group``:
        the rank's tensor-parallel group, checked against tp_rank / tp_size. Every rank routes
        all tokens; the ranks' outputs summed (all-reduce) are the whole layer's output.
        ``{prefix}.gate.e_score_correction_bias`` is picked up when present; other keyword
        arguments go to the constructor (:meth:`from_shard`).
        """
        tp_rank, tp_size = tp_of_group(tp_rank, tp_size, process_group)
        config = resolve_quant_config(quant_config)
        prefix = prefix.rstrip(".")
        shard = read_moe_shard(
            state_dict,
            prefix,
            config,
            num_experts=num_experts,
            expert_ids=expert_ids,
            gated=get_activation(activation).gated,
            tp_rank=tp_rank,
            tp_size=tp_size,
            align=align,
        )
        corr_key = f"{prefix}.gate.e_score_correction_bias"
        if "e_score_correction_bias" not in kwargs and corr_key in state_dict:
            kwargs["e_score_correction_bias"] = state_dict[corr_key]
        return cls.from_shard(
            shard,
            top_k=top_k,
            num_experts=num_experts,
            activation=activation,
            act_dtype=act_dtype,
            device=device,
            **kwargs,
        )

    @classmethod
    def from_shard(cls, shard: MoeShard, **kwargs: Any) -> QuantMoE:
        """The layer holding a :class:`~quantdispatch.checkpoints.MoeShard` (its experts, I
        slice, biases and scheme); keyword arguments go to the constructor (``top_k``,
        ``num_experts``, ``activation``, routing, ``device`` ...)."""
        kwargs.setdefault("scheme", shard.scheme)
        kwargs.setdefault("w13_bias", shard.w13_bias)
        kwargs.setdefault("w2_bias", shard.w2_bias)
        return cls(
            w13=shard.w13,
            w2=shard.w2,
            format=shard.format,
            fp8_block_size=shard.fp8_block_size,
            expert_ids=shard.expert_ids,
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
            ids, weights = check_topk(
                topk_ids,  # type: ignore[arg-type]
                topk_weights,
                m,
                self.num_experts,
                self.w13_device,
                self.validate_ids,
            )
        local = to_local_ids(ids, self.expert_map)
        if direct_call_ok(x2):  # eager inference: the bound call path
            bound = self._bound or self.bound()
            return bound(x2, local, weights).reshape(*lead, self.hidden_size)
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
            self._meta_args,
            self.decision.pdl,
        )
        return y.reshape(*lead, self.hidden_size)

    def bound(self) -> BoundMoe:
        """The layer's bound call path (made at the first eager call, kept until a buffer
        moves): what ``forward`` runs in eager inference, for the same result as the op."""
        bound = self._bound
        if bound is None:
            x = torch.empty(0)  # placeholders: the bound call takes x, ids and weights
            template = MoeCall(
                x, x, x, tuple(self._w13()), tuple(self._w2()), self.w13_bias, self.w2_bias,
                self.format, self.activation, tuple(self._params), self._layout, self._meta,
                self.decision.pdl,
            )  # fmt: skip
            bound = get_backend(self.backend).bind_moe(template)
            self.__dict__["_bound"] = bound
        return bound

    @property
    def w13_device(self) -> torch.device:
        return getattr(self, self._names13[0]).device

    # -- reporting --------------------------------------------------------------------------------

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
    """Stacked tensors, format, fp8 block and the scheme the weights imply, from either form."""
    if w13 is not None or w2 is not None:
        if gate is not None or up is not None or down is not None or w13 is None or w2 is None:
            raise ConfigurationError(
                format_error(
                    "QuantMoE got both per-expert weights and stacked tensors (or only one stack)",
                    "pass either gate/up/down lists or both w13 and w2 stacks (with format)",
                    "pick one form",
                )
            )
        return given_stacks(w13, w2, fmt, fp8_block_size)
    lists = expert_lists(gate, up, down, gated)
    fmts = {format_of(w) for v in lists.values() for w in v}
    if len(fmts) != 1:
        raise CheckpointError(
            format_error(
                f"experts mix formats {sorted(fmts)}",
                "one format per MoE layer",
                "re-export the checkpoint",
            )
        )
    name = fmts.pop()
    s13, s2, block, scheme = stack_expert_lists(name, lists, gated)
    return s13, s2, name, block, scheme

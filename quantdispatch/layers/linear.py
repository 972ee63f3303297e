"""``QuantLinear``: a quantized linear layer that picks its kernel through ``select()``.

Life cycle: the decision is made once at construction (format, scheme, activation dtype, shape
and the layer's device), the weights are prepared once for the chosen backend on that device
(with the decision's options of that backend), and ``forward`` calls
``torch.ops.quantdispatch.linear`` (a custom op with a fake implementation, so
torch.compile(fullgraph=True) and CUDA graphs work). The layer holds only packed weights and
scales as buffers, never a dequantized copy (FP8 compute's opt-in resident copy is a lossy
FP8 one, counted by ``device_bytes``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantdispatch import ops  # noqa: F401 (registers torch.ops.quantdispatch.*)
from quantdispatch.backends import get_backend
from quantdispatch.backends.base import BoundLinear, LinearBinding, as_op_tensors
from quantdispatch.checkpoints import (
    LoadedLinear,
    QuantWeight,
    TpSplit,
    read_dense_shard,
    read_linear_split,
)
from quantdispatch.checkpoints.split_plan import Parallel, tp_of_group
from quantdispatch.errors import CheckpointError, ConfigurationError, format_error
from quantdispatch.formats import Fp8Weight, quantize_fp8, quantize_mxfp4, quantize_nvfp4
from quantdispatch.layers.base import (
    QuantLayer,
    activations_2d,
    direct_call_ok,
    format_of,
    resolve_quant_config,
    target_device,
)
from quantdispatch.policy import Policy
from quantdispatch.request import Request, Scheme, dtype_name, parse_act_dtype
from quantdispatch.settings import Settings

__all__ = ["QuantLinear", "load_linear"]

logger = logging.getLogger("quantdispatch")


def _module_name(prefix: str) -> str:
    prefix = prefix.rstrip(".")
    return prefix[: -len(".weight")] if prefix.endswith(".weight") else prefix


class QuantLinear(QuantLayer):
    """y = x @ W.T + b with W quantized (NVFP4, MXFP4 or FP8), on the kernel ``select()`` picks.

    ``act_dtype`` is the activation dtype the layer is built for (the decision depends on it:
    a T4 has no bf16 tensor cores). ``device`` is where it runs (see :func:`target_device`);
    a preset name there is refused: presets explain, they do not run.
    """

    def __init__(
        self,
        weight: QuantWeight,
        *,
        bias: torch.Tensor | None = None,
        scheme: Scheme | str | None = None,
        act_dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str | None = None,
        policy: Policy | str | Path | None = None,
        settings: Settings | None = None,
        emulate_activations: bool = False,
    ) -> None:
        super().__init__()
        fmt = format_of(weight)
        self.act_dtype = parse_act_dtype(act_dtype)
        n, k = weight.shape
        if scheme is None:
            has_input = getattr(weight, "input_scale", None) is not None
            scheme = Scheme.WEIGHT_ACT if has_input else Scheme.WEIGHT_ONLY
            if fmt == "fp8":
                scheme = Scheme.WEIGHT_ACT
        scale_kind = weight.scale_kind if isinstance(weight, Fp8Weight) else None
        backend, target = self._decide(
            fmt,
            "linear",
            self.act_dtype,
            scheme,
            n=n,
            k=k,
            scale_kind=scale_kind,
            device=device,
            weight_device=weight.packed.device if fmt != "fp8" else weight.weight.device,
            settings=settings,
            policy=policy,
        )
        decision = self.decision
        if emulate_activations and decision.backend != "reference":
            raise ConfigurationError(
                format_error(
                    f"emulate_activations=True but the decision is {decision.backend!r}",
                    "activation emulation is a mode of the reference backend (the W4A4 / W8A8 "
                    "contract native kernels are compared with)",
                    "force it with settings=load_settings(backend={'nvfp4': 'reference'}) or "
                    "QUANTDISPATCH_BACKEND_<FORMAT>=reference",
                )
            )
        weight = weight.to(target)
        if emulate_activations:
            prepared = backend.prepare(weight, decision.request, emulate_activations=True)  # type: ignore[call-arg]
        else:
            prepared = backend.prepare(weight, decision.request, options=decision.options)
        self.format = fmt
        self.in_features, self.out_features = k, n
        self._names = tuple(prepared.names)
        self._hold(prepared.names, prepared.tensors, prepared.layout, prepared.meta)
        if bias is not None:
            bias = bias.detach()
            if bias.shape != (n,):
                raise CheckpointError(
                    format_error(
                        f"bias has shape {tuple(bias.shape)}",
                        f"a linear with N = {n} outputs has a bias of shape ({n},)",
                        "pass this layer's own bias",
                    )
                )
            if not bias.is_floating_point() or not bool(torch.isfinite(bias).all()):
                raise CheckpointError(
                    format_error(
                        f"bias is {bias.dtype} or contains NaN/inf",
                        "a bias is finite floating point",
                        "check the checkpoint",
                    )
                )
            bias = bias.to(device=target, dtype=torch.float32)
        self.register_buffer("bias", bias)

    # -- construction helpers -------------------------------------------------------------------

    @classmethod
    def from_loaded(cls, loaded: LoadedLinear, **kwargs: Any) -> QuantLinear:
        kwargs.setdefault("scheme", loaded.scheme)
        return cls(loaded.weight, bias=loaded.bias, **kwargs)

    @classmethod
    def from_checkpoint(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        prefix: str | Sequence[str],
        quant_config: object = None,
        *,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        process_group: object = None,
        parallel: Parallel = "column",
        heads: tuple[int, int] | None = None,
        segments: Sequence[int] | None = None,
        align: int = 1,
        act_dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> QuantLinear:
        """Load the layer at ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``) from a state
        dict (or ``SafetensorsStateDict``). A list of prefixes loads a fused layer (q/k/v,
        gate/up): shards are concatenated along N with their per-tensor scales merged exactly.

        Tensor parallel (``tp_size`` > 1): this rank's shard, reading only its slice
        (:func:`~quantdispatch.checkpoints.read_linear_shard` has the rules).
        ``parallel="column"`` splits N (gather the ranks' outputs); fused q/k/v split per head
        group with ``heads=(q heads, kv heads)``, one tensor holding fused parts with
        ``segments`` (its parts' row counts). ``parallel="row"`` splits K in whole scale groups
        (feed the rank its input columns, sum the ranks' outputs); the bias is rank 0's.
        ``align``: splits in whole multiples of it too. ``process_group``: the rank's
        torch.distributed tensor-parallel group; tp_rank / tp_size are checked against it (or
        taken from it when left out).
        """
        tp_rank, tp_size = tp_of_group(tp_rank, tp_size, process_group)
        config = resolve_quant_config(quant_config)
        prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
        modules = [_module_name(p) for p in prefixes]
        quants = []
        for module in modules:
            quant = None
            if config is not None:
                quant = config.layer(module)
                if quant is None:
                    raise CheckpointError(
                        format_error(
                            f"{module!r} is not quantized in this checkpoint ({config.producer} "
                            "config excludes it or lists no scheme for it)",
                            "QuantLinear loads quantized layers only",
                            "load it as torch.nn.Linear (quantdispatch.layers.load_linear does "
                            "this for you)",
                        )
                    )
            quants.append(quant)
        split = TpSplit(tp_rank, tp_size, parallel, heads, segments, align)
        loaded = read_linear_split(state_dict, modules, quants, split)
        return cls.from_loaded(loaded, act_dtype=act_dtype, device=device, **kwargs)

    @classmethod
    def from_float(
        cls,
        linear: nn.Linear,
        format: str,
        *,
        fp8_scales: str = "channel",
        act_dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> QuantLinear:
        """Quantize an ``nn.Linear`` (weight-only: no activation calibration happens here)."""
        if not isinstance(linear, nn.Linear):
            raise ConfigurationError(
                format_error(
                    f"from_float got a {type(linear).__name__}",
                    "it quantizes a torch.nn.Linear",
                    "pass the Linear module",
                )
            )
        from quantdispatch.formats import get_format

        fmt = get_format(format).name
        w = linear.weight.detach()
        if fmt == "nvfp4":
            weight: QuantWeight = quantize_nvfp4(w)
            scheme = Scheme.WEIGHT_ONLY
        elif fmt == "mxfp4":
            weight = quantize_mxfp4(w)
            scheme = Scheme.WEIGHT_ONLY
        else:
            weight = quantize_fp8(w, kind=fp8_scales)  # type: ignore[arg-type]
            scheme = Scheme.WEIGHT_ONLY
        if act_dtype is None:
            act_dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        kwargs.setdefault("scheme", scheme)
        return cls(weight, bias=linear.bias, act_dtype=act_dtype, device=device, **kwargs)

    # -- running ----------------------------------------------------------------------------------

    def _tensors(self) -> list[torch.Tensor]:
        return as_op_tensors([getattr(self, n) for n in self._names])

    def bound(self) -> BoundLinear:
        """The layer's bound call path (made at the first eager call, kept until a buffer
        moves): what ``forward`` runs in eager inference, for the same result as the op."""
        bound = self._bound
        if bound is None:
            ref = getattr(self, self._names[0])
            bound = get_backend(self.backend).bind_linear(
                LinearBinding(
                    tuple(self._tensors()), self.bias, self.format, self._layout, self._meta,
                    self.decision.pdl, ref.device,
                )
            )  # fmt: skip
            self.__dict__["_bound"] = bound
            # CUDA layers compare the input's device index per call; others check in full
            self.__dict__["_device_index"] = ref.get_device() if ref.is_cuda else None
        return bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        if direct_call_ok(x):  # eager inference: the bound call path
            bound = self._bound or self.bound()
            if (
                x.dtype is not self.act_dtype
                or not x.dim()
                or x.shape[-1] != k
                or x.get_device() != self._device_index
            ):
                ref = getattr(self, self._names[0])
                activations_2d(x, self.act_dtype, k, "in_features", ref.device)  # raises
            if x.dim() == 2:
                return bound(x if x.stride(-1) == 1 else x.contiguous())
            y = bound(x.reshape(-1, k) if x.stride(-1) == 1 else x.reshape(-1, k).contiguous())
            return y.view(*x.shape[:-1], self.out_features)
        ref = getattr(self, self._names[0])
        x2 = activations_2d(x, self.act_dtype, k, "in_features", ref.device)
        y = torch.ops.quantdispatch.linear(
            x2,
            self._tensors(),
            self.bias,
            self.backend,
            self.format,
            self._meta_args,
            self.out_features,
            self.decision.pdl,
        )
        return y.reshape(*x.shape[:-1], self.out_features)

    # -- reporting --------------------------------------------------------------------------------

    @property
    def request(self) -> Request:
        return self.decision.request

    def extra_repr(self) -> str:
        r = self.decision.request
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}, scheme={r.scheme_label}, "
            f"act_dtype={dtype_name(self.act_dtype)}, backend={self.backend}, "
            f"bias={self.bias is not None}" + self._meta.layer_note()
        )


def load_linear(
    state_dict: Mapping[str, torch.Tensor],
    prefix: str | Sequence[str],
    quant_config: object = None,
    *,
    act_dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """The layer at ``prefix`` as the checkpoint has it: a ``QuantLinear`` when it is quantized,
    a plain ``nn.Linear`` (in ``act_dtype``) when the config leaves it unquantized. Other
    keyword arguments are :meth:`QuantLinear.from_checkpoint`'s; its tensor-parallel ones
    (``tp_rank``, ``tp_size``, ``process_group``, ``parallel``, ``heads``, ``segments``,
    ``align``) cut an
    unquantized layer the same way (column: its rows, row: its input columns with the bias on
    rank 0), reading only its slice."""
    config = resolve_quant_config(quant_config)
    kwargs["tp_rank"], kwargs["tp_size"] = tp_of_group(
        kwargs.get("tp_rank"), kwargs.get("tp_size"), kwargs.pop("process_group", None)
    )
    prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
    modules = [_module_name(p) for p in prefixes]
    quantized = [config.layer(m) is not None if config is not None else None for m in modules]
    if config is not None and not any(quantized):
        split = TpSplit(**{f.name: kwargs[f.name] for f in fields(TpSplit) if f.name in kwargs})
        excluded = [config.excluded_by(m) for m in modules]
        why = next((f"the config excludes it: pattern {e!r}" for e in excluded if e), "")
        weight, bias = read_dense_shard(state_dict, modules, split, why=why)
        dtype = parse_act_dtype(act_dtype)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return linear.to(target_device(device, weight.device))
    if config is not None and not all(quantized):
        raise CheckpointError(
            format_error(
                f"fused shards {modules} mix quantized and unquantized layers",
                "a fused layer's shards share one quantization",
                "load them as separate layers",
            )
        )
    return QuantLinear.from_checkpoint(
        state_dict, prefix, config, act_dtype=act_dtype, device=device, **kwargs
    )

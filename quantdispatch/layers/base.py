"""What QuantLinear and QuantMoE share: buffers that keep their dtype, the input checks, where a
layer lives, and the construction sequence (select -> refuse a simulated device -> prepare ->
register the prepared tensors as buffers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from quantdispatch.api import select
from quantdispatch.backends import get_backend
from quantdispatch.backends.base import encode_meta
from quantdispatch.checkpoints import QuantConfig, load_quant_config, parse_quant_config
from quantdispatch.device import DeviceProfile, device_profile
from quantdispatch.errors import ConfigurationError, InputError, format_error
from quantdispatch.formats import Fp8Weight, Mxfp4Weight, Nvfp4Weight
from quantdispatch.policy import Policy
from quantdispatch.request import Scheme
from quantdispatch.resolver import Decision
from quantdispatch.settings import Settings

if TYPE_CHECKING:
    from quantdispatch.backends.base import Backend, Layout, LayoutMeta

__all__ = [
    "FixedDtypeBuffers",
    "QuantLayer",
    "activations_2d",
    "direct_call_ok",
    "format_of",
    "profile_for",
    "resolve_quant_config",
    "target_device",
]

_FORMAT_OF = {Nvfp4Weight: "nvfp4", Mxfp4Weight: "mxfp4", Fp8Weight: "fp8"}
_16_BIT = (torch.bfloat16, torch.float16)


def format_of(weight: object) -> str:
    fmt = _FORMAT_OF.get(type(weight))
    if fmt is None:
        raise ConfigurationError(
            format_error(
                f"expected a quantized weight, got {type(weight).__name__}",
                "QuantLinear takes an Nvfp4Weight, Mxfp4Weight or Fp8Weight",
                "build one with quantdispatch.formats.quantize_*(...) or use "
                "QuantLinear.from_checkpoint / from_float",
            )
        )
    return fmt


def target_device(device: object, weight_device: torch.device) -> torch.device:
    """Where a layer lives: ``device`` if given; else the weights' device if it is a GPU; else
    the current CUDA device when there is one; else the CPU."""
    if device is not None:
        if (
            isinstance(device, str)
            and device.strip().lower() not in ("cpu", "cuda")
            and not (device.strip().lower().startswith("cuda:"))
        ):
            # A preset name: let the resolver explain, then refuse to run on a simulation.
            return torch.device("meta")
        return torch.device(device) if not isinstance(device, torch.device) else device
    if weight_device.type == "cuda":
        return weight_device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def profile_for(device: torch.device, requested: object) -> DeviceProfile:
    if device.type == "meta":
        return device_profile(requested)
    if device.type == "cpu":
        return device_profile("cpu")
    return device_profile(device.index if device.index is not None else 0)


def resolve_quant_config(config: object) -> QuantConfig | None:
    """A QuantConfig from a QuantConfig, a parsed JSON mapping, a path, or None."""
    if config is None or isinstance(config, QuantConfig):
        return config
    if isinstance(config, (str, Path)):
        return load_quant_config(config)
    if isinstance(config, Mapping):
        return parse_quant_config(config)
    raise ConfigurationError(
        format_error(
            f"quant_config is a {type(config).__name__}",
            "pass a QuantConfig, the parsed config JSON, a path, or None",
            "e.g. quant_config=json.load(open('config.json'))",
        )
    )


def activations_2d(
    x: torch.Tensor, act_dtype: torch.dtype, width: int, width_name: str, device: torch.device
) -> torch.Tensor:
    """Check a layer's input (dtype it was built for, last dim, device) and view it as 2-D
    [tokens, width] with unit stride along the width, as the kernels take it."""
    if x.dtype != act_dtype:
        if x.dtype in _16_BIT:
            rule = "the kernel decision depends on the activation dtype"
            fix = (
                f"cast the input with .to({act_dtype}) or build the layer with act_dtype={x.dtype}"
            )
        else:
            # No layer takes float32 (or 8-bit) activations: only the cast works.
            rule = "quantized layers take 16-bit activations, in the dtype the layer was built for"
            fix = (
                f"cast the input with .to({act_dtype}) (and the output back to {x.dtype} if the "
                "model needs it); layers are built for torch.bfloat16 or torch.float16 only"
            )
        raise InputError(
            format_error(f"input is {x.dtype} but this layer was built for {act_dtype}", rule, fix)
        )
    if x.dim() == 0 or x.shape[-1] != width:
        raise InputError(
            format_error(
                f"input has shape {tuple(x.shape)}",
                f"the last dimension must be {width_name} = {width}",
                "pass [..., features] activations",
            )
        )
    if x.device != device:
        raise InputError(
            format_error(
                f"input is on {x.device} but the layer is on {device}",
                "input and weights must be on one device",
                f"move the input with .to('{device}')",
            )
        )
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def direct_call_ok(x: torch.Tensor) -> bool:
    """Whether a layer may run its custom op's body (``quantdispatch.ops.run_*``) directly.

    Yes for a plain tensor in eager mode with no autograd to record and no dispatch mode active.
    Compilation, export, fake tensors and tracers keep the op: they need its fake implementation
    and must not trace into the kernels. The op computes the same thing by the same backend call,
    but its dispatch costs tens of microseconds of host time per call, more than a decode step's
    kernel."""
    return (
        not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and not (x.requires_grad and torch.is_grad_enabled())
        and _get_current_dispatch_mode() is None
    )


class FixedDtypeBuffers(nn.Module):
    """A module whose own buffers keep their dtypes through ``model.half()``,
    ``model.to(torch.bfloat16)`` and the like, and follow device moves only.

    Why: a quantized layer's buffers are its format: packed codes, FP8 block scales (a floating
    dtype torch would cast), fp32 per-tensor scales that must stay exact, fp32 biases. Casting
    them with the model turned e4m3 scales into bf16 numbers the kernels misread and made the
    next call fail far from the cause. The activation dtype the layer was built for is part of
    its decision; a call in another dtype raises and says so."""

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        before = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, buf in before.items():
            now = self._buffers[name]
            if now is not None and now.dtype != buf.dtype:
                self._buffers[name] = buf.to(device=now.device)
        return self


class QuantLayer(FixedDtypeBuffers):
    """A quantized layer: one kernel decision at construction, the backend's prepared tensors
    as buffers (a state-dict round trip restores them), nothing dequantized kept.

    Eager calls run the layer's bound call path (``_bound``, quantdispatch.backends.bound),
    built at the first such call from the buffers as they are then, and dropped whenever a
    buffer moves or is replaced (``.to()``, ``load_state_dict(assign=True)``, assignment), so
    it never holds stale tensors. Copies and pickles leave it behind."""

    decision: Decision
    backend: str
    _bound: Any = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self.__dict__["_bound"] = None
        out = super()._apply(fn, recurse)
        self._mark_static()
        return out

    def _mark_static(self) -> None:
        """Tell torch.compile that the buffers keep their addresses between calls: its CUDA
        graphs then read them in place instead of copying every packed weight into the graph's
        inputs on each replay. Redone whenever buffers move."""
        for buf in self._buffers.values():
            if buf is not None:
                torch._dynamo.mark_static_address(buf)

    def __setattr__(self, name: str, value: Any) -> None:
        buffer = name in self.__dict__.get("_buffers", ())
        if buffer:
            self.__dict__["_bound"] = None
        super().__setattr__(name, value)
        if buffer and isinstance(value, torch.Tensor):
            torch._dynamo.mark_static_address(value)

    def register_buffer(self, name: str, tensor: Any, persistent: bool = True) -> None:
        self.__dict__["_bound"] = None
        super().register_buffer(name, tensor, persistent)
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.mark_static_address(tensor)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_bound", None)
        return state

    def _decide(
        self,
        fmt: str,
        op: str,
        act_dtype: torch.dtype,
        scheme: Scheme | str,
        *,
        device: object,
        weight_device: torch.device,
        settings: Settings | None,
        policy: Policy | str | Path | None,
        **shape: Any,
    ) -> tuple[Backend, torch.device]:
        """Select the backend for this layer on its target device (a backend chosen there for
        the first time is self-checked first) and refuse a simulated one (presets explain, they
        do not run). Returns the backend and the target device."""
        target = target_device(device, weight_device)
        decision = select(
            fmt,
            op,
            act_dtype,
            scheme,
            **shape,
            device=profile_for(target, device),
            settings=settings,
            policy=policy,
            check_on=target,  # the chosen backend's first-use self-check (quantdispatch.selfcheck)
        )
        backend = get_backend(decision.backend)
        backend.refuse_simulated(decision.device)
        self.decision = decision
        self.backend = decision.backend
        return backend, target

    def _hold(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        layout: Layout,
        meta: LayoutMeta,
    ) -> None:
        """Keep the prepared tensors as buffers under the backend's names, their layout and
        typed meta, and the meta's flat form the op takes (``_meta_args``)."""
        self._layout = layout
        self._meta = meta
        self._meta_args = encode_meta(layout, meta)
        for name, tensor in zip(names, tensors, strict=True):
            self.register_buffer(name, tensor)

    def device_bytes(self) -> int:
        """Bytes this layer holds (packed weights, scales, biases, maps): its device memory."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

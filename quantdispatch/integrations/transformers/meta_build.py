"""Build a transformers model with no float weights allocated, and nothing process-wide touched.

``on_meta(dtype)``: inside it, tensors created by torch's factory functions go to the meta
device (torch's own device context) and those that would take the default float dtype take
``dtype`` instead (what transformers' ``from_config(dtype=...)`` does through
``torch.set_default_dtype``, which is process-wide). Both are torch-function modes, which torch
keeps per thread: another thread building an ``nn.Linear`` meanwhile gets ordinary weights, and
two loads in two threads do not see each other. Tensors created with an explicit dtype keep it
(e.g. DeepSeek-V3's fp32 router).

Buffers that are not in checkpoints (RoPE frequencies and the like) are then computed on the
target device by the model's own ``_init_weights``, the rule transformers' ``from_pretrained``
relies on for every model it builds on the meta device. A buffer that rule leaves unwritten is
an error, never a buffer of garbage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from quantdispatch.errors import CheckpointError, format_error

__all__ = ["compute_buffers", "on_meta"]

#: Factories whose result takes the default float dtype when none is given.
_FACTORIES = frozenset(
    {
        torch.empty,
        torch.empty_strided,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.rand,
        torch.randn,
        torch.arange,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.tensor,
        torch.as_tensor,
        torch.scalar_tensor,
    }
)


class _DefaultFloat(TorchFunctionMode):
    """Factory results in the default float dtype become ``dtype`` (this thread only)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if (
            func in _FACTORIES
            and (kwargs or {}).get("dtype") is None
            and isinstance(out, torch.Tensor)
            and out.dtype == torch.get_default_dtype()
            and out.dtype != self.dtype
        ):
            return out.to(self.dtype)
        return out


@contextlib.contextmanager
def on_meta(dtype: torch.dtype) -> Iterator[None]:
    """New tensors on the meta device, default-float ones in ``dtype``; per thread."""
    with torch.device("meta"), _DefaultFloat(dtype):
        yield


def _owners(model: nn.Module) -> dict[str, Any]:
    """{module name: the nearest PreTrainedModel at or above it} (composite models have one
    ``_init_weights`` per sub-model)."""
    from transformers import PreTrainedModel

    owner: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            owner[name] = module
            continue
        parent = name.rpartition(".")[0]
        owner[name] = owner.get(parent, model)
    return owner


def _sentinel(t: torch.Tensor) -> float | int | None:
    if t.is_floating_point():
        return float("nan")
    if t.dtype == torch.bool or t.is_complex():
        return None
    return torch.iinfo(t.dtype).max


@torch.no_grad()
def compute_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer still on the meta device (those checkpoints do not hold) is allocated on
    ``device`` and computed by the owning model's ``_init_weights``; one it leaves unwritten
    raises ``CheckpointError`` naming it."""
    owners = _owners(model)
    for name, module in model.named_modules():
        pending = []
        for bname, b in list(module._buffers.items()):
            if b is None or b.device.type != "meta":
                continue
            fill = _sentinel(b)
            value = torch.empty_like(b, device=device)
            if fill is not None:
                value.fill_(fill)
            module._buffers[bname] = value
            pending.append((bname, fill))
        if not pending:
            continue
        owners[name]._init_weights(module)
        for bname, fill in pending:
            b = module._buffers[bname]
            if fill is None or b.numel() == 0:
                continue
            unwritten = b.isnan().all() if isinstance(fill, float) else (b == fill).all()
            if bool(unwritten):
                full = f"{name}.{bname}" if name else bname
                raise CheckpointError(
                    format_error(
                        f"buffer {full!r} ({type(module).__name__}) is not in the checkpoint and "
                        f"the model's _init_weights does not compute it",
                        "the model is built on the meta device, as transformers' "
                        "from_pretrained builds it; buffers missing from the checkpoint are "
                        "computed by the model's _init_weights",
                        "store the buffer in the checkpoint, or load this architecture with "
                        "transformers' from_pretrained",
                    )
                )

"""Small pieces the loader, the quantizer and the from_pretrained hook share."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from quantdispatch.checkpoints.patterns import ModulePattern, any_match, compile_patterns
from quantdispatch.errors import ConfigurationError, format_error

__all__ = [
    "ReferenceBackendWarning",
    "matches",
    "quantized_modules",
    "replace_module",
    "resolve_device",
    "text_config",
    "warn_if_reference",
]


class ReferenceBackendWarning(UserWarning):
    """A model's quantized layers run on the reference backend (dequantize + fp32 matmul)."""


_warned = False


def resolve_device(device: object) -> torch.device:
    """The device a model is built on: ``device`` if given, else the current GPU, else the CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        d = torch.device(device) if not isinstance(device, torch.device) else device
    except (RuntimeError, TypeError):
        raise ConfigurationError(
            format_error(
                f"device={device!r} is not a torch device",
                "a model runs on 'cuda', 'cuda:N' or 'cpu'; preset names (e.g. 'h100') only "
                "simulate a GPU for decisions",
                "pass a real device, or use describe_model(path, 'h100') to see what would run",
            )
        ) from None
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def text_config(model: nn.Module) -> Any:
    """The language model's config (a multimodal config's text part, else the config)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether a module name is matched by one of ``patterns``: the exact name, a name suffix
    after a dot (``lm_head`` matches ``model.lm_head``), an fnmatch pattern (``*.mlp.gate``) or a
    ``re:`` regular expression (compressed-tensors style), in bounded time."""
    if isinstance(patterns, str):
        raise ConfigurationError(
            format_error(
                f"exclude={patterns!r} is a string",
                "exclude is a list of module names or patterns",
                f"pass exclude=[{patterns!r}]",
            )
        )
    return any_match(_compiled(tuple(patterns)), name) is not None


@functools.lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> tuple[ModulePattern, ...]:
    return compile_patterns(patterns, "exclude", ConfigurationError, suffix=True)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every quantdispatch layer in ``model`` (QuantLinear, QuantMoE)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m).__name__ in ("QuantLinear", "QuantMoE")
    ]


def warn_if_reference(model: nn.Module) -> None:
    """Warn once per process when a model's quantized layers run on the CPU reference backend."""
    global _warned
    layers = [
        (n, m) for n, m in quantized_modules(model) if getattr(m, "backend", "") == "reference"
    ]
    if _warned or not layers:
        return
    _warned = True
    name, first = layers[0]
    where = first.decision.device.label()
    warnings.warn(
        format_error(
            f"{len(layers)} quantized layers of this model (e.g. {name}) run on the reference "
            f"backend on {where}: they dequantize each weight and multiply in fp32, which is "
            "correct but slow",
            "the fast kernels run on CUDA GPUs (SM 7.5+); the reference backend is what runs "
            "where none of them can (on a CPU, always)",
            "load the model with device='cuda' on a GPU machine; `quantdispatch doctor` shows "
            "why each backend was or was not chosen",
        ),
        ReferenceBackendWarning,
        stacklevel=3,
    )

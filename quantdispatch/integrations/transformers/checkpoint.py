"""A checkpoint folder as the loader sees it: ``config.json``, the quantization config, the
safetensors keys (tensors read lazily), and how a transformers module name maps to the name its
tensors carry in the checkpoint. No transformers import here (``describe`` uses it too).

The quantization config comes from ``quantdispatch.checkpoints.load_quant_config``: ModelOpt's
``hf_quant_config.json`` or ``config.json``'s ``quantization_config`` (modelopt NVFP4 /
W4A16_NVFP4 / FP8 / MIXED_PRECISION, compressed-tensors NVFP4 / MXFP4 / FP8, gpt-oss ``mxfp4``,
``fp8``). Which layers are quantized is read from the tensors (a layer with scales is quantized);
the config must agree with them, which ``QuantLinear.from_checkpoint`` checks.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantdispatch.checkpoints import QuantConfig, SafetensorsStateDict, load_quant_config
from quantdispatch.checkpoints.config import read_json
from quantdispatch.checkpoints.slices import KeyView
from quantdispatch.errors import CheckpointError, format_error

__all__ = [
    "MODULE_ALIASES",
    "Checkpoint",
    "PrefixView",
    "open_checkpoint",
    "read_config",
    "read_headers",
]

#: Module-name pieces transformers 5 renamed at load time: (name in the model, name in the
#: checkpoint). Mixtral-style MoE blocks are ``mlp`` in the model, ``block_sparse_moe`` on disk.
MODULE_ALIASES: tuple[tuple[str, str], ...] = ((".mlp.", ".block_sparse_moe."),)

#: Tensor names that make a linear quantized (scales or packed codes).
QUANT_TENSORS = ("weight_packed", "weight_scale", "weight_scale_inv")
_QUANT_DTYPES = ("U8", "I8", "F8_E4M3")


class PrefixView(KeyView):
    """The part of a state dict under some prefixes: readers scan these keys, not all."""


@dataclass
class Checkpoint:
    """A checkpoint folder: its config, quant config and (lazy) tensors."""

    path: Path
    config: dict[str, Any]
    quant: QuantConfig | None
    state: Mapping[str, torch.Tensor]
    dtypes: Mapping[str, str] = field(default_factory=dict, repr=False)
    """safetensors dtype names (``BF16``, ``U8``, ``F8_E4M3``...) read from the headers."""
    _sorted: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._sorted = sorted(self.state)

    @property
    def keys(self) -> list[str]:
        return self._sorted

    def under(self, prefix: str) -> list[str]:
        """Keys that start with ``prefix`` (a plain string prefix)."""
        lo = bisect.bisect_left(self._sorted, prefix)
        out = []
        for key in self._sorted[lo:]:
            if not key.startswith(prefix):
                break
            out.append(key)
        return out

    def module_keys(self, module: str) -> list[str]:
        """A module's own tensors: ``module.<name>`` and gpt-oss's ``module_blocks`` style."""
        own = self.under(module + ".")
        flat = [k for k in self.under(module + "_") if "." not in k[len(module) + 1 :]]
        return own + flat

    def view(self, *modules: str, recursive: bool = False) -> PrefixView:
        """The tensors of ``modules`` (``recursive``: and of everything under them)."""
        keys: list[str] = []
        for m in modules:
            keys += self.under(m + ".") if recursive else self.module_keys(m)
        return PrefixView(self.state, keys)

    def has_module(self, module: str) -> bool:
        return bool(self.module_keys(module))

    def name_for(self, module: str) -> str | None:
        """The checkpoint's name for a transformers module (itself, or a known alias)."""
        for candidate in _candidates(module):
            if self.has_module(candidate) or bool(self.under(candidate + ".")):
                return candidate
        return None

    def tensor_name(self, name: str) -> str | None:
        """The checkpoint key of a model parameter / buffer name, or None if absent."""
        for candidate in _candidates(name):
            if candidate in self.state:
                return candidate
        return None

    def linear_kind(self, module: str) -> str | None:
        """'quantized', 'float' or None (no tensors) for the linear named ``module`` on disk."""
        keys = self.module_keys(module)
        if not keys:
            return None
        names = {k[len(module) + 1 :] for k in keys}
        if names & set(QUANT_TENSORS) or "blocks" in names:
            return "quantized"
        if self.dtypes.get(f"{module}.weight") in _QUANT_DTYPES:
            return "quantized"  # packed codes whose scales are missing: the reader says which
        return "float" if "weight" in names else None


def read_headers(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} from the headers of a checkpoint's shards."""
    return SafetensorsStateDict(path).headers()


def read_config(cfg_file: Path) -> dict[str, Any]:
    """config.json as a mapping (CheckpointError naming the file otherwise)."""
    config = read_json(cfg_file)
    if not isinstance(config, dict):
        raise CheckpointError(
            format_error(
                f"{cfg_file} holds a JSON {type(config).__name__}",
                "config.json is a JSON object",
                "use the config.json that came with these weights",
            )
        )
    return config


def _candidates(name: str) -> list[str]:
    out = [name]
    dotted = "." + name + "."
    for model_part, ckpt_part in MODULE_ALIASES:
        if model_part in dotted:
            out.append(dotted.replace(model_part, ckpt_part)[1:-1])
    return out


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint folder's config.json, quant config and safetensors index."""
    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(
            format_error(
                f"no config.json in {str(path)!r}",
                "a transformers checkpoint folder has config.json next to its *.safetensors",
                "pass the folder that holds config.json (a local path: nothing is downloaded)",
            )
        )
    config = read_config(cfg_file)
    quant = load_quant_config(p)
    state = SafetensorsStateDict(p)
    dtypes = {k: v[0] for k, v in state.headers().items()}
    return Checkpoint(p, config, quant, state, dtypes)

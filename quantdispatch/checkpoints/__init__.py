"""Checkpoint adapters: ModelOpt, compressed-tensors, gpt-oss and FP8 tensors and configs ->
one canonical in-memory weight per layer (see ``reader`` for the table of conventions)."""

from quantdispatch.checkpoints.config import (
    LayerQuant,
    QuantConfig,
    load_quant_config,
    parse_quant_config,
)
from quantdispatch.checkpoints.reader import LoadedLinear, QuantWeight, merge_shards, read_linear
from quantdispatch.checkpoints.safetensors_dict import SafetensorsStateDict
from quantdispatch.checkpoints.sharding import shard_bounds, shard_weight

__all__ = [
    "LayerQuant",
    "LoadedLinear",
    "QuantConfig",
    "QuantWeight",
    "SafetensorsStateDict",
    "load_quant_config",
    "merge_shards",
    "parse_quant_config",
    "read_linear",
    "shard_bounds",
    "shard_weight",
]

"""Checkpoint adapters: ModelOpt, compressed-tensors, gpt-oss and FP8 tensors and configs ->
one canonical in-memory weight per layer (see ``reader`` for the table of conventions), and
tensor- / expert-parallel shards of them read slice by slice (``split_plan`` says which
slice, ``tensor_parallel`` and ``moe_shard`` read it)."""

from quantdispatch.checkpoints.config import (
    LayerQuant,
    QuantConfig,
    load_quant_config,
    parse_quant_config,
)
from quantdispatch.checkpoints.expert_stacks import merge_gate_up, stack_biases, stack_experts
from quantdispatch.checkpoints.moe_shard import (
    MoeShard,
    moe_intermediate_range,
    moe_shard_sizes,
    read_moe_shard,
)
from quantdispatch.checkpoints.reader import LoadedLinear, QuantWeight, merge_shards, read_linear
from quantdispatch.checkpoints.safetensors_dict import SafetensorsStateDict
from quantdispatch.checkpoints.sharding import shard_bounds, shard_weight
from quantdispatch.checkpoints.slices import LayerSlice, LinearGeometry, linear_geometry
from quantdispatch.checkpoints.split_plan import TpSplit, check_tp, column_ranges, split_range
from quantdispatch.checkpoints.tensor_parallel import (
    linear_shard_shapes,
    read_dense_shard,
    read_linear_shard,
    read_linear_split,
)

__all__ = [
    "LayerQuant",
    "LayerSlice",
    "LinearGeometry",
    "LoadedLinear",
    "MoeShard",
    "QuantConfig",
    "QuantWeight",
    "SafetensorsStateDict",
    "TpSplit",
    "check_tp",
    "column_ranges",
    "linear_geometry",
    "linear_shard_shapes",
    "load_quant_config",
    "merge_gate_up",
    "merge_shards",
    "moe_intermediate_range",
    "moe_shard_sizes",
    "parse_quant_config",
    "read_dense_shard",
    "read_linear",
    "read_linear_shard",
    "read_linear_split",
    "read_moe_shard",
    "shard_bounds",
    "shard_weight",
    "split_range",
    "stack_biases",
    "stack_experts",
]

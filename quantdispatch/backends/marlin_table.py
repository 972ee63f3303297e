"""The Marlin contract table: which provider versions our preparation binds to, and how.

One row per (provider, version range): the op schema (argument order), the ops and the
libraries that register them, the (format, activation dtype) pairs the build has kernels for,
and the preparation rules of marlin_contract.py established for it. A version in no row is
refused with its version in the reason; ``REFUSED`` says why for versions known to differ.
Sources for every row: docs/design/marlin.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import torch

from quantdispatch.device.providers import range_text

__all__ = ["CONTRACTS", "REFUSED", "SCHEMA_ARGS", "Contract", "Schema"]


class Schema(Enum):
    """How a provider's GEMM op takes its arguments (the op's registered schema)."""

    MARLIN_GEMM = "marlin_gemm"
    """vLLM 0.30+: marlin_gemm without g_idx / perm / is_k_full; repack without perm."""
    MARLIN_GEMM_GIDX = "marlin_gemm+g_idx"
    """vLLM 0.22-0.29: marlin_gemm with g_idx, perm, is_k_full; repack with perm."""
    GPTQ_MARLIN_GEMM = "gptq_marlin_gemm"
    """sgl-kernel and vLLM before the rename: no bias, no activation scales."""


_HEAD = "a c_or_none b_q_weight b_bias_or_none b_scales a_scales global_scale b_zeros_or_none"
_GIDX = "g_idx_or_none perm_or_none"
_ROUTE = "sorted_token_ids expert_ids num_tokens_past_padded topk_weights moe_block_size top_k"
_ROUTE += " mul_topk_weights b_type_id"
_SIZES = "size_m size_n size_k"
_TAIL = "use_atomic_add use_fp32_reduce is_zp_float"
_AUTO = "thread_k thread_n blocks_per_sm"

#: Argument names of each op's registered schema, per Schema (checked before the first call).
SCHEMA_ARGS: dict[Schema, dict[str, list[str]]] = {
    Schema.MARLIN_GEMM: {
        "gemm": f"{_HEAD} workspace b_type_id {_SIZES} {_TAIL}".split(),
        "repack": ["b_q_weight", "size_k", "size_n", "num_bits", "is_a_8bit"],
        "moe": f"{_HEAD} workspace {_ROUTE} {_SIZES} {_TAIL} {_AUTO}".split(),
    },
    Schema.MARLIN_GEMM_GIDX: {
        "gemm": f"{_HEAD} {_GIDX} workspace b_type_id {_SIZES} is_k_full {_TAIL}".split(),
        "repack": ["b_q_weight", "perm", "size_k", "size_n", "num_bits", "is_a_8bit"],
        "moe": f"{_HEAD} {_GIDX} workspace {_ROUTE} {_SIZES} is_full_k {_TAIL} {_AUTO}".split(),
    },
    Schema.GPTQ_MARLIN_GEMM: {
        "gemm": (
            "a c_or_none b_q_weight b_scales global_scale_or_none b_zeros_or_none "
            f"{_GIDX} workspace b_q_type_id {_SIZES} is_k_full {_TAIL}"
        ).split(),
        "repack": ["b_q_weight", "perm", "size_k", "size_n", "num_bits"],
    },
}


@dataclass(frozen=True)
class Contract:
    """One row of the table: a provider's version range and what our preparation binds to."""

    key: str
    provider: str
    min_version: tuple[int, int, int]
    below_version: tuple[int, int, int]
    schema: Schema
    ops: dict[str, tuple[str, str]]
    """role ("gemm", "repack", "moe") -> (torch.ops namespace, op name)."""
    libraries: dict[str, tuple[str, ...]]
    """namespace -> library file names that register it, in the package directory."""
    kernels: frozenset[tuple[str, str]]
    """(format, activation dtype) pairs the library has kernels for."""
    preparation: str
    """The marlin_contract.py rules this row was established with."""
    source: str
    gpu_verified: str | None = None
    """Where the pair was checked against float64 on a GPU; None: established from sources."""

    def covers(self, version: tuple[int, int, int]) -> bool:
        return self.min_version <= version < self.below_version

    def range_text(self) -> str:
        return f"{self.provider} {range_text(self.min_version, self.below_version)}"

    def op(self, role: str):  # -> torch._ops.OpOverloadPacket
        ns, name = self.ops[role]
        return getattr(getattr(torch.ops, ns), name)


_VLLM_SOURCE = (
    "vLLM wheels 0.22.0-0.33.0: op schemas in _C*/_moe_C* libraries; vllm/model_executor/"
    "layers/quantization/utils/marlin_utils{,_fp4}.py; csrc/.../marlin/dequant.h"
)

_VLLM_OPS = {
    "gemm": ("_C", "marlin_gemm"),
    "repack": ("_C", "gptq_marlin_repack"),
    "moe": ("_moe_C", "moe_wna16_marlin_gemm"),
}
_STABLE = {"_C": ("_C_stable_libtorch.abi3.so",), "_moe_C": ("_moe_C_stable_libtorch.abi3.so",)}
_EITHER = {k: (*v, k + ".abi3.so") for k, v in _STABLE.items()}  # 0.22 still built _C.abi3.so


def _vllm(key: str, lo: tuple, below: tuple, schema: Schema, libraries: dict) -> Contract:
    kernels = frozenset({("nvfp4", "bf16"), ("nvfp4", "fp16"), ("mxfp4", "bf16")})
    return Contract(key, "vllm", lo, below, schema, _VLLM_OPS, libraries, kernels,
                    "s0e5m3-floor-flush", _VLLM_SOURCE)  # fmt: skip


_H200_VERIFIED = (
    "GPU-verified with vLLM 0.33.0 on an H200 (benchmarks/results/"
    "gpu-tests-h200-2026-12-01-phase1.txt); other versions of the range from sources"
)

CONTRACTS: tuple[Contract, ...] = (
    replace(
        _vllm("vllm-0.30", (0, 30, 0), (0, 34, 0), Schema.MARLIN_GEMM, _STABLE),
        gpu_verified=_H200_VERIFIED,
    ),
    _vllm("vllm-0.22", (0, 22, 0), (0, 30, 0), Schema.MARLIN_GEMM_GIDX, _EITHER),
)

_Range = tuple[tuple[int, int, int], tuple[int, int, int], str]
#: Versions known and refused, with the reason (checked after CONTRACTS).
REFUSED: dict[str, tuple[_Range, ...]] = {
    "vllm": (
        (
            (0, 0, 0),
            (0, 22, 0),
            "older than the table: releases before 0.22.0 were not examined (their NVFP4 scale "
            "preparation predates or differs from the bf16 small-scale fixes vLLM #34577 and "
            "#37502; before vLLM #22428 the op was gptq_marlin_gemm)",
        ),
    ),
    "sgl-kernel": (
        (
            (0, 0, 0),
            (999, 0, 0),
            "its precompiled gptq_marlin_gemm reads FP4 scales with the older layout (scale "
            "stride prob_n/8, halved for FP4) that SGLang replaced in its JIT copy (sglang "
            "#19652); no sgl-kernel release matches a preparation in the table",
        ),
    ),
}

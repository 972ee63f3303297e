"""Where a MoE layer's experts are in a state dict: which per-expert naming a checkpoint uses,
and gpt-oss's fused expert tensors read slice by slice.

Per-expert tensors ``{prefix}.experts.{e}.gate_proj/up_proj/down_proj`` (Qwen, DeepSeek) or
``.w1/.w3/.w2`` (Mixtral) are read per expert by ``moe_shard`` with
:func:`~quantdispatch.checkpoints.read_linear` (any convention it reads). gpt-oss stores all
experts in ``{prefix}.experts.gate_up_proj_blocks/_scales/_bias`` with gate and up rows
interleaved ([gate0, up0, gate1, up1, ...]) and ``down_proj_blocks/_scales/_bias``; they are
de-interleaved here, so kernels see one layout. Only the experts held and their I slice are
read (one read per run of consecutive expert ids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from quantdispatch.checkpoints.config import QuantConfig
from quantdispatch.checkpoints.slices import read_slice, tensor_info
from quantdispatch.errors import CheckpointError, format_error

__all__ = [
    "EXPERT_NAMINGS",
    "detect_naming",
    "gpt_oss_intermediate",
    "has_gpt_oss_experts",
    "keys_by_expert",
    "read_gpt_oss_experts",
]

#: Per-expert projection names (gate, up, down) of the checkpoints we read.
EXPERT_NAMINGS = (
    ("gate_proj", "up_proj", "down_proj"),  # Qwen, DeepSeek, most HF MoEs
    ("w1", "w3", "w2"),  # Mixtral: w1 = gate, w3 = up, w2 = down
)


def _fail(what: str, rule: str, fix: str) -> CheckpointError:
    return CheckpointError(format_error(what, rule, fix))


def keys_by_expert(state_dict: Mapping[str, torch.Tensor], base: str) -> dict[str, list[str]]:
    """The keys under ``{base}.`` grouped by their next name (the expert index), one scan."""
    by_expert: dict[str, list[str]] = {}
    dot = base + "."
    for key in state_dict:
        if key.startswith(dot):
            idx, _, _ = key[len(dot) :].partition(".")
            by_expert.setdefault(idx, []).append(key)
    return by_expert


def detect_naming(
    by_expert: Mapping[str, list[str]], base: str, held: Sequence[int], gated: bool
) -> tuple[str, str, str]:
    """Which per-expert naming this checkpoint uses (from the first expert held)."""
    for e in held:
        keys = by_expert.get(str(e))
        if not keys:
            continue
        names = {k[len(f"{base}.{e}.") :].split(".")[0] for k in keys}
        for naming in EXPERT_NAMINGS:
            if (naming[0] in names and gated) or naming[1] in names or naming[2] in names:
                return naming
        break
    found = sorted(by_expert)[:4]
    raise _fail(
        f"missing expert tensors: found no experts {list(held)[:4]}... under '{base}.' "
        f"(expert indices present: {found or 'none'})",
        "experts are stored as {prefix}.experts.{e}.gate_proj/up_proj/down_proj, "
        ".w1/.w3/.w2 (Mixtral), or gpt-oss's {prefix}.experts.gate_up_proj_blocks",
        "check the prefix (e.g. model.layers.3.mlp, Mixtral: model.layers.3.block_sparse_moe)",
    )


# ---------------------------------------------------------------------------------------------
# gpt-oss: experts stacked in one tensor per projection, gate/up rows interleaved

_GPT_OSS = [f"{p}_{s}" for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales")]


def has_gpt_oss_experts(state_dict: Mapping[str, torch.Tensor], base: str) -> bool:
    """True when ``{base}`` (``{prefix}.experts``) holds gpt-oss's fused expert tensors."""
    return f"{base}.gate_up_proj_blocks" in state_dict or f"{base}.down_proj_blocks" in state_dict


def gpt_oss_intermediate(
    sd: Mapping[str, torch.Tensor], base: str, num_experts: int, config: QuantConfig | None
) -> int:
    """The intermediate size I of gpt-oss experts under ``base``, from the tensors' headers;
    the tensors, their shapes and the config are checked here."""
    if config is not None:
        quant = config.layer(f"{base}.gate_up_proj")
        if quant is not None and quant.format != "mxfp4":
            raise _fail(
                f"the quant config says {base} is {quant.format} but its tensors are gpt-oss "
                "MXFP4 blocks",
                "config and tensors describe one format",
                "pass this checkpoint's config",
            )
    need = [f"{base}.{name}" for name in _GPT_OSS]
    missing = [k for k in need if k not in sd]
    if missing:
        raise _fail(
            f"missing expert tensors {missing}",
            "gpt-oss experts are {prefix}.experts.gate_up_proj_blocks/_scales and "
            "down_proj_blocks/_scales (biases optional)",
            "pass the complete state dict",
        )
    shapes = []
    for key, ndim in zip(need, (4, 3, 4, 3), strict=True):
        shape, _ = tensor_info(sd, key)
        if len(shape) != ndim or shape[0] != num_experts:
            raise _fail(
                f"{key} has shape {shape}",
                f"gpt-oss stacks experts first: {ndim}-D with {num_experts} experts",
                "check num_experts and the checkpoint",
            )
        shapes.append(shape)
    gu, d = shapes[0], shapes[2]
    if gu[-1] != 16 or d[-1] != 16 or gu[1] % 2 or d[2] * 32 != gu[1] // 2:
        raise _fail(
            f"gate_up_proj_blocks {gu}, down_proj_blocks {d}",
            "gpt-oss blocks are [E, N, K/32, 16] bytes: gate_up [E, 2I, H/32, 16], down "
            "[E, H, I/32, 16]",
            "check the checkpoint",
        )
    return gu[1] // 2


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ids as [start, stop) runs, in order (one read per run)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


def read_gpt_oss_experts(
    sd: Mapping[str, torch.Tensor],
    base: str,
    held: Sequence[int],
    cut: tuple[int, int],
    *,
    down_bias: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """(w13 stacks, w2 stacks, w13 bias, w2 bias) of the experts ``held`` cut to the I slice
    ``cut`` = [a, b) (whole groups of 32), checked by :func:`gpt_oss_intermediate` first.
    ``down_bias=False`` leaves the down bias out (tensor-parallel ranks other than 0)."""
    a, b = cut
    runs = _runs(held)

    def take(key: str, *index: slice) -> torch.Tensor:
        return torch.cat([read_slice(sd, key, (slice(s, t), *index)) for s, t in runs])

    def deinterleave(t: torch.Tensor) -> torch.Tensor:
        # rows [gate_a, up_a, gate_a+1, up_a+1, ...] -> [gate a:b; up a:b]
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()

    rows, groups = slice(2 * a, 2 * b), slice(a // 32, -(-b // 32))
    gu_blocks, gu_scales, d_blocks, d_scales = (f"{base}.{name}" for name in _GPT_OSS)
    e = len(held)
    w13 = [
        deinterleave(take(gu_blocks, rows)).reshape(e, 2 * (b - a), -1),
        deinterleave(take(gu_scales, rows)),
    ]
    hidden = tensor_info(sd, d_blocks)[0][1]
    w2 = [
        take(d_blocks, slice(None), groups).reshape(e, hidden, -1).contiguous(),
        take(d_scales, slice(None), groups).contiguous(),
    ]
    b13 = b2 = None
    if f"{base}.gate_up_proj_bias" in sd:
        b13 = deinterleave(take(f"{base}.gate_up_proj_bias", rows)).to(torch.float32)
    if f"{base}.down_proj_bias" in sd and down_bias:
        b2 = take(f"{base}.down_proj_bias").to(torch.float32)
    return w13, w2, b13, b2

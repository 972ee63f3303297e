"""Reading a MoE layer's experts from a state dict: which per-expert naming a checkpoint uses,
and gpt-oss's fused expert tensors.

Per-expert tensors ``{prefix}.experts.{e}.gate_proj/up_proj/down_proj`` (Qwen, DeepSeek) or
``.w1/.w3/.w2`` (Mixtral) are read per expert with :func:`~quantdispatch.checkpoints.read_linear`
(any convention it reads). gpt-oss stores all experts in ``{prefix}.experts.gate_up_proj_blocks
/_scales/_bias`` with gate and up rows interleaved ([gate0, up0, gate1, up1, ...]) and
``down_proj_blocks/_scales/_bias``; they are de-interleaved here, so kernels see one layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from quantdispatch.checkpoints.config import QuantConfig
from quantdispatch.checkpoints.reader import LoadedLinear, read_linear
from quantdispatch.errors import CheckpointError, format_error
from quantdispatch.request import Scheme

__all__ = ["has_gpt_oss_experts", "read_expert_linears", "read_gpt_oss_experts"]


class _Subset(Mapping[str, torch.Tensor]):
    """A view of a state dict restricted to some keys (read_linear scans only those)."""

    def __init__(self, base: Mapping[str, torch.Tensor], keys: Sequence[str]) -> None:
        self._base = base
        self._keys = list(keys)
        self._set = set(keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._set:
            raise KeyError(key)
        return self._base[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._set


_NAMINGS = (
    ("gate_proj", "up_proj", "down_proj"),  # Qwen, DeepSeek, most HF MoEs
    ("w1", "w3", "w2"),  # Mixtral: w1 = gate, w3 = up, w2 = down
)


def has_gpt_oss_experts(state_dict: Mapping[str, torch.Tensor], base: str) -> bool:
    """True when ``{base}`` (``{prefix}.experts``) holds gpt-oss's fused expert tensors."""
    return f"{base}.gate_up_proj_blocks" in state_dict or f"{base}.down_proj_blocks" in state_dict


def read_expert_linears(
    state_dict: Mapping[str, torch.Tensor],
    base: str,
    held: Sequence[int],
    num_experts: int,
    config: QuantConfig | None,
    gated: bool,
) -> tuple[dict[str, list[LoadedLinear]], Scheme]:
    """The per-expert projections under ``{base}.{e}.`` for each expert held, by role
    ("gate" when gated, "up", "down"), and the one scheme they share."""
    by_expert: dict[str, list[str]] = {}
    dot = base + "."
    for key in state_dict:
        if key.startswith(dot):
            idx, _, _ = key[len(dot) :].partition(".")
            by_expert.setdefault(idx, []).append(key)
    naming = _detect_naming(by_expert, base, held, gated)
    gate_n, up_n, down_n = naming
    projections = (("gate", gate_n), ("up", up_n), ("down", down_n))
    if not gated:
        projections = (("up", up_n), ("down", down_n))
    loaded: dict[str, list[LoadedLinear]] = {p: [] for p, _ in projections}
    for e in held:
        keys = by_expert.get(str(e), [])
        sub = _Subset(state_dict, keys)
        for role, name in projections:
            module = f"{base}.{e}.{name}"
            if not any(k.startswith(module + ".") for k in keys):
                raise CheckpointError(
                    format_error(
                        f"missing expert tensors: nothing under '{module}.' (expert {e} of "
                        f"{num_experts}, {role} projection)",
                        f"every expert held has {', '.join(n for _, n in projections)}",
                        "pass the complete state dict (all shards), or the expert_ids this "
                        "rank really holds",
                    )
                )
            quant = None
            if config is not None:
                quant = config.layer(module)
                if quant is None:
                    raise CheckpointError(
                        format_error(
                            f"{module!r} is not quantized in this checkpoint ({config.producer} "
                            "config excludes it or lists no scheme for it)",
                            "QuantMoE loads quantized experts only",
                            "run these experts with the engine's unquantized MoE",
                        )
                    )
            loaded[role].append(read_linear(sub, module, quant))
    schemes = {ld.scheme for v in loaded.values() for ld in v}
    if len(schemes) != 1:
        raise CheckpointError(
            format_error(
                f"experts mix schemes {sorted(s.value for s in schemes)}",
                "one scheme per MoE layer",
                "check the checkpoint",
            )
        )
    return loaded, schemes.pop()


def _detect_naming(
    by_expert: Mapping[str, list[str]], base: str, held: Sequence[int], gated: bool
) -> tuple[str, str, str]:
    """Which per-expert naming this checkpoint uses (from the first expert held)."""
    for e in held:
        keys = by_expert.get(str(e))
        if not keys:
            continue
        names = {k[len(f"{base}.{e}.") :].split(".")[0] for k in keys}
        for naming in _NAMINGS:
            if (naming[0] in names and gated) or naming[1] in names or naming[2] in names:
                return naming
        break
    found = sorted(by_expert)[:4]
    raise CheckpointError(
        format_error(
            f"missing expert tensors: found no experts {list(held)[:4]}... under '{base}.' "
            f"(expert indices present: {found or 'none'})",
            "experts are stored as {prefix}.experts.{e}.gate_proj/up_proj/down_proj, "
            ".w1/.w3/.w2 (Mixtral), or gpt-oss's {prefix}.experts.gate_up_proj_blocks",
            "check the prefix (e.g. model.layers.3.mlp, Mixtral: model.layers.3.block_sparse_moe)",
        )
    )


def read_gpt_oss_experts(
    sd: Mapping[str, torch.Tensor],
    base: str,
    held: Sequence[int],
    num_experts: int,
    config: QuantConfig | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """gpt-oss fused expert tensors -> canonical stacks (gate/up de-interleaved)."""
    if config is not None:
        quant = config.layer(f"{base}.gate_up_proj")
        if quant is not None and quant.format != "mxfp4":
            raise CheckpointError(
                format_error(
                    f"the quant config says {base} is {quant.format} but its tensors are gpt-oss "
                    "MXFP4 blocks",
                    "config and tensors describe one format",
                    "pass this checkpoint's config",
                )
            )
    need = [f"{base}.{p}_{s}" for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales")]
    missing = [k for k in need if k not in sd]
    if missing:
        raise CheckpointError(
            format_error(
                f"missing expert tensors {missing}",
                "gpt-oss experts are {prefix}.experts.gate_up_proj_blocks/_scales and "
                "down_proj_blocks/_scales (biases optional)",
                "pass the complete state dict",
            )
        )
    idx = torch.tensor(list(held), dtype=torch.long)

    def take(key: str, ndim: int) -> torch.Tensor:
        t = sd[key]
        if t.dim() != ndim or t.shape[0] != num_experts:
            raise CheckpointError(
                format_error(
                    f"{key} has shape {tuple(t.shape)}",
                    f"gpt-oss stacks experts first: {ndim}-D with {num_experts} experts",
                    "check num_experts and the checkpoint",
                )
            )
        return t.index_select(0, idx.to(t.device))

    gu_blocks = take(f"{base}.gate_up_proj_blocks", 4)
    gu_scales = take(f"{base}.gate_up_proj_scales", 3)
    d_blocks = take(f"{base}.down_proj_blocks", 4)
    d_scales = take(f"{base}.down_proj_scales", 3)
    if gu_blocks.shape[-1] != 16 or d_blocks.shape[-1] != 16 or gu_blocks.shape[1] % 2:
        raise CheckpointError(
            format_error(
                f"gate_up_proj_blocks {tuple(gu_blocks.shape)}, down_proj_blocks "
                f"{tuple(d_blocks.shape)}",
                "gpt-oss blocks are [E, N, K/32, 16] bytes and gate_up has an even N (2I rows)",
                "check the checkpoint",
            )
        )
    e = len(held)

    def deinterleave(t: torch.Tensor) -> torch.Tensor:
        # rows [gate0, up0, gate1, up1, ...] -> [gate0, gate1, ...; up0, up1, ...]
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)

    w13 = [
        deinterleave(gu_blocks).reshape(e, gu_blocks.shape[1], -1).contiguous(),
        deinterleave(gu_scales).contiguous(),
    ]
    w2 = [d_blocks.reshape(e, d_blocks.shape[1], -1).contiguous(), d_scales.contiguous()]
    b13 = b2 = None
    if f"{base}.gate_up_proj_bias" in sd:
        b13 = deinterleave(take(f"{base}.gate_up_proj_bias", 2)).to(torch.float32)
    if f"{base}.down_proj_bias" in sd:
        b2 = take(f"{base}.down_proj_bias", 2).to(torch.float32)
    return w13, w2, b13, b2

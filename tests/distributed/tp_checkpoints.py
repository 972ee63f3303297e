"""Small random checkpoints in every convention the tensor-parallel readers cut, and float64
references built from the library's own canonical weights (the claim under test is "a shard
equals the matching slice of the whole layer", not the format decoders: those have their own
tests against an independent oracle)."""

from __future__ import annotations

import pytest
import torch

from quantdispatch.formats import (
    Fp8Weight,
    Mxfp4Weight,
    Nvfp4Weight,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
)


def codes(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Packed E2M1 codes uint8 [n, k/2], every nibble value present."""
    return torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)


def e4m3_scales(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Positive e4m3 block scales in 2^-3..2^2 (a modest range keeps bf16 bounds tight)."""
    exps = torch.randint(-3, 2, shape, generator=g).to(torch.float32)
    return ((1 + torch.rand(shape, generator=g)) * torch.pow(2.0, exps)).to(torch.float8_e4m3fn)


def e8m0_scales(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(122, 130, shape, generator=g).to(torch.uint8)


def fp8_codes(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def linear_layer(
    kind: str, prefix: str, n: int, k: int, g: torch.Generator, *, gs: float = 0.0173, bias=True
) -> dict[str, torch.Tensor]:
    """One linear layer's tensors. Kinds: modelopt-nvfp4 (W4A4, input scale), ct-nvfp4
    (weight-only, weight_shape), ct-mxfp4, gpt-oss (``prefix_blocks``), fp8-tensor (ModelOpt
    per-tensor + input scale), fp8-channel (compressed-tensors [N, 1]), fp8-block (DeepSeek
    weight_scale_inv, blocks of BLOCK)."""
    sd: dict[str, torch.Tensor] = {}
    if kind == "modelopt-nvfp4":
        sd[f"{prefix}.weight"] = codes(n, k, g)
        sd[f"{prefix}.weight_scale"] = e4m3_scales((n, k // 16), g)
        sd[f"{prefix}.weight_scale_2"] = torch.tensor([gs])
        sd[f"{prefix}.input_scale"] = torch.tensor([0.021])
    elif kind == "ct-nvfp4":
        sd[f"{prefix}.weight_packed"] = codes(n, k, g)
        sd[f"{prefix}.weight_scale"] = e4m3_scales((n, k // 16), g)
        sd[f"{prefix}.weight_global_scale"] = torch.tensor([1.0 / gs])
        sd[f"{prefix}.weight_shape"] = torch.tensor([n, k])
    elif kind == "ct-mxfp4":
        sd[f"{prefix}.weight_packed"] = codes(n, k, g)
        sd[f"{prefix}.weight_scale"] = e8m0_scales((n, k // 32), g)
        sd[f"{prefix}.weight_shape"] = torch.tensor([n, k])
    elif kind == "gpt-oss":
        sd[f"{prefix}_blocks"] = codes(n, k, g).reshape(n, k // 32, 16)
        sd[f"{prefix}_scales"] = e8m0_scales((n, k // 32), g)
        if bias:
            sd[f"{prefix}_bias"] = torch.randn(n, generator=g).to(torch.bfloat16)
        return sd
    elif kind == "fp8-tensor":
        sd[f"{prefix}.weight"] = fp8_codes(n, k, g)
        sd[f"{prefix}.weight_scale"] = torch.tensor(gs)
        sd[f"{prefix}.input_scale"] = torch.tensor(0.02)
    elif kind == "fp8-channel":
        sd[f"{prefix}.weight"] = fp8_codes(n, k, g)
        sd[f"{prefix}.weight_scale"] = torch.rand(n, 1, generator=g) * 0.01 + 1e-3
    elif kind == "fp8-block":
        bn, bk = BLOCK
        sd[f"{prefix}.weight"] = fp8_codes(n, k, g)
        shape = (-(-n // bn), -(-k // bk))
        sd[f"{prefix}.weight_scale_inv"] = torch.rand(shape, generator=g) * 0.01 + 1e-3
    else:
        raise ValueError(kind)
    if bias:
        sd[f"{prefix}.bias"] = torch.randn(n, generator=g).to(torch.bfloat16)
    return sd


#: FP8 block size of the fp8-block layers (small, so small weights hold several blocks).
BLOCK = (32, 64)
#: The quant config each kind needs (FP8 blocks other than 128x128 must be stated).
CONFIGS = {"fp8-block": {"quant_method": "fp8", "weight_block_size": list(BLOCK)}}
LINEAR_KINDS = (
    "modelopt-nvfp4",
    "ct-nvfp4",
    "ct-mxfp4",
    "gpt-oss",
    "fp8-tensor",
    "fp8-channel",
    "fp8-block",
)


def experts(
    kind: str, prefix: str, e: int, h: int, inter: int, g: torch.Generator, *, naming=None
) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down tensors (``naming`` = (gate, up, down) names), gate and up with
    different per-tensor scales (merged under one at load)."""
    gate_n, up_n, down_n = naming or ("gate_proj", "up_proj", "down_proj")
    sd: dict[str, torch.Tensor] = {}
    for i in range(e):
        base = f"{prefix}.experts.{i}"
        sd |= linear_layer(kind, f"{base}.{gate_n}", inter, h, g, gs=0.011 * (1 + i), bias=False)
        sd |= linear_layer(kind, f"{base}.{up_n}", inter, h, g, gs=0.017, bias=False)
        sd |= linear_layer(kind, f"{base}.{down_n}", h, inter, g, gs=0.013, bias=False)
    return sd


def gpt_oss_experts(prefix: str, e: int, h: int, inter: int, g: torch.Generator) -> dict:
    """gpt-oss fused experts: gate/up rows interleaved, biases in bf16."""
    base = f"{prefix}.experts"
    return {
        f"{base}.gate_up_proj_blocks": codes(e * 2 * inter, h, g).reshape(e, 2 * inter, -1, 16),
        f"{base}.gate_up_proj_scales": e8m0_scales((e, 2 * inter, h // 32), g),
        f"{base}.gate_up_proj_bias": torch.randn(e, 2 * inter, generator=g).to(torch.bfloat16),
        f"{base}.down_proj_blocks": codes(e * h, inter, g).reshape(e, h, -1, 16),
        f"{base}.down_proj_scales": e8m0_scales((e, h, inter // 32), g),
        f"{base}.down_proj_bias": torch.randn(e, h, generator=g).to(torch.bfloat16),
    }


def weight64(w) -> torch.Tensor:
    """A canonical weight in float64."""
    if isinstance(w, Fp8Weight):
        return dequantize_fp8(w, dtype=torch.float64)
    if isinstance(w, Mxfp4Weight):
        return dequantize_mxfp4(w, dtype=torch.float64)
    return dequantize_nvfp4(w, dtype=torch.float64)


def canonical_tensors(w) -> list[torch.Tensor]:
    """The canonical weight's tensors, to compare bit for bit."""
    if isinstance(w, Fp8Weight):
        return [w.weight.view(torch.uint8), w.scale]
    if isinstance(w, Mxfp4Weight):
        return [w.packed, w.block_scale]
    return [w.packed, w.block_scale.view(torch.uint8), w.global_scale]


def expert_weight(fmt, stacks, block, e):
    """Expert e of stacked canonical tensors as a canonical weight."""
    t = [s[e] for s in stacks]
    if fmt == "nvfp4":
        return Nvfp4Weight(t[0], t[1], t[2])
    if fmt == "mxfp4":
        return Mxfp4Weight(t[0], t[1])
    return Fp8Weight(t[0], t[1], block_size=block)


def stack64(shard, which):
    stacks = shard.w13 if which == "w13" else shard.w2
    """A shard's stacked experts in float64: [E, N, K]."""
    e = stacks[0].shape[0]
    return torch.stack(
        [weight64(expert_weight(shard.format, stacks, shard.fp8_block_size, i)) for i in range(e)]
    )


def silu_glu64(h: torch.Tensor) -> torch.Tensor:
    i = h.shape[-1] // 2
    return torch.nn.functional.silu(h[..., :i]) * h[..., i:]


def swiglu_oai64(h: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    i = h.shape[-1] // 2
    gate = h[..., :i].clamp(max=limit)
    up = h[..., i:].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def assert_clear_errors(cases) -> None:
    """Each (call, exception type, pattern) raises that exception, matching the pattern, with
    a message in the what. rule. fix. form."""
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern) as info:
            call()
        assert str(info.value).count(". ") >= 2, str(info.value)

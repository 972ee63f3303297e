"""quantdispatch.formats against the real compressed-tensors package, an independent producer.

compressed-tensors (llm-compressor's checkpoint library) quantizes, packs and decompresses
NVFP4 (``nvfp4-pack-quantized``) and MXFP4 tensors, and converts ModelOpt checkpoints. Its
decompression rounds to bfloat16, so dequantized values are compared within that rounding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "compressed_tensors",
    reason="compressed-tensors is not installed (pip install compressed-tensors): it is the "
    "independent oracle for these interop tests",
)

from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import (
    pack_fp4_to_uint8,
    unpack_fp4_from_uint8,
)
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
    ModelOptNvfp4Converter,
)
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import (
    calculate_qparams,
    generate_gparam,
)

from quantdispatch.formats import (
    Mxfp4Weight,
    Nvfp4Weight,
    decode_e2m1,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_e2m1,
    global_scale_from_compressed_tensors,
    global_scale_to_compressed_tensors,
    pack_e2m1,
    quantize_mxfp4,
    quantize_nvfp4,
)

BF16_HALF_ULP = 2.0**-8


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """float32, random, no zeros; row magnitudes over ~3 decades (one row tiny)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 10.0 ** (torch.rand(n, 1, generator=g) * 3 - 2) * 0.05
    w[3] = w[3] / w[3].abs().max() * w.abs().max() * 1e-5  # e4m3-subnormal block scales
    return torch.where(w == 0, torch.full_like(w, 1e-3), w)


def _assert_close_to_bf16(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """ours is float32 (one rounding); theirs went through bf16: within half a bf16 ulp."""
    assert theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
    diff = (ours.double() - theirs.double()).abs()
    # half a bf16 ulp of their fp32 value, plus the few fp32 ulps between the two fp32 paths
    assert (diff <= ours.double().abs() * BF16_HALF_ULP * (1 + 2.0**-12)).all()
    exact = (ours.to(torch.bfloat16) == theirs).float().mean().item()
    assert exact > 0.99, exact


def _ct_nvfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, object]:
    """Quantize + compress with compressed-tensors' own observers' math (NVFP4A16 preset)."""
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    n, k = w.shape
    gs = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(n, k // 16, 16)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": gs, "weight_zero_point": zp}
    return NVFP4PackedCompressor.compress(state, scheme), scale, scheme


def test_nibble_order_and_decode_agree() -> None:
    vals = torch.tensor([[0.5, 1.0, 1.5, 2.0, -0.5, -6.0, 3.0, 0.0]])
    theirs = pack_fp4_to_uint8(vals)
    ours = pack_e2m1(encode_e2m1(vals))
    assert torch.equal(ours, theirs)
    assert ours[0, 0].item() == 0x21  # element 0 (0.5, code 1) in the LOW nibble
    every = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    their_vals = unpack_fp4_from_uint8(every, 8, 64, dtype=torch.float32)
    assert torch.equal(decode_e2m1(every), their_vals)


def test_nvfp4_compressed_tensors_checkpoint_dequantizes_like_theirs() -> None:
    w = _weight(64, 128, seed=1)
    sd, scale, scheme = _ct_nvfp4(w)
    assert sd["weight_packed"].dtype == torch.uint8 and sd["weight_packed"].shape == (64, 64)
    assert sd["weight_scale"].dtype == torch.float8_e4m3fn
    assert sd["weight_global_scale"].shape == (1,)

    ours = Nvfp4Weight(
        packed=sd["weight_packed"],
        block_scale=sd["weight_scale"],
        global_scale=global_scale_from_compressed_tensors(sd["weight_global_scale"]),
    )
    bits = sd["weight_scale"].view(torch.uint8)
    assert ((bits[3] >> 3) == 0).any()  # subnormal block scales are in the comparison
    theirs = NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
    _assert_close_to_bf16(dequantize_nvfp4(ours), theirs)

    # Same codes: their quantizer divides by (scale / global) and rounds with cast_to_fp4; our
    # encoder on the same fp32 quotients must give the same bytes (nibble order and ties).
    x = w.reshape(64, 8, 16) / (scale.float() / sd["weight_global_scale"]).unsqueeze(-1)
    assert torch.equal(pack_e2m1(encode_e2m1(x.reshape(64, 128))), sd["weight_packed"])


def test_nvfp4_our_quantizer_decompresses_in_compressed_tensors() -> None:
    w = _weight(48, 96, seed=2)
    q = quantize_nvfp4(w)
    assert ((q.block_scale.view(torch.uint8)[3] >> 3) == 0).any()  # subnormal scales
    ct_global = global_scale_to_compressed_tensors(q.global_scale)
    sd = {
        "weight_packed": q.packed,
        "weight_scale": q.block_scale,
        "weight_global_scale": ct_global,
    }
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    theirs = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
    _assert_close_to_bf16(dequantize_nvfp4(q), theirs)
    # and ours is close to the original weight (so the comparison is not between two zeros)
    assert (dequantize_nvfp4(q) - w).norm() / w.norm() < 0.15


def test_modelopt_converter_reciprocal_matches_ours() -> None:
    q = quantize_nvfp4(_weight(32, 64, seed=3), with_input_scale=0.0371)
    assert q.input_scale is not None
    modelopt = {
        "layers.0.mlp.down_proj.weight": q.packed,
        "layers.0.mlp.down_proj.weight_scale": q.block_scale,
        "layers.0.mlp.down_proj.weight_scale_2": q.global_scale.clone(),
        "layers.0.mlp.down_proj.input_scale": q.input_scale.clone(),
    }
    ct = ModelOptNvfp4Converter().process(dict(modelopt))
    wgs = ct["layers.0.mlp.down_proj.weight_global_scale"]
    igs = ct["layers.0.mlp.down_proj.input_global_scale"]
    assert torch.equal(ct["layers.0.mlp.down_proj.weight_packed"], q.packed)
    assert wgs.item() == global_scale_to_compressed_tensors(q.global_scale).item()
    assert igs.item() == global_scale_to_compressed_tensors(q.input_scale).item()
    back = global_scale_from_compressed_tensors(wgs)
    assert abs(back.item() - q.global_scale.item()) <= q.global_scale.item() * 2.0**-23


def _ct_mxfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, object]:
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    return MXFP4PackedCompressor.compress(state, scheme), scale, scheme


def test_mxfp4_compressed_tensors_checkpoint_dequantizes_like_theirs() -> None:
    w = _weight(40, 128, seed=4)
    sd, scale, scheme = _ct_mxfp4(w)
    assert sd["weight_scale"].dtype == torch.uint8 and sd["weight_scale"].shape == (40, 4)
    ours = Mxfp4Weight(packed=sd["weight_packed"], block_scale=sd["weight_scale"])
    theirs = MXFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
    # power-of-two scales: both sides are exact, even in bf16
    assert torch.equal(dequantize_mxfp4(ours, dtype=torch.bfloat16), theirs)
    x = w.reshape(40, 4, 32) / scale.float().unsqueeze(-1)
    assert torch.equal(pack_e2m1(encode_e2m1(x.reshape(40, 128))), sd["weight_packed"])


def test_mxfp4_scale_rule_difference_is_the_documented_one() -> None:
    """Our quantize_mxfp4 uses the OCP rule floor(log2(amax)) - 2; compressed-tensors first
    rounds amax to a power of two (up when its significand is >= 1.75), so its exponent is one
    higher on those blocks. Both are valid MXFP4; decoding agrees either way (tested above)."""
    w = _weight(40, 256, seed=5)
    sd, _, _ = _ct_mxfp4(w)
    ours = quantize_mxfp4(w)
    amax = w.reshape(40, 8, 32).abs().amax(-1)
    mantissa, _ = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1)
    bump = (mantissa >= 0.875).to(torch.int64)  # significand 2m >= 1.75
    assert bump.any() and (bump == 0).any()
    assert torch.equal(sd["weight_scale"].to(torch.int64), ours.block_scale.to(torch.int64) + bump)
    # where the scales agree, the E2M1 values agree exactly
    same = bump == 0
    our_vals = decode_e2m1(ours.packed).reshape(40, 8, 32)
    their_vals = unpack_fp4_from_uint8(sd["weight_packed"], 40, 256, dtype=torch.float32)
    assert torch.equal(our_vals[same], their_vals.reshape(40, 8, 32)[same])

"""Checkpoint loading: both NVFP4 conventions, MXFP4, FP8, configs, fused shards, bad input."""

from __future__ import annotations

import pytest
import torch
from ref64 import (
    fp8_weight64,
    linear64,
    mxfp4_weight64,
    nvfp4_weight64,
    random_codes,
    random_e4m3_scales,
    rel_err,
)

from quantdispatch.checkpoints import (
    SafetensorsStateDict,
    load_quant_config,
    parse_quant_config,
    read_linear,
)
from quantdispatch.errors import CheckpointError, WeightFormatError
from quantdispatch.layers import QuantLinear
from quantdispatch.request import Scheme

P = "model.layers.0.mlp.down_proj"


def _modelopt_nvfp4(n, k, seed, *, gs=0.0173, input_scale=0.021, prefix=P):
    g = torch.Generator().manual_seed(seed)
    sd = {
        f"{prefix}.weight": random_codes(n, k, g),
        f"{prefix}.weight_scale": random_e4m3_scales((n, k // 16), g),
        f"{prefix}.weight_scale_2": torch.tensor([gs], dtype=torch.float32),
    }
    if input_scale is not None:
        sd[f"{prefix}.input_scale"] = torch.tensor([input_scale], dtype=torch.float32)
    return sd


def _x(m, k, dtype=torch.bfloat16, seed=0):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _w64(sd, prefix=P):
    return nvfp4_weight64(
        sd[f"{prefix}.weight"], sd[f"{prefix}.weight_scale"], sd[f"{prefix}.weight_scale_2"]
    )


# -- configs -----------------------------------------------------------------------------------


def test_modelopt_legacy_and_config_json_forms():
    legacy = {
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": 16,
            "exclude_modules": ["lm_head", "*.mlp.gate"],
        }
    }
    modern = {
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "ignore": ["lm_head", "model.layers.*.mlp.gate"],
        }
    }
    for cfg in (legacy, modern):
        c = parse_quant_config(cfg)
        assert c.producer == "modelopt"
        assert c.layer(P).format == "nvfp4" and c.layer(P).scheme is Scheme.WEIGHT_ACT
        assert c.layer("lm_head") is None
        assert c.layer("model.layers.3.mlp.gate") is None
        assert c.layer("model.layers.3.mlp.gate_proj") is not None


def test_modelopt_mixed_precision():
    c = parse_quant_config(
        {
            "quantization": {
                "quant_algo": "MIXED_PRECISION",
                "quantized_layers": {
                    "model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
                    "model.layers.0.mlp.up_proj": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
                    "model.layers.0.self_attn.o_proj": {"quant_algo": "FP8"},
                },
            }
        }
    )
    assert c.layer(P).scheme is Scheme.WEIGHT_ACT
    assert c.layer("model.layers.0.mlp.up_proj").scheme is Scheme.WEIGHT_ONLY
    assert c.layer("model.layers.0.self_attn.o_proj").format == "fp8"
    assert c.layer("model.layers.0.self_attn.q_proj") is None  # not listed: unquantized


def test_compressed_tensors_config_groups_and_regex_ignore():
    c = parse_quant_config(
        {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "group_size": 16,
                        "strategy": "tensor_group",
                    },
                    "input_activations": {"num_bits": 4, "type": "float", "group_size": 16},
                }
            },
            "ignore": ["lm_head", "re:.*mlp.gate$"],
        }
    )
    assert c.layer(P).format == "nvfp4" and c.layer(P).scheme is Scheme.WEIGHT_ACT
    assert c.layer("model.layers.1.mlp.gate") is None
    assert c.layer("lm_head") is None


def test_gpt_oss_and_fp8_configs(tmp_path):
    c = parse_quant_config(
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    )
    assert c.layer("model.layers.0.mlp.experts.down_proj").format == "mxfp4"
    f = parse_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert f.layer(P).fp8_block == (128, 128)
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}}')
    assert load_quant_config(tmp_path).producer == "fp8"
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert load_quant_config(tmp_path) is None


def test_unknown_quant_algo_and_method_are_clear_errors():
    with pytest.raises(
        CheckpointError, match=r"unknown ModelOpt quant_algo 'INT4_AWQ'.*reads NVFP4"
    ):
        parse_quant_config({"quantization": {"quant_algo": "INT4_AWQ"}})
    with pytest.raises(CheckpointError, match="unknown quantization config"):
        parse_quant_config({"quant_method": "gptq"})
    with pytest.raises(CheckpointError, match="group size of exactly 16"):
        parse_quant_config({"quantization": {"quant_algo": "NVFP4", "group_size": 32}})


# -- NVFP4 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_modelopt_w4a4_layer_matches_float64(dtype):
    sd = _modelopt_nvfp4(96, 64, seed=1)
    cfg = {"quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    layer = QuantLinear.from_checkpoint(sd, P, cfg, act_dtype=dtype, device="cpu")
    assert layer.request.scheme is Scheme.WEIGHT_ACT
    assert "weight-only" in layer.decision.reason  # W4A4 served weight-only, and it says so
    x = _x(5, 64, dtype)
    assert rel_err(layer(x), linear64(x, _w64(sd))) < (4e-3 if dtype == torch.bfloat16 else 6e-4)


def test_w4a16_checkpoint_without_input_scale():
    sd = _modelopt_nvfp4(32, 64, seed=2, input_scale=None)
    layer = QuantLinear.from_checkpoint(
        sd, P, {"quantization": {"quant_algo": "W4A16_NVFP4"}}, device="cpu"
    )
    assert layer.request.scheme is Scheme.WEIGHT_ONLY


def test_compressed_tensors_package_checkpoint_loads_and_matches_its_decompression():
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is the oracle")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    assert ct
    g = torch.Generator().manual_seed(7)
    n, k = 48, 128
    w = torch.randn(n, k, generator=g) * 0.05
    w[2] *= 1e-4  # subnormal block scales
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    gs = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(n, k // 16, 16)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": gs, "weight_zero_point": zp}
    packed = NVFP4PackedCompressor.compress(state, scheme)
    theirs = NVFP4PackedCompressor.decompress(dict(packed), scheme)["weight"]  # bf16

    sd = {f"{P}.{name}": t for name, t in packed.items()}
    layer = QuantLinear.from_checkpoint(sd, P, device="cpu")
    assert layer.request.scheme is Scheme.WEIGHT_ONLY
    # The identity as input reads the dequantized weight back: equal within bf16 rounding.
    eye = torch.eye(k, dtype=torch.bfloat16)
    ours = layer(eye).T.double()
    diff = (ours - theirs.double()).abs()
    assert bool((diff <= theirs.double().abs() * 2.0**-8 + 1e-30).all())
    assert (ours == theirs.double()).float().mean() > 0.99

    # The same weights in ModelOpt's convention give the same outputs.
    modelopt = {
        f"{P}.weight": packed["weight_packed"],
        f"{P}.weight_scale": packed["weight_scale"],
        f"{P}.weight_scale_2": (1.0 / packed["weight_global_scale"].double()).float(),
    }
    other = QuantLinear.from_checkpoint(modelopt, P, device="cpu")
    x = _x(4, k, seed=3)
    a, b = layer(x).double(), other(x).double()
    assert float((a - b).abs().max()) <= float(a.abs().max()) * 2.0**-7


def test_compressed_tensors_mxfp4_and_weight_shape_check():
    g = torch.Generator().manual_seed(8)
    n, k = 40, 64
    sd = {
        f"{P}.weight_packed": random_codes(n, k, g),
        f"{P}.weight_scale": torch.randint(120, 130, (n, k // 32), generator=g).to(torch.uint8),
        f"{P}.weight_shape": torch.tensor([n, k]),
    }
    layer = QuantLinear.from_checkpoint(sd, P, device="cpu")
    x = _x(3, k)
    ref = linear64(x, mxfp4_weight64(sd[f"{P}.weight_packed"], sd[f"{P}.weight_scale"]))
    assert layer.format == "mxfp4" and rel_err(layer(x), ref) < 4e-3
    sd[f"{P}.weight_shape"] = torch.tensor([n, k - 1])
    with pytest.raises(CheckpointError, match="weight_shape says"):
        read_linear(sd, P)


def test_gpt_oss_blocks_linear():
    g = torch.Generator().manual_seed(9)
    n, k = 24, 96
    blocks = random_codes(n, k, g).reshape(n, k // 32, 16)
    scales = torch.randint(118, 130, (n, k // 32), generator=g).to(torch.uint8)
    bias = torch.randn(n, generator=g)
    sd = {f"{P}_blocks": blocks, f"{P}_scales": scales, f"{P}_bias": bias}
    layer = QuantLinear.from_checkpoint(sd, P, {"quant_method": "mxfp4"}, device="cpu")
    x = _x(2, k)
    ref = linear64(x, mxfp4_weight64(blocks.reshape(n, -1), scales), bias)
    assert rel_err(layer(x), ref) < 4e-3


# -- FP8 ----------------------------------------------------------------------------------------


def _fp8_codes(n, k, g):
    return (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_fp8_from_both_producers_and_deepseek_blocks():
    g = torch.Generator().manual_seed(10)
    n, k = 64, 256
    wq = _fp8_codes(n, k, g)
    x = _x(3, k)
    cases = {
        "modelopt per-tensor + static input": (
            {
                f"{P}.weight": wq,
                f"{P}.weight_scale": torch.tensor(0.004),
                f"{P}.input_scale": torch.tensor(0.02),
            },
            None,
        ),
        "compressed-tensors per-channel [N,1]": (
            {f"{P}.weight": wq, f"{P}.weight_scale": torch.rand(n, 1, generator=g) + 0.01},
            None,
        ),
        "deepseek 128x128 scale_inv": (
            {f"{P}.weight": wq, f"{P}.weight_scale_inv": torch.rand(1, 2, generator=g) + 0.01},
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
        ),
    }
    for name, (sd, cfg) in cases.items():
        layer = QuantLinear.from_checkpoint(sd, P, cfg, device="cpu")
        loaded = read_linear(sd, P)
        block = loaded.weight.block_size
        ref = linear64(x, fp8_weight64(wq, loaded.weight.scale, block))
        assert layer.request.scheme is Scheme.WEIGHT_ACT, name
        assert rel_err(layer(x), ref) < 4e-3, name


# -- fused shards --------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.25, 0.3])
def test_fused_qkv_with_different_global_scales(ratio):
    names = ["q_proj", "k_proj", "v_proj"]
    sd = {}
    for i, nm in enumerate(names):
        sd |= _modelopt_nvfp4(
            32, 64, seed=20 + i, gs=0.01 * (ratio**i), input_scale=0.02, prefix=f"a.{nm}"
        )
    layer = QuantLinear.from_checkpoint(sd, [f"a.{nm}" for nm in names], device="cpu")
    assert layer.out_features == 96
    w64 = torch.cat([_w64(sd, f"a.{nm}") for nm in names])
    x = _x(4, 64)
    err = rel_err(layer(x), linear64(x, w64))
    if ratio == 0.25:  # powers of two: the merge is exact
        assert err < 4e-3
    else:  # e4m3 re-rounding of rescaled block scales: <= 2^-4 per block, ~2^-6 on average
        assert err < 4e-2
    # never the silent "take the max global scale" bug: that would scale k/v by 1/ratio^i
    wrong = torch.cat([_w64(sd, f"a.{nm}") / (ratio**i) for i, nm in enumerate(names)])
    assert rel_err(layer(x), linear64(x, wrong)) > 0.5


def test_safetensors_checkpoint(tmp_path):
    from safetensors.torch import save_file

    sd = _modelopt_nvfp4(32, 48, seed=30)
    save_file(sd, str(tmp_path / "model.safetensors"))
    lazy = SafetensorsStateDict(tmp_path)
    layer = QuantLinear.from_checkpoint(lazy, P, device="cpu")
    x = _x(2, 48)
    assert rel_err(layer(x), linear64(x, _w64(sd))) < 4e-3


# -- bad input ---------------------------------------------------------------------------------


def _without(sd, suffix):
    return {k: v for k, v in sd.items() if not k.endswith(suffix)}


@pytest.mark.parametrize(
    ("mutate", "exc", "fragment"),
    [
        (
            lambda sd: _without(sd, ".weight_scale_2"),
            CheckpointError,
            f"missing tensor '{P}.weight_scale_2'",
        ),
        (
            lambda sd: sd | {f"{P}.weight_zero_point": torch.zeros(1)},
            CheckpointError,
            "unexpected tensor",
        ),
        (
            lambda sd: sd | {f"{P}.weight_scale_2": torch.tensor([float("nan")])},
            WeightFormatError,
            "weight_scale_2",
        ),
        (
            lambda sd: sd | {f"{P}.weight_scale_2": torch.tensor([-1.0])},
            WeightFormatError,
            "global_scale",
        ),
        (
            lambda sd: sd | {f"{P}.weight_scale_2": torch.tensor([float("inf")])},
            WeightFormatError,
            "global_scale",
        ),
        (
            lambda sd: sd | {f"{P}.weight_scale": sd[f"{P}.weight_scale"].float()},
            WeightFormatError,
            "float8_e4m3fn",
        ),
        (
            lambda sd: sd | {f"{P}.weight_scale": sd[f"{P}.weight_scale"][:-1]},
            WeightFormatError,
            "rows",
        ),
        (
            lambda sd: sd | {f"{P}.weight": sd[f"{P}.weight"][:, :6]},
            WeightFormatError,
            "multiple of 16",
        ),
        (lambda sd: _without(sd, ".weight"), CheckpointError, "no quantized weight"),
    ],
)
def test_bad_modelopt_tensors(mutate, exc, fragment):
    sd = mutate(_modelopt_nvfp4(32, 64, seed=40))
    with pytest.raises(exc) as e:
        QuantLinear.from_checkpoint(sd, P, device="cpu")
    assert fragment in str(e.value)


def test_nan_and_negative_block_scales_are_rejected():
    sd = _modelopt_nvfp4(32, 64, seed=41)
    bits = sd[f"{P}.weight_scale"].view(torch.uint8).clone()
    bits[3, 1] = 0x7F  # NaN
    with pytest.raises(WeightFormatError, match="NaN"):
        read_linear(sd | {f"{P}.weight_scale": bits.view(torch.float8_e4m3fn)}, P)
    bits = sd[f"{P}.weight_scale"].view(torch.uint8).clone()
    bits[0, 0] = 0x80 | 0x38  # -1.0
    with pytest.raises(WeightFormatError, match="negative"):
        read_linear(sd | {f"{P}.weight_scale": bits.view(torch.float8_e4m3fn)}, P)


def test_config_and_tensors_must_agree():
    sd = _modelopt_nvfp4(32, 64, seed=42)
    with pytest.raises(CheckpointError, match=r"config says .* is fp8 but its tensors are nvfp4"):
        QuantLinear.from_checkpoint(sd, P, {"quant_method": "fp8"}, device="cpu")
    with pytest.raises(CheckpointError, match=r"missing tensor .*input_scale.*W4A4"):
        QuantLinear.from_checkpoint(
            _without(sd, ".input_scale"), P, {"quantization": {"quant_algo": "NVFP4"}}, device="cpu"
        )
    with pytest.raises(CheckpointError, match=r"unexpected tensor .*input_scale.*weight-only"):
        QuantLinear.from_checkpoint(
            sd, P, {"quantization": {"quant_algo": "W4A16_NVFP4"}}, device="cpu"
        )


def test_excluded_module_is_not_loaded_as_quantized():
    sd = _modelopt_nvfp4(32, 64, seed=43, prefix="lm_head")
    with pytest.raises(CheckpointError, match="not quantized in this checkpoint"):
        QuantLinear.from_checkpoint(
            sd, "lm_head", {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}
        )


def test_unquantized_weight_is_explained():
    with pytest.raises(CheckpointError, match="not quantized"):
        read_linear({f"{P}.weight": torch.randn(4, 4)}, P)


def test_load_linear_gives_nn_linear_for_excluded_layers_and_quantlinear_otherwise():
    from quantdispatch.layers import load_linear

    cfg = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}
    head = torch.randn(16, 32)
    sd = _modelopt_nvfp4(32, 64, seed=44) | {"lm_head.weight": head}
    plain = load_linear(sd, "lm_head", cfg, device="cpu")
    assert type(plain) is torch.nn.Linear and plain.weight.dtype == torch.bfloat16
    assert torch.equal(plain.weight, head.to(torch.bfloat16))
    quant = load_linear(sd, P, cfg, device="cpu")
    assert isinstance(quant, QuantLinear)


def test_compressed_tensors_mxfp4_compressor_checkpoint():
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is the oracle")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    g = torch.Generator().manual_seed(45)
    n, k = 40, 128
    w = torch.randn(n, k, generator=g) * 0.1
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    groups = w.reshape(n, k // 32, 32)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    packed = MXFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme
    )
    theirs = MXFP4PackedCompressor.decompress(dict(packed), scheme)["weight"]
    layer = QuantLinear.from_checkpoint(
        {f"{P}.{k_}": v for k_, v in packed.items()}, P, device="cpu"
    )
    assert layer.format == "mxfp4"
    # power-of-two scales: reading the weight back through an identity input is exact
    assert torch.equal(layer(torch.eye(k, dtype=torch.bfloat16)).T, theirs)

"""describe_model / render_description: what `quantdispatch doctor --model` will print, from the
checkpoint's headers (no weights read), on this machine or a simulated GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_models import float_model, make_config, write_checkpoint

from quantdispatch.integrations.transformers import describe_model, render_description


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("describe")
    write_checkpoint(float_model(make_config("qwen3_moe")), root / "qwen", arch="qwen3_moe")
    write_checkpoint(float_model(make_config("gpt_oss")), root / "oss", arch="gpt_oss")
    write_checkpoint(
        float_model(make_config("llama")), root / "fp8", arch="llama", fmt="fp8", producer="ct"
    )
    return root


def _kinds(d):
    return {(r["op"], r["format"], r["n"], r["k"], r["experts"]): r for r in d["layers"]}


def test_moe_checkpoint_kinds_counts_and_cpu_decision(ckpts):
    d = describe_model(ckpts / "qwen", "cpu")
    assert d["model_type"] == "qwen3_moe" and d["quantization"] == {"producer": "modelopt"}
    kinds = _kinds(d)
    # q/o: 64x64, k/v: 32x64 per layer (2 layers); experts: one kind for both MoE layers
    assert kinds[("linear", "nvfp4", 64, 64, None)]["count"] == 4
    assert kinds[("linear", "nvfp4", 32, 64, None)]["count"] == 4
    moe = kinds[("moe", "nvfp4", 64, 64, 4)]
    assert moe["count"] == 2 and moe["top_k"] == 2 and moe["examples"][0] == "model.layers.0.mlp"
    assert all(r["backend"] == "reference" and r["scheme_label"] == "W4A16" for r in d["layers"])
    assert "lm_head" in d["unquantized"]["examples"]


def test_simulated_gpu_and_text(ckpts):
    pytest.importorskip("triton")
    d = describe_model(ckpts / "qwen", "h100")
    assert d["simulated"] and "H100" in d["device"]
    assert {r["backend"] for r in d["layers"]} == {"triton"}
    assert all(r["kernels"] and r["kernels"][0]["family"] for r in d["layers"])
    text = render_description(d)
    assert "simulated" in text and "moe    nvfp4 W4A16 E=4 I=64 H=64 x2 -> triton" in text
    assert len(text.splitlines()) <= 10
    verbose = render_description(d, verbose=True)
    assert "not cutlass" in verbose and len(verbose) > len(text)


def test_gpt_oss_and_fp8_checkpoints(ckpts):
    oss = describe_model(ckpts / "oss", "a100")
    assert [(r["op"], r["format"], r["experts"], r["n"], r["k"]) for r in oss["layers"]] == [
        ("moe", "mxfp4", 4, 64, 64)
    ]
    assert oss["unquantized"]["count"] > 4  # attention and routers stay bf16 in gpt-oss
    fp8 = describe_model(ckpts / "fp8", "h100")
    assert {r["scale_kind"] for r in fp8["layers"]} == {"channel"}
    assert {r["scheme_label"] for r in fp8["layers"]} == {"W8A16"}
    assert "(channel scales)" in render_description(fp8)


def test_doctor_model_flag_prints_the_description(ckpts, capsys):
    pytest.importorskip("triton")
    import json

    from quantdispatch.cli import main

    assert main(["doctor", "--model", str(ckpts / "qwen"), "--device", "h100"]) == 0
    text = capsys.readouterr().out
    assert "moe    nvfp4 W4A16 E=4 I=64 H=64 x2 -> triton" in text and "simulated" in text
    assert main(["doctor", "--model", str(ckpts / "oss"), "--device", "a100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layers"][0]["format"] == "mxfp4" and d["layers"][0]["backend"] == "triton"

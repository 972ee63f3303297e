"""`quantdispatch doctor`: human output, JSON schema, matrix, exit codes, one-line errors."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys

import pytest

from quantdispatch.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(capsys, *argv):
    code, out, err = _run(capsys, "doctor", "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def _decision(data, fmt="nvfp4", op="linear", act="bf16"):
    return next(
        d for d in data["decisions"] if (d["format"], d["op"], d["act_dtype"]) == (fmt, op, act)
    )


def test_doctor_on_this_cpu_machine(capsys):
    code, out, err = _run(capsys, "doctor", "--device", "cpu")
    assert code == 0, err
    assert "nvfp4 linear" in out and "-> reference" in out


def test_json_schema(capsys):
    data = _json(capsys, "--device", "h100")
    assert set(data) >= {"device", "providers", "settings", "decisions"}
    assert data["device"]["name"] == "NVIDIA H100 80GB HBM3"
    assert data["device"]["sources"]["capability"] == "preset"
    assert {p["name"] for p in data["providers"]} == {"triton", "sgl-kernel", "flashinfer"}
    assert len(data["decisions"]) == 3 * 2 * 2  # formats x ops x act dtypes
    for d in data["decisions"]:
        assert {"format", "op", "act_dtype", "backend", "reason", "trace"} <= set(d)
        for c in d["trace"]:
            assert set(c) == {"backend", "accepted", "reason"}
            assert isinstance(c["accepted"], bool) and c["reason"]


def test_v100_json_nvfp4_reference_and_sm70_reason(capsys):
    d = _decision(_json(capsys, "--device", "v100"))
    assert d["backend"] == "reference"
    others = [c for c in d["trace"] if c["backend"] != "reference"]
    assert others and all("SM 7.0" in c["reason"] for c in others)


def test_t4_bf16_vs_fp16(capsys):
    data = _json(capsys, "--device", "t4")
    bf = {c["backend"]: c for c in _decision(data, act="bf16")["trace"]}
    fp = {c["backend"]: c for c in _decision(data, act="fp16")["trace"]}
    for name in ("triton", "marlin"):
        assert "bf16" in bf[name]["reason"]
        assert "bf16" not in fp[name]["reason"]


def test_h100_fp4_vs_fp8_capability(capsys):
    data = _json(capsys, "--device", "h100")
    nv = {c["backend"]: c for c in _decision(data)["trace"]}
    f8 = {c["backend"]: c for c in _decision(data, fmt="fp8")["trace"]}
    assert (
        "no FP4 tensor cores" in nv["cutlass"]["reason"]
        and "no FP4 tensor cores" in nv["torch"]["reason"]
    )
    assert "tensor cores" not in f8["cutlass"]["reason"] and f8["torch"]["accepted"]


@pytest.mark.parametrize("preset", ["rtx5090", "gb10"])
def test_sm120_family_named(capsys, preset):
    d = _decision(_json(capsys, "--device", preset))
    text = " ".join(c["reason"] for c in d["trace"])
    assert "sm120 family" in text


def test_forced_backend_that_cannot_run_exits_nonzero_with_reason(capsys, monkeypatch):
    monkeypatch.setenv("QUANTDISPATCH_BACKEND_NVFP4", "cutlass")
    code, _out, err = _run(capsys, "doctor", "--device", "h100")
    assert code == 1
    assert err.count("\n") == 1 and "no FP4 tensor cores" in err
    assert "Traceback" not in err


def test_bad_env_value_exits_nonzero_listing_valid_backends(capsys, monkeypatch):
    monkeypatch.setenv("QUANTDISPATCH_DISABLE", "bogus")
    code, out, err = _run(capsys, "doctor")
    assert code == 2 and out == ""
    assert (
        err.count("\n") == 1 and "valid backends: cutlass, torch, triton, marlin, reference" in err
    )


def test_bad_policy_file_exits_2(capsys, tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('[nvfp4]\nlinear = ["nope"]\n')
    code, _out, err = _run(capsys, "doctor", "--policy", str(f))
    assert code == 2 and "'nope'" in err and err.count("\n") == 1


def test_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--frobnicate"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--frobnicate" in err


def test_shape_answers_for_one_linear_layer(capsys):
    """--shape NxK: the linear decisions for that weight (its M ranges), MoE ones unchanged;
    --verbose gives the backend's whole text."""
    pytest.importorskip("triton")
    argv = ("doctor", "--device", "h200", "--format", "nvfp4", "--act-dtype", "bf16")
    code, out, err = _run(capsys, *argv, "--shape", "28672x4096", "--verbose")
    assert code == 0, err
    assert "nvfp4 linear (W4A4, bf16, N=28672 K=4096)" in out
    assert "M <= 16: mma.sync kernel" in out and "M <= 512: tl.dot (wgmma) GEMM" in out
    assert "nvfp4 moe (W4A4, bf16) on" in out
    code, out, err = _run(capsys, *argv, "--verbose")  # no shape: the rules by weight size
    assert code == 0, err
    assert "M <= 32 (16 for weights of 2^25+ elements): mma.sync kernel" in out
    assert "--shape NxK answers for one layer" in out


def test_shape_concise_names_the_kernel_family_per_m_range(capsys):
    """One line for the chosen backend of a shaped layer: its kernel families by M, as the
    decision's kernel_ranges give them (neighbouring ranges of one family merged)."""
    pytest.importorskip("triton")
    from quantdispatch.api import select

    argv = ("doctor", "--device", "h200", "--format", "nvfp4", "--act-dtype", "bf16")
    code, out, err = _run(capsys, *argv, "--op", "linear", "--shape", "6144x4096")
    assert code == 0, err
    ranges = select("nvfp4", "linear", "bf16", n=6144, k=4096, device="h200").kernel_ranges()
    assert "nvfp4 linear 6144x4096 W4A4 bf16 -> triton" in out
    for r in ranges:
        assert r.family in out
    assert f"M <= {ranges[0].last_m}: {ranges[0].family}" in out
    assert f"M >= {ranges[-1].first_m}: {ranges[-1].family}" in out


@pytest.mark.parametrize("bad", ["6144", "6144x", "x4096", "0x64", "64x-1", "axb"])
def test_a_malformed_shape_is_one_line_naming_the_form(capsys, bad):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--shape", bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert f"--shape {bad!r}: expected NxK" in err and "e.g. --shape 6144x4096" in err


def test_unknown_device_and_format(capsys):
    code, _, err = _run(capsys, "doctor", "--device", "h300")
    assert code == 2 and "valid presets" in err
    code, _, err = _run(capsys, "doctor", "--format", "int3")
    assert code == 2 and "valid formats" in err


def test_matrix_covers_every_preset(capsys):
    code, out, err = _run(capsys, "doctor", "--matrix", "--json")
    assert code == 0, err
    m = json.loads(out)["matrix"]
    from quantdispatch.device import PRESETS

    assert set(m) == set(PRESETS)
    assert m["h200"]["nvfp4/linear/bf16"] == "triton"
    assert m["v100"]["nvfp4/linear/bf16"] == "reference"
    assert m["h100"]["fp8/linear/bf16"] == "torch"
    code, out, _ = _run(capsys, "doctor", "--matrix")
    assert code == 0 and "h200" in out and "nvfp4/linear/bf16" in out


def test_presets_command(capsys):
    code, out, _ = _run(capsys, "presets")
    assert code == 0 and "rtx5090" in out and "12.0" in out


def test_console_script_runs_on_this_machine():
    exe = shutil.which("quantdispatch")
    cmd = [exe, "doctor"] if exe else [sys.executable, "-m", "quantdispatch", "doctor"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Decisions" in out.stdout


def test_verify_runs_every_runnable_backend_against_float64(capsys):
    code, out, err = _run(capsys, "verify", "--format", "nvfp4", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert rows and all(r["ok"] and 0 < r["rel_err"] < r["bound"] for r in rows)
    assert {r["act_dtype"] for r in rows} == {"bf16", "fp16"}


def test_verify_refuses_a_simulated_device(capsys, monkeypatch):
    monkeypatch.setenv("QUANTDISPATCH_DEVICE", "h100")
    code, _, err = _run(capsys, "verify")
    assert code == 1 and "verify runs kernels" in err


def test_moe_answers_for_one_moe_layer(capsys):
    """--moe E,TOPK,H,I --verbose: the kernel for every M range of that layer, from the MoE
    decision's kernel ranges (gpt-oss-20b on a simulated H200: single pairs, 8-pair blocks
    with K split 4 ways on its few programs, grouped GEMM tiles to any M: its experts are too
    small for dequantize + grouped_mm to pay; Mixtral's dequantize from 768 tokens per
    expert)."""
    pytest.importorskip("triton")
    argv = ("doctor", "--device", "h200", "--format", "mxfp4", "--op", "moe", "--act-dtype", "bf16")
    code, out, err = _run(capsys, *argv, "--moe", "32,4,2880,2880", "--verbose")
    assert code == 0, err
    assert "MoE layer: 32 experts, top-4, hidden 2880, intermediate 2880" in out
    assert "M = 1 (0.125 tokens per expert): single (token, slot) pairs" in out
    assert "M 3..32 (0.375..4 tokens per expert): mma.sync kernels, blocks of 8 pairs" in out
    assert "K split 4 / 4 ways, 1 / 1 chunks in flight" in out
    assert "dequantized" not in out.split("MoE layer:")[1]
    assert "M >= 769 (96.125+ tokens per expert): grouped tl.dot GEMM" in out
    code, out, err = _run(capsys, *argv[:4], "nvfp4", *argv[5:], "--moe", "8,2,4096,14336", "-v")
    assert code == 0, err
    assert "M >= 3072 (768+ tokens per expert): experts dequantized per GEMM" in out


def test_moe_ranges_are_the_decisions(capsys):
    """The JSON ranges cover M = 1.. without gaps and are the MoE decision's kernel_ranges for
    that layer (select(..., n=I, k=H, experts=E)), on GPUs with and without grouped_mm."""
    pytest.importorskip("triton")
    from quantdispatch.api import select

    for device in ("h200", "a100", "rtx4090"):
        data = _json(capsys, "--device", device, "--op", "moe", "--moe", "8,2,4096,14336")
        layer = data["moe_layer"]
        assert {"experts", "top_k", "hidden", "intermediate", "note", "ranges"} <= set(layer)
        ranges = layer["ranges"]
        assert ranges[0]["m_min"] == 1 and ranges[-1]["m_max"] is None
        for prev, cur in itertools.pairwise(ranges):
            assert cur["m_min"] == prev["m_max"] + 1
        for d in data["decisions"]:
            want = select(
                d["format"], "moe", d["act_dtype"], n=14336, k=4096, experts=8, device=device
            ).kernel_ranges(top_k=2)
            got = [
                {k: v for k, v in r.items() if k != "tokens_per_expert"} for r in d["kernel_ranges"]
            ]
            assert got == [r.to_dict() for r in want]
        first = data["decisions"][0]
        assert (layer["format"], layer["backend"]) == (first["format"], first["backend"])
        assert [r["kernel"] for r in ranges] == [r["detail"] for r in first["kernel_ranges"]]


def test_moe_layers_the_repacked_kernels_cannot_take(capsys):
    """A T4 (SM 7.5) or an H that is no multiple of 64: the decision says which kernels run."""
    from quantdispatch.api import select

    for device, h in (("t4", 4096), ("h200", 4000)):
        moe = f"8,2,{h},14336"
        code, out, err = _run(capsys, "doctor", "--device", device, "--op", "moe", "--moe", moe)
        assert code == 0, err
        d = select("nvfp4", "moe", "bf16", n=14336, k=h, experts=8, device=device)
        assert f"nvfp4 moe E=8 top-2 H={h} I=14336" in out
        for r in d.kernel_ranges(top_k=2):
            assert r.family in out


@pytest.mark.parametrize("bad", ["8,2,4096", "8,2,4096,x", "8,0,4096,14336", "8,9,4096,14336"])
def test_a_malformed_moe_is_one_line_naming_the_form(capsys, bad):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--moe", bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"--moe {bad!r}" in err


def test_no_numpy_warning_from_torch_in_the_cli():
    """Without numpy (a fresh install has none) torch warns when imported; the CLI, which uses no
    numpy, does not print that warning (run in a fresh interpreter with numpy blocked)."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "from quantdispatch.cli import main\n"
        "sys.exit(main(['presets']))\n"
    )
    run = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "NumPy" not in run.stderr

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
    pytest.importorskip("triton")
    code, out, err = _run(capsys, "doctor", "--matrix", "--json")
    assert code == 0, err
    m = json.loads(out)["matrix"]
    from quantdispatch.device import PRESETS

    assert set(m) == set(PRESETS)
    assert m["h200"]["nvfp4/linear/bf16"] == "triton"
    assert m["v100"]["nvfp4/linear/bf16"] == "reference"
    assert m["h100"]["fp8/linear/bf16"] == "torch"
    code, out, _ = _run(capsys, "doctor", "--matrix")
    assert code == 0 and "h200" in out and "nvfp4 linear" in out


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
        data = _json(
            capsys, "--device", device, "--op", "moe", "--moe", "8,2,4096,14336",
            "--act-dtype", "bf16", "--format", "nvfp4", "--format", "fp8",
        )  # fmt: skip
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


# ---------------------------------------------------------------------------------------------
# The concise doctor, the parser without torch, the header's fixes


def _lines(capsys, *argv):
    code, out, err = _run(capsys, "doctor", *argv)
    assert code == 0, err
    return out.splitlines()


@pytest.mark.parametrize("device", [None, "cpu", "a100", "h200", "b200"])
def test_doctor_fits_one_screen(capsys, device):
    """Every format, op and act dtype on one screen (this machine's probe, a CPU, GPUs), and no
    line wider than 100 columns."""
    lines = _lines(capsys, *(["--device", device] if device else []))
    assert len(lines) <= 45, "\n".join(lines)
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)


def test_concise_groups_dtypes_and_cuts_reasons(capsys):
    """One line per (format, op) where bf16 and fp16 decide alike, the chosen backend on it;
    rejected candidates one line each, the reason cut to its first clause."""
    pytest.importorskip("triton")
    lines = _lines(capsys, "--device", "cpu")
    heads = [line for line in lines if line.startswith("nvfp4 linear")]
    assert heads == [heads[0]] and "bf16/fp16 -> reference" in heads[0]
    assert "  no cutlass    needs a CUDA GPU" in lines
    code, out, _ = _run(capsys, "doctor", "--device", "h200", "--format", "mxfp4", "--op", "linear")
    assert code == 0
    assert "mxfp4 linear W4A16 bf16 -> triton" in out and "mxfp4 linear W4A16 fp16 -> triton" in out
    assert "  no marlin     no usable Marlin provider\n" in out  # the provider list: --verbose
    assert "  ok reference (could also run)" in out


def test_verbose_keeps_the_full_text(capsys):
    code, out, err = _run(capsys, "doctor", "--device", "h200", "--verbose")
    assert code == 0, err
    assert "Device\n  device                    NVIDIA H200" in out and "[preset]" in out
    assert "Decisions (-> chosen; 'no' rejected; 'ok' could also run)" in out
    assert "  no marlin     no usable Marlin provider (vllm: not installed" in out
    assert "first that can run in the policy order cutlass > torch > triton" in out


def test_version(capsys):
    from quantdispatch import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"quantdispatch {__version__}\n"


@pytest.mark.parametrize("argv", [["--help"], ["doctor", "--help"], ["--version"]])
def test_help_imports_no_torch(argv):
    """--help and --version parse and answer without importing torch (a fresh interpreter)."""
    code = (
        "import sys\n"
        "from quantdispatch.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', "
        "'triton', 'numpy'))\n"
        "print('HEAVY', heavy)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "HEAVY []" in run.stdout


def test_parser_choices_match_the_request_types():
    """The parser spells the ops, schemes and act dtypes itself (no torch import): the same."""
    from quantdispatch.cli import common as cli_main
    from quantdispatch.request import ACT_DTYPES, Op, Scheme

    assert tuple(o.value for o in Op) == cli_main.OPS
    assert tuple(s.value for s in Scheme) == cli_main.SCHEMES
    assert tuple(ACT_DTYPES) == cli_main.ACT_DTYPE_NAMES


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--frobnicate"], "(see quantdispatch --help)"),
        (["doctor", "--frobnicate"], "(see quantdispatch doctor --help)"),
        (["doctor", "--tp", "2"], "(see quantdispatch doctor --help)"),
        (["verify", "--frobnicate"], "(see quantdispatch verify --help)"),
    ],
)
def test_error_hint_names_the_command_with_single_spaces(capsys, argv, hint):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.rstrip().endswith(hint)
    assert "  " not in err


def test_simulated_device_is_named_in_settings(capsys, monkeypatch):
    code, out, _ = _run(capsys, "doctor", "--device", "a100", "--verbose")
    assert code == 0
    assert "  simulated device          preset 'a100' (--device)" in out
    assert "none (probed)" not in out
    assert "SIMULATED preset 'a100' (--device)" in _run(capsys, "doctor", "--device", "a100")[1]
    monkeypatch.setenv("QUANTDISPATCH_DEVICE", "h100")
    code, out, _ = _run(capsys, "doctor", "--verbose")
    assert code == 0 and "  simulated device          preset 'h100' (QUANTDISPATCH_DEVICE)" in out
    monkeypatch.delenv("QUANTDISPATCH_DEVICE")
    code, out, _ = _run(capsys, "doctor", "--device", "cpu", "--verbose")  # asked, not simulated
    assert code == 0 and "  simulated device          none (probed)" in out


@pytest.mark.parametrize(
    ("device", "shown"),
    [("cpu", False), ("t4", False), ("a100", False), ("h200", True), ("b200", True)],
)
def test_dependent_launches_line_only_on_sm90_and_up(capsys, monkeypatch, device, shown):
    code, out, _ = _run(capsys, "doctor", "--device", device, "--verbose")
    assert code == 0 and ("dependent launches" in out) == shown
    assert "dependent launches" not in _run(capsys, "doctor", "--device", device)[1]
    monkeypatch.setenv("QUANTDISPATCH_PDL", "0")  # set: the concise header says so where it applies
    code, out, _ = _run(capsys, "doctor", "--device", device)
    assert code == 0 and ("PDL       dependent launches off" in out) == shown


def test_marlin_providers_in_the_header(capsys):
    from quantdispatch.backends import marlin_providers

    statuses = marlin_providers.statuses()
    lines = _lines(capsys, "--device", "h200")
    marlin = [line for line in lines if line.startswith("marlin    ")]
    assert len(marlin) == len(statuses)
    for line, s in zip(marlin, statuses, strict=True):
        assert line.startswith(f"marlin    {s.name}")
    code, out, _ = _run(capsys, "doctor", "--device", "h200", "--verbose")
    assert code == 0
    for s in statuses:
        assert f"  marlin      {s.describe()}" in out
    providers = _json(capsys, "--device", "h200")["marlin_providers"]
    assert [p["name"] for p in providers] == [s.name for s in statuses]


def test_settings_only_where_set(capsys, monkeypatch):
    pytest.importorskip("triton")
    lines = _lines(capsys, "--device", "h200")
    assert not any(line.startswith(("forced", "disabled", "policy")) for line in lines)
    monkeypatch.setenv("QUANTDISPATCH_BACKEND_NVFP4_LINEAR", "triton")
    monkeypatch.setenv("QUANTDISPATCH_DISABLE", "marlin")
    lines = _lines(capsys, "--device", "h200", "--format", "nvfp4")
    assert any(line.startswith("forced    nvfp4:linear=triton") for line in lines)
    assert "disabled  marlin" in lines
    assert any(line.startswith("nvfp4 linear") and "-> triton" in line and "(forced)" in line
               for line in lines)  # fmt: skip


def test_shape_with_tp_gives_each_shard(capsys):
    """--shape NxK --tp N: the column and row shard shapes of every rank, each with its
    decision's kernel ranges (quantdispatch.checkpoints' split rules)."""
    pytest.importorskip("triton")
    from quantdispatch.checkpoints import linear_shard_shapes

    argv = ("doctor", "--device", "h200", "--op", "linear", "--act-dtype", "bf16")
    code, out, err = _run(capsys, *argv, "--shape", "6144x4096", "--tp", "4")
    assert code == 0, err
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        col = linear_shard_shapes(6144, 4096, fmt, tp_size=4, parallel="column")
        row = linear_shard_shapes(6144, 4096, fmt, tp_size=4, parallel="row")
        assert col == [(1536, 4096)] * 4 and row == [(6144, 1024)] * 4
    assert out.count("  TP 4 column 1536x4096") == 3 and out.count("  TP 4 row 6144x1024") == 3
    data = _json(capsys, "--device", "h200", "--op", "linear", "--shape", "6144x4096", "--tp", "4")
    d = _decision(data)
    assert [(s["parallel"], s["ranks"], s["n"], s["k"]) for s in d["shards"]] == [
        ("column", [0, 1, 2, 3], 1536, 4096),
        ("row", [0, 1, 2, 3], 6144, 1024),
    ]
    assert d["shards"][0]["backend"] == "triton" and d["shards"][0]["kernel_ranges"]
    assert d["shard_error"] is None


def test_shape_tp_that_does_not_split_is_reported_per_format(capsys):
    """A K that is no whole number of scale groups: one line for each FP4 format, not a
    traceback; FP8 (per-channel scales) still splits; exit 1 with one line on stderr."""
    argv = ("doctor", "--device", "h200", "--op", "linear", "--act-dtype", "bf16")
    code, out, err = _run(capsys, *argv, "--shape", "6144x4104", "--tp", "2")
    assert code == 1 and "Traceback" not in out + err and err.count("\n") == 1
    assert "TP 2: cannot split: K = 4104 is not a whole number of NVFP4 scale groups" in out
    assert "TP 2: cannot split: K = 4104 is not a whole number of MXFP4 scale groups" in out
    assert "  TP 2 column 3072x4104" in out and "  TP 2 row 6144x2052" in out
    assert err.startswith("quantdispatch: error: nvfp4 over 2 ranks: K = 4104")


def test_moe_with_tp_gives_each_rank_intermediate_size(capsys):
    """--moe E,TOPK,H,I --tp N: each distinct per-rank I (quantdispatch.checkpoints'
    moe_shard_sizes) with its decision's kernel ranges; gpt-oss-20b over 4 ranks holds
    736 / 736 / 704 / 704 (MXFP4 groups of 32)."""
    pytest.importorskip("triton")
    from quantdispatch.api import select
    from quantdispatch.checkpoints import moe_shard_sizes

    assert moe_shard_sizes(2880, "mxfp4", 4) == [736, 736, 704, 704]
    argv = ("doctor", "--device", "h200", "--format", "mxfp4", "--op", "moe", "--act-dtype", "bf16")
    code, out, err = _run(capsys, *argv, "--moe", "32,4,2880,2880", "--tp", "4")
    assert code == 0, err
    assert "  TP 4 I=736 (ranks 0-1)" in out and "  TP 4 I=704 (ranks 2-3)" in out
    data = _json(capsys, *argv[1:], "--moe", "32,4,2880,2880", "--tp", "4")
    shards = _decision(data, "mxfp4", "moe")["shards"]
    assert [(s["ranks"], s["n"]) for s in shards] == [([0, 1], 736), ([2, 3], 704)]
    for s in shards:
        want = select("mxfp4", "moe", "bf16", n=s["n"], k=2880, experts=32, device="h200")
        assert [r["family"] for r in s["kernel_ranges"]] == [
            r.family for r in want.kernel_ranges(top_k=4)
        ]


def test_json_keys_unchanged(capsys):
    """--json keeps every key earlier versions gave (fields may be added, none removed)."""
    data = _json(capsys, "--device", "h200")
    assert {"quantdispatch", "device", "providers", "settings", "decisions"} <= set(data)
    assert {"forced", "disabled", "policy", "device", "pdl", "policy_files"} <= set(
        data["settings"]
    )
    old = {"format", "op", "act_dtype", "scheme", "scheme_label", "backend", "reason"}
    old |= {"forced_by", "policy", "trace"}
    for d in data["decisions"]:
        assert old <= set(d)
    data = _json(capsys, "--device", "h200", "--op", "moe", "--moe", "8,2,4096,14336")
    for r in data["moe_layer"]["ranges"]:
        assert {"m_min", "m_max", "tokens_per_expert", "kernel"} <= set(r)


def test_cli_asks_decisions_never_kernels():
    """The CLI names kernels through Decision.kernel_ranges / kernel_summary only."""
    from pathlib import Path

    import quantdispatch.cli as cli

    for path in Path(cli.__file__).parent.glob("*.py"):
        assert "quantdispatch.kernels" not in path.read_text(), path


@pytest.mark.parametrize(
    ("text", "short"),
    [
        ("needs a CUDA GPU; this device is a CPU", "needs a CUDA GPU"),
        (
            "no usable Marlin provider (vllm: not installed (pip install 'vllm>=0.30,<0.34', or "
            "register its compiled library with a long path); sgl-kernel: not installed (pip "
            "install sgl-kernel))",
            "no usable Marlin provider",
        ),
        (
            "SM 9.0 has no FP4 tensor cores (native NVFP4 needs the sm100 family (10.0, 10.1, "
            "10.3, 11.0) or the sm120 family (12.0, 12.1)); sgl-kernel is not installed",
            "SM 9.0 has no FP4 tensor cores",
        ),
        ("short (with an aside); second", "short (with an aside)"),
    ],
)
def test_shorten_keeps_the_first_clause(text, short):
    from quantdispatch.cli.phrases import shorten

    assert shorten(text) == short


def test_shorten_keeps_whole_phrases_and_prefixed_wraps_at_words():
    from quantdispatch.cli.phrases import WIDTH, prefixed, shorten

    phrases = "cutlass does not compute nvfp4 moe: no fused kernel is bound: the providers ship"
    assert shorten(phrases, 60) == "cutlass does not compute nvfp4 moe: no fused kernel is bound"
    lines = prefixed("  no cutlass    ", "word " * 40)
    assert len(lines) == 3 and all(len(x) <= WIDTH and "..." not in x for x in lines)
    assert " ".join(x.strip() for x in lines).split() == ["no", "cutlass", *["word"] * 40]


def test_doctor_on_a_real_gpu_says_what_the_self_check_found(monkeypatch, capsys):
    """A probed (not simulated) GPU: one 'checked' line per chosen backend; --verbose lists every
    backend. Nothing was probed in this process, so the triton backend is not yet checked."""
    pytest.importorskip("triton")
    import quantdispatch.device as device_pkg
    from quantdispatch.device import preset_profile

    gpu = preset_profile("h100").model_copy(update={"simulated": False, "preset": None})
    monkeypatch.setattr(device_pkg, "device_profile", lambda *_a, **_k: gpu)
    assert main(["doctor", "--format", "nvfp4", "--op", "linear"]) == 0
    out = capsys.readouterr().out
    assert "checked   triton: not yet checked here" in out
    assert main(["doctor", "--format", "nvfp4", "--op", "linear", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "Self-check on first use" in out and "  marlin: not yet checked here" in out

"""A new user's first commands: bad --model folders are one line and exit 2, a closed pipe
ends doctor quietly, the default view's lines are whole phrases within 100 columns, --matrix
fits 120 columns and marks the choices that run only behind the first-use self-check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantdispatch.api import select
from quantdispatch.cli import main
from quantdispatch.cli.matrix import MARK
from quantdispatch.device import PRESETS, preset_profile

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("quantdispatch: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _folders(root: Path) -> dict[str, Path]:
    """Checkpoint folders a user might point --model at by mistake."""
    out = {}
    out["missing"] = root / "nonexistent"
    out["a file"] = root / "file.txt"
    out["a file"].write_text("hello")
    for name in ("empty", "bad json", "json list", "not safetensors", "short file", "huge header"):
        out[name] = root / name.replace(" ", "_")
        out[name].mkdir()
    (out["bad json"] / "config.json").write_text("{bad")
    (out["json list"] / "config.json").write_text("[1, 2]")
    for name in ("not safetensors", "short file", "huge header"):
        (out[name] / "config.json").write_text('{"model_type": "llama"}')
    (out["not safetensors"] / "model.safetensors").write_bytes(os.urandom(4096))
    (out["short file"] / "model.safetensors").write_bytes(b"\x01\x02")
    (out["huge header"] / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    return out


def test_bad_model_folders_are_one_line_and_exit_2(capsys, tmp_path):
    for what, folder in _folders(tmp_path).items():
        code, _out, err = _run(capsys, "doctor", "--model", str(folder))
        line = _one_error_line(err)
        assert code == 2, (what, line)
        assert str(folder) in line or folder.name in line, (what, line)


def test_a_good_model_folder_after_the_fix(capsys, tmp_path):
    """"pass the folder that holds them": a folder with config.json and safetensors works."""
    code, _out, err = _run(capsys, "doctor", "--model", str(tmp_path / "nonexistent"))
    assert code == 2 and "pass the folder that holds them" in err
    save_file({"lm_head.weight": torch.zeros(8, 8, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, out, err = _run(capsys, "doctor", "--model", str(tmp_path))
    assert code == 0 and "no quantized layers found" in out, err


def test_a_closed_pipe_ends_doctor_quietly():
    """``quantdispatch doctor | head -1``: the reader is gone before doctor prints."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantdispatch", "doctor", "--verbose"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


LAYER_PRESETS = ("t4", "a100", "h200", "b200", "rtx5090")  # a layer's view takes ~1 s each
VIEWS = [
    ([], {}, PRESETS),
    (["--shape", "6144x4096", "--moe", "128,8,2048,768", "--tp", "4"], {}, LAYER_PRESETS),
    (["--shape", "4096x14336"], {"QUANTDISPATCH_FP8_COMPUTE": "prefill"}, LAYER_PRESETS),
    ([], {"QUANTDISPATCH_BACKEND_NVFP4": "triton"}, PRESETS),
    ([], {"QUANTDISPATCH_DISABLE": "reference"}, PRESETS),
]


@pytest.mark.parametrize(("argv", "env", "presets"), VIEWS)
def test_default_view_lines_are_whole_phrases_within_100_columns(
    capsys, monkeypatch, argv, env, presets
):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for preset in presets:
        code, out, err = _run(capsys, "doctor", "--device", preset, *argv)
        assert code in (0, 1), err
        long = [x for x in out.splitlines() if len(x) > 100]
        cut = [x for x in out.splitlines() if "..." in x]
        assert not long and not cut, (preset, argv, env, long, cut)


def test_matrix_fits_120_columns_and_marks_self_check_gated_choices(capsys):
    code, out, err = _run(capsys, "doctor", "--matrix")
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(x) for x in lines) <= 120
    rows = {x.split()[0]: x.split()[2:] for x in lines[1:] if x.split() and x.split()[0] in PRESETS}
    assert set(rows) == set(PRESETS)
    assert any(MARK in x for x in lines[-2:]), "the legend says what the mark means"
    code, out, _ = _run(capsys, "doctor", "--matrix", "--json")
    gated = json.loads(out)["self_check_gated"]
    for key in PRESETS:
        want = set()
        for f in ("nvfp4", "mxfp4", "fp8"):
            for op in ("linear", "moe"):
                for dt in ("bf16", "fp16"):
                    d = select(f, op, dt, device=preset_profile(key))
                    if d.unverified():
                        want.add(f"{f}/{op}/{dt}")
        assert set(gated[key]) == want, key
        cells = rows[key]
        assert any(MARK in c for c in cells) == bool(want), (key, cells)
    assert gated["rtx5090"] and not gated["h200"]  # torch FP4 on SM 12.0 is not verified

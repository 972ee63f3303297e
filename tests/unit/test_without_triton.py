"""triton is optional: with it hidden from imports (tests/unit/no_triton_probe.py, in a
subprocess), every module but the triton backend's kernels imports, and doctor (every view,
every GPU preset, --model), verify and ``quantdispatch.select`` answer without a traceback,
saying that triton is not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantdispatch.device import PRESETS

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("no_triton_probe.py")
#: What may need triton to import: the kernels and the triton backend's launch paths (the op
#: path and the bound path), which the backend imports only when it runs.
KERNEL_PREFIXES = (
    "quantdispatch.kernels.",
    "quantdispatch.backends.triton.run",
    "quantdispatch.backends.triton.bind",
)
#: Modules that must import without triton, though they sit beside kernels.
TRITON_FREE = (
    "quantdispatch.kernels.common.checks",
    "quantdispatch.kernels.common.device_facts",
    "quantdispatch.kernels.common.interpreter",
    "quantdispatch.kernels.native.scaled_mm_fp4",
    "quantdispatch.kernels.regimes",
    "quantdispatch.backends.triton",
    "quantdispatch.backends.torch_scaled_mm",
    "quantdispatch.cli.doctor",
    "quantdispatch.verify",
)
GPU_PRESETS = [k for k, p in PRESETS.items() if p.capability is not None]


def _model_dir(tmp_path_factory) -> Path | None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    from hf_models import float_model, make_config, write_checkpoint

    path = tmp_path_factory.mktemp("no_triton") / "llama"
    write_checkpoint(float_model(make_config("llama")), path, arch="llama")
    return path


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    model = _model_dir(tmp_path_factory)
    argvs = [
        ["doctor"],
        ["doctor", "--json"],
        ["doctor", "--verbose"],
        ["doctor", "--matrix"],
        ["doctor", "--shape", "6144x4096", "--device", "h200"],
        ["verify"],
        ["presets"],
        *(["doctor", "--device", key] for key in GPU_PRESETS),
    ]
    if model is not None:
        argvs += [["doctor", "--model", str(model)], ["doctor", "--model", str(model), "--device",
                                                      "a100"]]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(argvs)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_only_the_kernels_need_triton(probe):
    failed = probe["failed_imports"]
    assert failed, "the blocker hid nothing: the probe no longer hides triton"
    outside = {m: why for m, why in failed.items() if not m.startswith(KERNEL_PREFIXES)}
    assert not outside, f"modules that need triton but are no kernels: {outside}"
    assert not [m for m in TRITON_FREE if m in failed], failed
    assert all("triton" in why for why in failed.values()), failed


def test_every_command_answers_without_a_traceback(probe):
    for run in probe["runs"]:
        text = run["out"] + run["err"]
        assert run["code"] == 0, (run["argv"], run["err"][-2000:])
        assert "Traceback" not in text, (run["argv"], text[-2000:])
        assert run["out"].strip(), run["argv"]


def test_doctor_says_triton_is_not_installed_and_explains_every_gpu_preset(probe):
    runs = {" ".join(r["argv"]): r for r in probe["runs"]}
    kernels = next(x for x in runs["doctor"]["out"].splitlines() if x.startswith("kernels"))
    assert "triton" in kernels and "not installed" in kernels, kernels
    for key in GPU_PRESETS:
        out = runs[f"doctor --device {key}"]["out"]
        assert f"SIMULATED preset {key!r}" in out
        decided = [x for x in out.splitlines() if x.startswith(("nvfp4 ", "mxfp4 ", "fp8 "))]
        assert len(decided) >= 6 and not [x for x in decided if "ERROR" in x], (key, out)
        assert "no triton" in out, (key, out)
    h200 = runs["doctor --device h200"]["out"]
    assert "no triton     triton is not installed (pip install 'quantdispatch[triton]')" in h200
    matrix = runs["doctor --matrix"]["out"]
    assert all(any(x.startswith(k + " ") for x in matrix.splitlines()) for k in PRESETS)
    assert "triton" not in matrix.split("\n", 1)[1]  # no preset chooses it
    assert '"available": false' in runs["doctor --json"]["out"]


def test_select_explains_without_triton(probe):
    assert "-> reference" in probe["select"] and "triton is not installed" in probe["select"]


def test_model_flag_works_without_triton(probe):
    runs = [r for r in probe["runs"] if "--model" in r["argv"]]
    if not runs:
        pytest.skip("transformers is not installed: no checkpoint to describe")
    for run in runs:
        assert "linear" in run["out"] and "reference" in run["out"], run["out"]

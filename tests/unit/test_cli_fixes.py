"""Every fix the CLI prints works when followed. Each case sets up a failing command, reads the
fix from the one error line, follows it (unset or set the variables it names, pick the first
value it lists, edit the policy file it names, pass the flag it names) and runs again, until the
command succeeds: a fix that fails too, or one that asks for what is already done, fails here.
The forced-backend and QUANTDISPATCH_DISABLE cases sweep presets, formats, ops and backends."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

from quantdispatch.backends import backend_names
from quantdispatch.cli import main

PRESETS = ("cpu", "t4", "a100", "h200", "b200", "rtx5090", "thor")
FORMATS = ("nvfp4", "mxfp4", "fp8")
PREFIX = "quantdispatch: error: "


def _run(capsys, argv, env, monkeypatch):
    for key in [k for k in os.environ if k.startswith("QUANTDISPATCH_")]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("SGLANG_FORCE_NVFP4_MARLIN", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        code = main(list(argv))
    except SystemExit as exc:  # the parser's usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    return lines[0][len(PREFIX) :]


def _follow_env(fix: str, env: dict[str, str]) -> dict[str, str]:
    """The environment after the fix's "unset VAR" and "VAR=value" steps."""
    env = dict(env)
    for var in re.findall(r"\bunset ([A-Z][A-Z0-9_]+)", fix):
        assert var in env, f"the fix unsets {var}, which is not set: {fix}"
        del env[var]
    for var, value in re.findall(r"\b([A-Z][A-Z0-9_]{3,})=([\w.,-]+)", fix):
        assert env.get(var) != value, f"the fix sets what is already set: {fix}"
        env[var] = value
    return env


def _until_it_works(capsys, monkeypatch, argv, env, steps=3):
    """Follow the printed fixes (of the decision errors, exit 1) until doctor exits 0."""
    seen = []
    for _ in range(steps):
        code, _out, err = _run(capsys, argv, env, monkeypatch)
        if code == 0:
            return seen
        assert code == 1, (env, err)
        fix = _error(err).rpartition("; fix: ")[2]
        assert fix and fix not in seen, (env, err)
        seen.append(fix)
        env = _follow_env(fix, env)
    raise AssertionError(f"still failing after following {seen} from {env}")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_forced_backend_fix_works(capsys, monkeypatch, preset):
    followed = 0
    for fmt in FORMATS:
        for backend in backend_names():
            for scope in ("", "_LINEAR", "_MOE"):
                env = {f"QUANTDISPATCH_BACKEND_{fmt.upper()}{scope}": backend}
                argv = ["doctor", "--device", preset, "--format", fmt]
                followed += len(_until_it_works(capsys, monkeypatch, argv, env))
    assert followed  # some force fails on every preset (reference is never forced wrongly)


@pytest.mark.parametrize("preset", ["cpu", "h200", "b200"])
@pytest.mark.parametrize("disabled", ["reference", "triton,reference", "marlin,reference,torch"])
def test_every_disable_fix_works(capsys, monkeypatch, preset, disabled):
    env = {"QUANTDISPATCH_DISABLE": disabled}
    _until_it_works(capsys, monkeypatch, ["doctor", "--device", preset], env)


def test_disabling_reference_no_longer_asks_to_add_it_to_the_policy(capsys, monkeypatch):
    code, _out, err = _run(capsys, ["doctor"], {"QUANTDISPATCH_DISABLE": "reference"}, monkeypatch)
    line = _error(err)
    assert code == 1 and len(line) <= 300, line
    assert "add 'reference'" not in line and "unset QUANTDISPATCH_DISABLE" in line


def _write_policy(path: Path, data: dict) -> None:
    lines = [f"version = {data['version']}"]
    for fmt, ops in data.items():
        if isinstance(ops, dict):
            lines.append(f"[{fmt}]")
            lines += [f"{op} = {list(names)!r}".replace("'", '"') for op, names in ops.items()]
    path.write_text("\n".join(lines) + "\n")


def test_a_policy_without_reference_fix_works(capsys, monkeypatch, tmp_path):
    policy = tmp_path / "mine.toml"
    _write_policy(policy, {"version": 1, "nvfp4": {"linear": ["triton"]}})
    argv = ["doctor", "--policy", str(policy), "--format", "nvfp4"]
    code, _out, err = _run(capsys, argv, {}, monkeypatch)
    fix = _error(err).rpartition("; fix: ")[2]
    where = re.fullmatch(r'add "reference" to the \[(\w+)\] (\w+) list in (\S+) \(.*\)', fix)
    assert code == 1 and where, fix
    fmt, op, file = where.groups()
    assert Path(file) == policy
    data = tomllib.loads(policy.read_text())
    data[fmt][op].append("reference")
    _write_policy(policy, data)
    assert _run(capsys, argv, {}, monkeypatch)[0] == 0


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["doctor", "--device", "h300"], {}),
        (["doctor"], {"QUANTDISPATCH_DEVICE": "h300"}),
        (["doctor", "--format", "nvfp5"], {}),
        (["doctor"], {"QUANTDISPATCH_BACKEND_NVFP4": "trtion"}),
        (["doctor"], {"QUANTDISPATCH_DISABLE": "foo"}),
        (["doctor"], {"QUANTDISPATCH_SELF_CHECK": "sometimes"}),
        (["doctor"], {"QUANTDISPATCH_PDL": "2"}),
        (["doctor"], {"QUANTDISPATCH_FP8_COMPUTE": "yes"}),
        (["doctor"], {"QUANTDISPATCH_FOO": "1"}),
        (["doctor"], {"QUANTDISPATCH_POLICY": "/nonexistent.toml"}),
        (["doctor"], {"QUANTDISPATCH_BACKEND_NVFP4": "triton", "QUANTDISPATCH_DISABLE": "triton"}),
    ],
)
def test_every_configuration_fix_works(capsys, monkeypatch, argv, env):
    """Exit 2, one line; the fix (pick a listed value, unset, remove from one of the two)
    followed, then the decision fixes that may follow on this machine, gives exit 0."""
    code, _out, err = _run(capsys, argv, env, monkeypatch)
    line = _error(err)
    assert code == 2, line
    valid = re.search(r"valid (?:presets|formats(?: are)?|backends|values): ([\w-]+)", line)
    if valid and argv[1:] and argv[-2] in ("--device", "--format"):
        argv = [*argv[:-1], valid.group(1)]  # pick the first value the error lists
    elif valid:
        (var,) = [k for k in env if k in line]
        env = {**env, var: "reference" if "BACKEND" in var else valid.group(1)}
    else:
        assert re.search(r"unset (it|them|the variable)|remove it from one of the two", line)
        dropped = ("QUANTDISPATCH_FOO", "QUANTDISPATCH_POLICY", "QUANTDISPATCH_DISABLE")
        env = {k: v for k, v in env.items() if k not in dropped}
    _until_it_works(capsys, monkeypatch, argv, env)


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "--shape", "64x64", "--tp", "8", "--format", "nvfp4", "--op", "linear"],
        ["doctor", "--moe", "8,2,64,64", "--tp", "16", "--format", "nvfp4", "--op", "moe"],
    ],
)
def test_a_layer_that_does_not_split_names_the_tp_that_works(capsys, monkeypatch, argv):
    code, _out, err = _run(capsys, [*argv, "--device", "h200"], {}, monkeypatch)
    most = re.search(r"use tp_size <= (\d+)", _error(err))
    assert code == 1 and most, err
    argv = [*argv[: argv.index("--tp") + 1], most.group(1), *argv[argv.index("--tp") + 2 :]]
    assert _run(capsys, [*argv, "--device", "h200"], {}, monkeypatch)[0] == 0


def test_usage_errors_name_the_flag_that_works(capsys, monkeypatch):
    code, _out, err = _run(capsys, ["doctor", "--tp", "4"], {}, monkeypatch)
    assert code == 2 and "give it with --shape NxK" in _error(err)
    assert _run(capsys, ["doctor", "--tp", "4", "--shape", "6144x4096"], {}, monkeypatch)[0] == 0
    code, _out, err = _run(capsys, ["doctor", "--shape", "12"], {}, monkeypatch)
    example = re.search(r"e\.g\. --shape (\S+)", _error(err))
    assert code == 2 and example
    assert _run(capsys, ["doctor", "--shape", example.group(1)], {}, monkeypatch)[0] == 0

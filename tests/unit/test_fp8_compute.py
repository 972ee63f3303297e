"""FP8 compute for prefill (opt-in, lossy): the setting (environment, policy file, precedence,
errors), its regime rows per SM, the decision trace's words, and doctor's lines. The kernel
ranges against the run path: tests/unit/test_triton_dispatch.py; the numbers (prepare, the run
path with torch._scaled_mm emulated, verify): tests/numerics/test_fp8_compute_layer.py."""

from __future__ import annotations

import json

import pytest
import torch

from quantdispatch.api import current_settings, load_settings, select
from quantdispatch.backends.triton.options import fp8_compute_of
from quantdispatch.capability import SM89_PLUS
from quantdispatch.cli import main
from quantdispatch.device import preset_profile
from quantdispatch.errors import ConfigurationError
from quantdispatch.kernels.regimes import (
    FP8_PREFILL_REGIMES,
    Family,
    fp8_prefill_regime,
)
from quantdispatch.policy import default_policy, load_policy
from quantdispatch.settings import FP8_COMPUTE_MODES

VAR = "QUANTDISPATCH_FP8_COMPUTE"
RESULTS = "benchmarks/results/fp8-prefill-h200-2026-12-02-hw-rounding.md"


def _h200():
    """The H200 preset with a CUDA 13.0 torch (presets assume 12.8 on this CPU torch)."""
    return preset_profile("h200").model_copy(update={"cuda_version": "13.0"})


def _select(mode=None, device=None, fmt="nvfp4", act="bf16", **shape):
    over = {} if mode is None else {"fp8_compute": mode}
    settings = load_settings({}, backend={fmt: "triton"}, **over)
    return select(fmt, "linear", act, "weight_only", device=device or _h200(),
                  settings=settings, **shape)  # fmt: skip


# ---- the setting ---------------------------------------------------------------------------


def test_the_default_is_off_and_unset():
    s = load_settings({})
    assert (s.fp8_compute, s.fp8_compute_by) == ("off", None)
    assert fp8_compute_of(s, default_policy())[0] == "off"


@pytest.mark.parametrize(
    ("raw", "mode"),
    [("off", "off"), ("prefill", "prefill"), (" Prefill-Resident ", "prefill-resident")],
)
def test_the_variable_is_read_case_insensitively_and_says_where_it_came_from(raw, mode):
    s = load_settings({VAR: raw})
    assert s.fp8_compute == mode and s.fp8_compute_by == f"{VAR}={raw}"
    assert s.describe()["fp8_compute"] == mode


def test_an_empty_variable_is_unset():
    assert load_settings({VAR: " "}).fp8_compute_by is None


@pytest.mark.parametrize("raw", ["on", "1", "prefill_resident", "resident"])
def test_a_bad_value_lists_the_valid_ones(raw):
    with pytest.raises(ConfigurationError) as err:
        load_settings({VAR: raw})
    text = str(err.value)
    assert f"{VAR}={raw!r} is not an FP8 compute mode" in text
    assert all(m in text for m in FP8_COMPUTE_MODES)


def test_an_override_wins_over_the_variable_and_says_so():
    s = load_settings({VAR: "prefill"}, fp8_compute="off")
    assert s.fp8_compute == "off" and s.fp8_compute_by == "settings.fp8_compute='off'"


def test_settings_that_differ_only_in_where_the_mode_came_from_are_different():
    unset, off = load_settings({}), load_settings({VAR: "off"})
    assert unset != off and unset.cache_key() != off.cache_key()


def test_current_settings_follow_the_variable(monkeypatch):
    monkeypatch.setenv(VAR, "prefill")
    assert current_settings().fp8_compute == "prefill"


# ---- the policy file and precedence -----------------------------------------------------------


def test_the_packaged_policy_says_off():
    from pathlib import Path

    import quantdispatch
    from quantdispatch.policy import parse_policy

    path = Path(quantdispatch.__file__).resolve().parent.parent / "policies" / "default.toml"
    import tomllib

    p = parse_policy(tomllib.loads(path.read_text()), str(path))
    assert p.option("fp8_compute") == ("off", str(path))
    assert fp8_compute_of(load_settings({}), p) == ("off", f"fp8_compute in {path}")


def test_a_policy_file_sets_it_and_the_variable_wins(tmp_path):
    pytest.importorskip("triton")
    f = tmp_path / "mine.toml"
    f.write_text('fp8_compute = "prefill-resident"\n')
    p = load_policy(f)
    assert p.option("fp8_compute") == ("prefill-resident", str(f))
    assert p != default_policy() and hash(p) != hash(default_policy())
    assert fp8_compute_of(load_settings({}), p) == (
        "prefill-resident",
        f"fp8_compute in {f}",
    )
    env = load_settings({VAR: "off"})
    assert fp8_compute_of(env, p) == ("off", f"{VAR}=off")
    # through select(): the decision carries the mode in effect
    settings = load_settings({}, backend={"nvfp4": "triton"})
    d = select("nvfp4", device=_h200(), settings=settings, policy=f, n=6144, k=4096)
    mode = d.options.fp8_compute
    assert mode == "prefill-resident" and d.to_dict()["fp8_compute"] == mode
    assert d.kernel_for(256).family == Family.FP8_PREFILL
    d = select("nvfp4", device=_h200(), settings=env, policy=f, n=6144, k=4096)
    assert d.options.fp8_compute == "off" and d.kernel_for(256).family == Family.WGMMA_GEMM


def test_a_policy_file_without_the_key_keeps_the_default_and_a_bad_value_is_named(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[nvfp4]\nlinear = ["reference"]\n')
    assert load_policy(f).option("fp8_compute")[0] == default_policy().option("fp8_compute")[0]
    assert fp8_compute_of(load_settings({}), load_policy(f))[0] == "off"
    f.write_text('fp8_compute = "fast"\n')
    with pytest.raises(ConfigurationError) as err:
        load_policy(f)
    text = str(err.value)
    assert str(f) in text and "'fp8_compute'" in text and "'fast'" in text
    assert "valid values: off, prefill, prefill-resident" in text
    f.write_text("fp8_compute = 1\n")
    with pytest.raises(ConfigurationError, match="unknown FP8 compute mode 1"):
        load_policy(f)


# ---- the regime rows ---------------------------------------------------------------------


def test_the_rows_thresholds_and_why():
    assert fp8_prefill_regime("nvfp4", (9, 0), "prefill").min_m == 2048
    assert fp8_prefill_regime("mxfp4", (9, 0), "prefill-resident").min_m == 256
    for cap in ((8, 9), (10, 0), (12, 0), (12, 1)):
        for mode in ("prefill", "prefill-resident"):
            row = fp8_prefill_regime("nvfp4", cap, mode)
            assert row.sm is SM89_PLUS and row.min_m is None and "not measured" in row.why
    assert fp8_prefill_regime("nvfp4", (8, 0), "prefill") is None
    assert fp8_prefill_regime("fp8", (9, 0), "prefill") is None
    assert fp8_prefill_regime("nvfp4", (9, 0), "off") is None
    for row in FP8_PREFILL_REGIMES:
        assert set(row.modes) <= set(FP8_COMPUTE_MODES) - {"off"}
        assert row.min_m is None or RESULTS in row.why


@pytest.mark.parametrize("mode", ["prefill", "prefill-resident"])
@pytest.mark.parametrize("preset", ["h200", "h100", "rtx4090", "l40s", "b200", "rtx5090", "a100"])
def test_the_fp8_range_exists_on_sm90_only(mode, preset):
    pytest.importorskip("triton")
    profile = preset_profile(preset).model_copy(update={"cuda_version": "13.0"})
    d = _select(mode, profile, n=6144, k=4096)
    fp8 = [r for r in d.kernel_ranges() if r.family == Family.FP8_PREFILL]
    if profile.capability == (9, 0):
        ((r,),) = (fp8,)
        assert (r.first_m, r.last_m) == ({"prefill": 2048, "prefill-resident": 256}[mode], None)
        assert r.detail.startswith("lossy")
        assert r.detail.endswith("resident FP8 copy" if mode != "prefill" else "per call")
    else:
        assert not fp8
    off = _select("off", profile, n=6144, k=4096)
    assert all(r.family != Family.FP8_PREFILL for r in off.kernel_ranges())


# ---- the decision trace ----------------------------------------------------------------------


def test_the_trace_says_from_which_m_when_on():
    pytest.importorskip("triton")
    d = _select("prefill-resident", n=6144, k=4096)
    assert "lossy: FP8 compute from M >= 256 (resident FP8 copy, 25.2 MB; " in d.reason
    assert f"{VAR}=prefill-resident)" in d.reason
    d = _select("prefill", n=28672, k=4096)
    assert "lossy: FP8 compute from M >= 2048 (FP4 weight re-encoded per call;" in d.reason
    d = _select("prefill-resident")  # no shape: the rule
    assert "from M >= 256 where N % 16 == 0 and K % 128 == 0" in d.reason


def test_the_trace_names_the_setting_once_when_off_on_an_eligible_device():
    pytest.importorskip("triton")
    d = _select(n=6144, k=4096)
    assert d.reason.endswith(f"lossy FP8 compute for prefill available ({VAR})")
    assert d.reason.count("FP8 compute") == 1
    on_a100 = _select(device=preset_profile("a100"), n=6144, k=4096)
    assert "FP8" not in on_a100.reason


def test_the_trace_says_why_not_when_on_where_it_cannot_run():
    pytest.importorskip("triton")
    for preset, sm in (("rtx4090", "8.9"), ("rtx5090", "12.0")):
        d = _select("prefill", preset_profile(preset), n=6144, k=4096)
        assert f"FP8 compute (prefill) not used: off on SM {sm} (row-wise FP8" in d.reason
        assert "not measured" in d.reason
    d = _select("prefill-resident", preset_profile("a100"), n=6144, k=4096)
    assert "FP8 compute (prefill-resident) not used: FP8 tensor cores need SM 8.9+" in d.reason
    d = _select("prefill", n=6144, k=4160)  # K not a multiple of 128
    assert "not used: needs K % 128 == 0 and N % 16 == 0 (weight 6144x4160)" in d.reason


def test_other_backends_and_formats_say_nothing_about_it():
    settings = load_settings({}, fp8_compute="prefill")
    d = select("fp8", "linear", "bf16", device=_h200(), settings=settings, n=4096, k=4096)
    assert "FP8 compute" not in d.explain()
    d = select("nvfp4", "moe", "bf16", device=_h200(), settings=settings)
    assert "FP8 compute" not in d.explain()
    settings = load_settings({}, backend={"nvfp4": "reference"}, fp8_compute="prefill")
    d = select("nvfp4", device=_h200(), settings=settings, n=6144, k=4096)
    assert "FP8 compute" not in d.explain() and _resident(d) is None


def test_the_resident_bytes_are_the_copys():
    pytest.importorskip("triton")
    from quantdispatch.kernels.native.fp8_prefill import resident_nbytes

    d = _select(n=6144, k=4096)
    assert _resident(d) == 6144 * 4096 + 48 * 32 * 4 == resident_nbytes(6144, 4096, "128x128")
    assert _resident(_select(n=4096, k=4224)) == resident_nbytes(4096, 4224, "1x128")
    assert _resident(_select(n=6144, k=4160)) is None
    assert _resident(_select(device=preset_profile("rtx4090"), n=6144, k=4096)) is None


def _resident(d):
    """What the decision's report says a resident FP8 copy takes (None: no such copy)."""
    return d.option_facts().get("fp8_resident_bytes")


# ---- doctor ----------------------------------------------------------------------------------


def _doctor(capsys, *argv):
    code = main(["doctor", "--device", "h200", "--format", "nvfp4", "--op", "linear", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.fixture
def cuda13(monkeypatch):
    monkeypatch.setattr("quantdispatch.device.presets.ASSUMED_CUDA_FOR_PRESETS", "13.0")


def test_concise_doctor_is_unchanged_while_off_and_says_it_in_one_line_when_on(
    capsys, monkeypatch, cuda13
):
    pytest.importorskip("triton")
    off = _doctor(capsys)
    assert "fp8 " not in off and "FP8" not in off
    monkeypatch.setenv(VAR, "prefill-resident")
    on = _doctor(capsys).splitlines()
    lines = [x for x in on if x.startswith("fp8 ")]
    assert len(lines) == 1 and lines[0].startswith("fp8       prefill-resident, lossy (")
    assert f"({VAR}=prefill-resident)" in lines[0]
    assert [x for x in on if x not in lines] == off.splitlines()
    with_shape = _doctor(capsys, "--shape", "6144x4096")
    assert "M >= 256: fp8 prefill" in with_shape


def test_verbose_doctor_shows_the_setting_and_the_resident_bytes(capsys, monkeypatch, cuda13):
    pytest.importorskip("triton")
    out = _doctor(capsys, "--verbose", "--shape", "6144x4096")
    assert "  FP8 compute (lossy)       off (" in out
    assert (
        "  resident FP8 copy (with fp8_compute=prefill-resident): 25.2 MB on top of the FP4 "
        "weight's 12.6 MB"
    ) in out
    assert f"lossy FP8 compute for prefill available ({VAR})" in out
    monkeypatch.setenv(VAR, "prefill")
    out = _doctor(capsys, "--verbose", "--shape", "6144x4096")
    assert "  FP8 compute (lossy)       prefill: lossy FP8 compute for prefill" in out
    assert "    M >= 2048: fp8 prefill (lossy: " in out
    assert "  resident FP8 copy (with fp8_compute=prefill-resident)" in out
    monkeypatch.setenv(VAR, "prefill-resident")
    out = _doctor(capsys, "--verbose", "--shape", "6144x4096")
    assert "  resident FP8 copy (kept): 25.2 MB" in out
    out = _doctor(capsys, "--verbose")  # no shape: no bytes
    assert "resident FP8 copy (" not in out


def test_doctor_json_has_the_mode_in_effect_and_the_bytes(capsys, monkeypatch, cuda13):
    pytest.importorskip("triton")
    monkeypatch.setenv(VAR, "prefill")
    data = json.loads(_doctor(capsys, "--json", "--shape", "6144x4096"))
    assert data["settings"]["fp8_compute"] == "prefill"
    assert data["settings"]["fp8_compute_by"] == f"{VAR}=prefill"
    d = next(d for d in data["decisions"] if d["act_dtype"] == "bf16")
    assert d["fp8_compute"] == "prefill" and d["fp8_resident_bytes"] == 6144 * 4096 + 48 * 32 * 4
    assert d["kernel_ranges"][-1]["family"] == "fp8 prefill"
    assert d["kernel_ranges"][-1]["m_min"] == 2048


def test_a_bad_variable_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv(VAR, "yes")
    code = main(["doctor", "--device", "h200"])
    assert code == 2 and "is not an FP8 compute mode" in capsys.readouterr().err


def test_no_fp8_compute_decision_with_torch_dtype_names():
    pytest.importorskip("triton")
    d = _select("prefill-resident", act=torch.float16, n=6144, k=4096)
    assert d.kernel_for(256).family == Family.FP8_PREFILL

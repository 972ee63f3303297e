"""Environment settings: parsing, validation, and error messages that list valid values."""

from __future__ import annotations

import pytest

from quantdispatch.errors import ConfigurationError
from quantdispatch.settings import current_settings, load_settings


def test_empty_environment_gives_defaults():
    s = load_settings({})
    assert s.backend == {} and s.disable == frozenset() and s.policy is None and s.device is None


def test_forced_backend_per_format_is_case_insensitive():
    s = load_settings(
        {"QUANTDISPATCH_BACKEND_NVFP4": " Triton ", "QUANTDISPATCH_BACKEND_FP8": "torch"}
    )
    assert s.backend == {"nvfp4": "triton", "fp8": "torch"}
    assert s.forced("nvfp4") == ("triton", "QUANTDISPATCH_BACKEND_NVFP4= Triton ")
    assert s.forced("mxfp4") is None


def test_auto_or_empty_means_not_forced():
    assert load_settings({"QUANTDISPATCH_BACKEND_NVFP4": "auto"}).backend == {}
    assert load_settings({"QUANTDISPATCH_BACKEND_NVFP4": ""}).backend == {}


def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ConfigurationError) as e:
        load_settings({"QUANTDISPATCH_BACKEND_NVFP4": "marlinn"})
    msg = str(e.value)
    assert "'marlinn'" in msg and "valid backends: cutlass, torch, triton, marlin, reference" in msg


def test_unknown_format_lists_valid_ones():
    with pytest.raises(
        ConfigurationError, match=r"unknown format 'int4'.*valid formats: nvfp4, mxfp4, fp8"
    ):
        load_settings({"QUANTDISPATCH_BACKEND_INT4": "triton"})


def test_disable_parses_a_comma_list_and_rejects_unknown_names():
    assert load_settings({"QUANTDISPATCH_DISABLE": "triton, MARLIN,,"}).disable == {
        "triton",
        "marlin",
    }
    with pytest.raises(ConfigurationError) as e:
        load_settings({"QUANTDISPATCH_DISABLE": "bogus"})
    assert "'bogus'" in str(e.value) and "valid backends:" in str(e.value)


def test_forced_and_disabled_at_once_is_an_error():
    with pytest.raises(ConfigurationError, match="forced and disabled at once"):
        load_settings({"QUANTDISPATCH_BACKEND_NVFP4": "triton", "QUANTDISPATCH_DISABLE": "triton"})


def test_unknown_quantdispatch_variable_is_an_error():
    with pytest.raises(ConfigurationError, match="QUANTDISPATCH_DISABEL"):
        load_settings({"QUANTDISPATCH_DISABEL": "triton"})


def test_device_must_be_a_preset():
    assert load_settings({"QUANTDISPATCH_DEVICE": "H100"}).device == "h100"
    with pytest.raises(ConfigurationError, match="valid presets:"):
        load_settings({"QUANTDISPATCH_DEVICE": "h300"})


def test_policy_path_must_exist(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text("version = 1\n")
    assert load_settings({"QUANTDISPATCH_POLICY": str(f)}).policy == f
    with pytest.raises(ConfigurationError, match="no such file"):
        load_settings({"QUANTDISPATCH_POLICY": str(tmp_path / "missing.toml")})


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_sglang_switch_true_values(value):
    s = load_settings({"SGLANG_FORCE_NVFP4_MARLIN": value})
    assert s.forced("nvfp4") == ("marlin", f"SGLANG_FORCE_NVFP4_MARLIN={value}")


@pytest.mark.parametrize("value", ["0", "false", "off", ""])
def test_sglang_switch_false_values(value):
    assert load_settings({"SGLANG_FORCE_NVFP4_MARLIN": value}).forced("nvfp4") is None


def test_sglang_switch_rejects_garbage_and_conflicts():
    with pytest.raises(ConfigurationError, match="not a boolean"):
        load_settings({"SGLANG_FORCE_NVFP4_MARLIN": "maybe"})
    with pytest.raises(ConfigurationError, match="one format can be forced to one backend"):
        load_settings({"SGLANG_FORCE_NVFP4_MARLIN": "1", "QUANTDISPATCH_BACKEND_NVFP4": "triton"})


def test_current_settings_follow_the_environment(monkeypatch):
    monkeypatch.setenv("QUANTDISPATCH_DISABLE", "marlin")
    assert current_settings().disable == {"marlin"}
    monkeypatch.setenv("QUANTDISPATCH_DISABLE", "triton")
    assert current_settings().disable == {"triton"}


def test_keyword_overrides():
    s = load_settings({}, disable={"triton"}, backend={"fp8": "reference"})
    assert s.disable == {"triton"} and s.forced("fp8")[0] == "reference"
    with pytest.raises(ConfigurationError, match="forced and disabled at once"):
        load_settings({}, disable={"triton"}, backend={"fp8": "triton"})

"""Environment settings: parsing, validation, and error messages that list valid values."""

from __future__ import annotations

import pytest

from quantdispatch.api import current_settings, load_settings
from quantdispatch.errors import ConfigurationError
from quantdispatch.request import Op


def test_empty_environment_gives_defaults():
    s = load_settings({})
    assert s.backend == {} and s.disable == frozenset() and s.policy is None and s.device is None


def test_forced_backend_per_format_is_case_insensitive():
    s = load_settings(
        {"QUANTDISPATCH_BACKEND_NVFP4": " Triton ", "QUANTDISPATCH_BACKEND_FP8": "torch"}
    )
    assert s.backend == {"nvfp4": "triton", "fp8": "torch"}
    assert s.forced("nvfp4", "linear") == ("triton", "QUANTDISPATCH_BACKEND_NVFP4= Triton ", None)
    assert s.forced("nvfp4", "moe") == s.forced("nvfp4", "linear")  # every op of the format
    assert s.forced("mxfp4", "linear") is None


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
    assert s.forced("nvfp4", "linear") == ("marlin", f"SGLANG_FORCE_NVFP4_MARLIN={value}", None)


@pytest.mark.parametrize("value", ["0", "false", "off", ""])
def test_sglang_switch_false_values(value):
    assert load_settings({"SGLANG_FORCE_NVFP4_MARLIN": value}).forced("nvfp4", "linear") is None


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
    assert s.disable == {"triton"} and s.forced("fp8", "linear").backend == "reference"
    with pytest.raises(ConfigurationError, match="forced and disabled at once"):
        load_settings({}, disable={"triton"}, backend={"fp8": "triton"})


# -- per-op forces ----------------------------------------------------------------------------


def test_per_op_force_applies_to_its_op_only():
    s = load_settings({"QUANTDISPATCH_BACKEND_NVFP4_MOE": " Triton "})
    assert s.backend == {"nvfp4:moe": "triton"}
    assert s.forced("nvfp4", Op.MOE) == (
        "triton",
        "QUANTDISPATCH_BACKEND_NVFP4_MOE= Triton ",
        "moe",
    )
    assert s.forced("nvfp4", Op.LINEAR) is None
    assert s.forced("mxfp4", "moe") is None


def test_per_op_force_wins_over_the_per_format_one_for_its_op():
    s = load_settings(
        {"QUANTDISPATCH_BACKEND_NVFP4": "cutlass", "QUANTDISPATCH_BACKEND_NVFP4_MOE": "triton"}
    )
    assert s.forced("nvfp4", "moe") == ("triton", "QUANTDISPATCH_BACKEND_NVFP4_MOE=triton", "moe")
    assert s.forced("nvfp4", "linear") == ("cutlass", "QUANTDISPATCH_BACKEND_NVFP4=cutlass", None)


def test_per_op_auto_or_empty_means_not_forced():
    assert load_settings({"QUANTDISPATCH_BACKEND_NVFP4_LINEAR": "auto"}).backend == {}
    assert load_settings({"QUANTDISPATCH_BACKEND_NVFP4_MOE": ""}).backend == {}


def test_per_op_force_with_an_unknown_op_lists_the_ops():
    with pytest.raises(ConfigurationError) as e:
        load_settings({"QUANTDISPATCH_BACKEND_NVFP4_GEMM": "triton"})
    msg = str(e.value)
    assert "QUANTDISPATCH_BACKEND_NVFP4_GEMM names unknown op 'gemm' of format nvfp4" in msg
    assert "valid ops: linear, moe" in msg
    assert "QUANTDISPATCH_BACKEND_NVFP4 for every op" in msg


def test_per_op_force_with_an_unknown_format_lists_the_formats():
    with pytest.raises(ConfigurationError) as e:
        load_settings({"QUANTDISPATCH_BACKEND_INT4_LINEAR": "triton"})
    msg = str(e.value)
    assert "QUANTDISPATCH_BACKEND_INT4_LINEAR names unknown format 'int4'" in msg
    assert "valid formats: nvfp4, mxfp4, fp8" in msg
    assert "QUANTDISPATCH_BACKEND_<FORMAT>_<OP>" in msg


def test_per_op_force_with_an_unknown_backend_lists_the_backends():
    with pytest.raises(ConfigurationError) as e:
        load_settings({"QUANTDISPATCH_BACKEND_FP8_LINEAR": "cublas"})
    msg = str(e.value)
    assert "QUANTDISPATCH_BACKEND_FP8_LINEAR='cublas' names an unknown backend" in msg
    assert "valid backends: cutlass, torch, triton, marlin, reference" in msg


def test_per_op_force_and_disable_at_once_is_an_error():
    with pytest.raises(ConfigurationError, match="QUANTDISPATCH_BACKEND_NVFP4_MOE=triton forces"):
        load_settings(
            {"QUANTDISPATCH_BACKEND_NVFP4_MOE": "triton", "QUANTDISPATCH_DISABLE": "triton"}
        )


def test_unknown_variable_error_lists_the_per_op_form():
    with pytest.raises(ConfigurationError, match=r"QUANTDISPATCH_BACKEND_<FORMAT>_<OP>"):
        load_settings({"QUANTDISPATCH_BACKENDS": "triton"})


def test_sglang_switch_and_a_per_op_force():
    # The switch is the per-format form for nvfp4: a per-op force wins for its op, whatever it
    # names; one that agrees changes nothing.
    s = load_settings(
        {"SGLANG_FORCE_NVFP4_MARLIN": "1", "QUANTDISPATCH_BACKEND_NVFP4_MOE": "triton"}
    )
    assert s.forced("nvfp4", "moe") == ("triton", "QUANTDISPATCH_BACKEND_NVFP4_MOE=triton", "moe")
    assert s.forced("nvfp4", "linear") == ("marlin", "SGLANG_FORCE_NVFP4_MARLIN=1", None)
    s = load_settings(
        {"SGLANG_FORCE_NVFP4_MARLIN": "1", "QUANTDISPATCH_BACKEND_NVFP4_LINEAR": "marlin"}
    )
    assert s.forced("nvfp4", "linear").backend == "marlin"
    # Same scope, different backends: an error, as for the per-format variable.
    with pytest.raises(ConfigurationError, match="one format can be forced to one backend"):
        load_settings(
            {
                "SGLANG_FORCE_NVFP4_MARLIN": "1",
                "QUANTDISPATCH_BACKEND_NVFP4": "triton",
                "QUANTDISPATCH_BACKEND_NVFP4_MOE": "triton",
            }
        )


def test_keyword_overrides_per_op():
    s = load_settings({}, backend={"nvfp4": "cutlass", "NVFP4:MOE": "triton"})
    assert s.backend == {"nvfp4": "cutlass", "nvfp4:moe": "triton"}
    assert s.forced("nvfp4", "moe") == ("triton", "settings.backend['nvfp4:moe']=triton", "moe")
    assert s.forced("nvfp4", "linear").backend == "cutlass"
    with pytest.raises(ConfigurationError, match="unknown op 'gemm'"):
        load_settings({}, backend={"nvfp4:gemm": "triton"})
    with pytest.raises(ConfigurationError, match="unknown format 'int4'"):
        load_settings({}, backend={"int4:moe": "triton"})


def test_overrides_merge_over_the_environment_forces_and_say_so():
    s = load_settings(
        {"QUANTDISPATCH_BACKEND_NVFP4": "cutlass", "QUANTDISPATCH_BACKEND_NVFP4_MOE": "triton"},
        backend={"nvfp4": "Reference"},
    )
    assert s.backend == {"nvfp4": "reference", "nvfp4:moe": "triton"}
    assert s.forced("nvfp4", "linear").by == "settings.backend['nvfp4']=reference"
    assert s.forced("nvfp4", "moe").by == "QUANTDISPATCH_BACKEND_NVFP4_MOE=triton"


def test_describe_shows_per_op_forces():
    s = load_settings(
        {"QUANTDISPATCH_BACKEND_NVFP4_MOE": "triton", "QUANTDISPATCH_BACKEND_NVFP4": "cutlass"}
    )
    assert list(s.describe()["forced"]) == ["nvfp4", "nvfp4:moe"]  # sorted, whatever env order
    assert s.describe()["forced"] == {
        "nvfp4": {"backend": "cutlass", "by": "QUANTDISPATCH_BACKEND_NVFP4=cutlass"},
        "nvfp4:moe": {"backend": "triton", "by": "QUANTDISPATCH_BACKEND_NVFP4_MOE=triton"},
    }


def test_settings_module_needs_a_registry():
    from quantdispatch import settings as settings_module

    registry = settings_module.Registry(
        formats=("nvfp4",), ops=("linear",), backends=("triton",), presets=("h100",)
    )
    s = settings_module.load_settings({"QUANTDISPATCH_BACKEND_NVFP4": "triton"}, registry=registry)
    assert s.forced("nvfp4", "linear").backend == "triton"
    with pytest.raises(ConfigurationError, match="valid backends: triton"):
        settings_module.load_settings({"QUANTDISPATCH_DISABLE": "marlin"}, registry=registry)
    with pytest.raises(ValueError, match="need the valid names"):
        settings_module.Settings()


def _imported_modules(path):
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):  # module level and inside functions
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_settings_imports_no_registry():
    from pathlib import Path

    import quantdispatch.settings

    imported = _imported_modules(Path(quantdispatch.settings.__file__))
    banned = ("quantdispatch.backends", "quantdispatch.formats", "quantdispatch.device")
    assert not [m for m in imported if m.startswith(banned)]


class _VanishingEnviron(dict):
    """An environment in which a variable disappears between listing and reading it, as when
    another thread deletes it meanwhile."""

    def __getitem__(self, key):
        if key == "QUANTDISPATCH_GONE":
            raise KeyError(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def items(self):  # what a live os.environ does when a key vanishes mid-iteration
        return [(k, self[k]) for k in self]


def test_settings_survive_variables_deleted_by_another_thread(monkeypatch):
    import os
    import threading

    from quantdispatch import select

    fake = _VanishingEnviron(os.environ)
    fake["QUANTDISPATCH_GONE"] = "1"
    fake["QUANTDISPATCH_PDL"] = "0"
    monkeypatch.setattr(os, "environ", fake)
    assert current_settings().pdl is False
    monkeypatch.undo()

    errors: list[BaseException] = []
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            os.environ["QD_TEST_CHURN"] = "x"
            os.environ.pop("QD_TEST_CHURN", None)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(300):
            try:
                select("nvfp4")
            except BaseException as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        t.join()
    assert not errors, errors

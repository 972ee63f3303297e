"""Policy files: the packaged default, overlays, and validation errors naming file and key."""

from __future__ import annotations

import importlib.resources

import pytest

from quantdispatch.errors import ConfigurationError
from quantdispatch.policy import default_policy, load_policy
from quantdispatch.request import Op


def _write(tmp_path, text):
    f = tmp_path / "mine.toml"
    f.write_text(text)
    return f


def test_default_policy_ships_in_the_package_and_covers_every_format_and_op():
    res = importlib.resources.files("quantdispatch.policies").joinpath("default.toml")
    assert res.is_file()
    p = default_policy()
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        for op in Op:
            cands = p.candidates(fmt, op)
            assert cands[-1] == "reference"  # the last resort runs everywhere


def test_overlay_replaces_only_the_entries_it_has(tmp_path):
    f = _write(tmp_path, '[nvfp4]\nlinear = ["reference"]\n')
    p = load_policy(f)
    assert p.candidates("nvfp4", Op.LINEAR) == ("reference",)
    assert p.candidates("nvfp4", Op.MOE) == default_policy().candidates("nvfp4", Op.MOE)
    assert p.entry("nvfp4", Op.LINEAR).source == str(f)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            '[nvfp5]\nlinear = ["triton"]\n',
            ["'nvfp5'", "unknown format", "valid formats: nvfp4, mxfp4, fp8"],
        ),
        ('[nvfp4]\nconv = ["triton"]\n', ["'nvfp4.conv'", "unknown op", "valid ops: linear, moe"]),
        ('[nvfp4]\nlinear = ["tritn"]\n', ["'nvfp4.linear'", "'tritn'", "valid backends:"]),
        ('[nvfp4]\nlinear = ["triton", "triton"]\n', ["duplicate backend(s) 'triton'"]),
        ("[nvfp4]\nlinear = []\n", ["empty list"]),
        ('[nvfp4]\nlinear = "triton"\n', ["expected a list of backend names"]),
        ('nvfp4 = "triton"\n', ["expected a table"]),
        ("version = 2\n", ["unsupported version 2"]),
        ("[nvfp4\nlinear = 1\n", ["not valid TOML"]),
    ],
)
def test_malformed_policy_files_name_file_key_and_valid_values(tmp_path, text, fragments):
    f = _write(tmp_path, text)
    with pytest.raises(ConfigurationError) as e:
        load_policy(f)
    msg = str(e.value)
    assert str(f) in msg
    for frag in fragments:
        assert frag in msg


def test_missing_policy_file(tmp_path):
    with pytest.raises(ConfigurationError, match="cannot be read"):
        load_policy(tmp_path / "nope.toml")


def test_policy_file_is_reread_after_a_change(tmp_path):
    f = _write(tmp_path, '[fp8]\nlinear = ["reference"]\n')
    assert load_policy(f).candidates("fp8", Op.LINEAR) == ("reference",)
    import os
    import time

    f.write_text('[fp8]\nlinear = ["triton", "reference"]\n')
    t = time.time() + 5
    os.utime(f, (t, t))
    assert load_policy(f).candidates("fp8", Op.LINEAR) == ("triton", "reference")


def test_default_policy_loads_from_a_source_tree_without_install():
    """PYTHONPATH=checkout (no pip install): quantdispatch.policies is not a package there."""
    import subprocess
    import sys

    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'quantdispatch.policies':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from quantdispatch.policy import default_policy\n"
        "print(default_policy().sources[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("policies/default.toml")

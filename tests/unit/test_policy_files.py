"""Policy paths that are not regular UTF-8 files are one ConfigurationError (exit 2 from doctor),
without blocking on a FIFO or reading a device forever; a rewrite is always seen."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from quantdispatch.cli import main
from quantdispatch.errors import ConfigurationError
from quantdispatch.policy import load_policy
from quantdispatch.request import Op


def _load_within(path, seconds: float = 10.0):
    """load_policy(path) in a thread; fail if it does not return in time."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(load_policy(path))
        except Exception as exc:  # handed to the test
            outcome.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"load_policy({path}) did not return in {seconds} s"
    return outcome[0]


def test_a_directory_and_non_utf8_are_one_line_exit_2(capsys, tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'# caf\xe9\n[nvfp4]\nlinear = ["reference"]\n')
    for path, fragment in ((tmp_path, "is a directory"), (bad, "is not UTF-8")):
        with pytest.raises(ConfigurationError, match=fragment):
            load_policy(path)
        code = main(["doctor", "--policy", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and err.count("\n") == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "policy.toml"
    os.mkfifo(fifo)
    result = _load_within(fifo)
    assert isinstance(result, ConfigurationError) and "not a regular file" in str(result)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_an_endless_device_is_refused():
    result = _load_within("/dev/zero")
    assert isinstance(result, ConfigurationError) and "not a regular file" in str(result)


def test_a_huge_file_is_refused(tmp_path):
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigurationError, match="larger than"):
        load_policy(big)


def test_a_rewrite_with_the_same_mtime_is_seen(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('[nvfp4]\nlinear = ["triton", "reference"]\n')
    stamp = f.stat().st_mtime_ns
    assert load_policy(f).candidates("nvfp4", Op.LINEAR) == ("triton", "reference")
    f.write_text('[nvfp4]\nlinear = ["marlin", "reference"]\n')
    os.utime(f, ns=(stamp, stamp))
    assert load_policy(f).candidates("nvfp4", Op.LINEAR) == ("marlin", "reference")

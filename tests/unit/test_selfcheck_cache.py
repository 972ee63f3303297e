"""The self-check cache file is parsed, not trusted: entries of the wrong type, edited by hand
or copied from another environment do not skip the probe; a file that is not UTF-8 is one
warning; concurrent writers in several processes keep every entry."""

from __future__ import annotations

import json
import multiprocessing
import warnings

import pytest
from test_selfcheck import _install, _layer, env  # noqa: F401 (env is a fixture)

from quantdispatch import selfcheck
from quantdispatch.selfcheck_cache import CheckResult, read_entries, record


def _recorded_file(monkeypatch):
    """Record a pass of the right fake backend; return (path, env key, probe key, entry)."""
    _install(monkeypatch, 1.0)
    _layer()
    selfcheck.reset()
    path = selfcheck.cache_path()
    entries = json.loads(path.read_text())["entries"]
    ((env_key, probes),) = entries.items()
    ((probe, entry),) = probes.items()
    return path, env_key, probe, entry


def _write(path, entries):
    path.write_text(json.dumps({"version": 2, "entries": entries}))


def _build_with_wrong_backend(monkeypatch):
    wrong = _install(monkeypatch, 1.5)
    with warnings.catch_warnings(record=True) as record_:
        warnings.simplefilter("always")
        layer = _layer()
    messages = [str(w.message) for w in record_ if w.category is selfcheck.SelfCheckWarning]
    return layer, wrong, messages


@pytest.mark.parametrize(
    "tamper",
    [
        {"passed": "false"},  # a string: not a pass
        {"passed": "true"},
        {"worst": 1.7},  # passed=True with an error above the bound
        {"digest": "0" * 64},  # edited by hand
        {"backend": "reference"},
        {"extra": 1},
    ],
)
def test_a_tampered_entry_does_not_skip_the_probe(env, monkeypatch, tamper):  # noqa: F811
    path, env_key, probe, entry = _recorded_file(monkeypatch)
    _write(path, {env_key: {probe: {**entry, **tamper}}})
    layer, wrong, messages = _build_with_wrong_backend(monkeypatch)
    assert wrong.calls > 0 and layer.backend == "reference"
    assert any("cache entry" in m and "ignored" in m for m in messages), messages


def test_a_pass_copied_from_another_environment_does_not_count(env, monkeypatch):  # noqa: F811
    path, env_key, probe, entry = _recorded_file(monkeypatch)
    other = env_key.replace("torch ", "torch 0.0-other-")
    record(path, other, probe, CheckResult(**{k: entry[k] for k in entry if k != "digest"}), print)
    copied = json.loads(path.read_text())["entries"][other][probe]
    _write(path, {env_key: {probe: copied}})
    layer, wrong, messages = _build_with_wrong_backend(monkeypatch)
    assert layer.backend == "reference" and wrong.calls > 0
    assert any("digest does not match" in m for m in messages), messages


def test_a_valid_recorded_pass_is_still_trusted(env, monkeypatch):  # noqa: F811
    _recorded_file(monkeypatch)
    right = _install(monkeypatch, 1.0)
    assert _layer().backend == "cutlass" and right.calls == 0


def test_a_cache_that_is_not_utf8_is_one_warning_and_rewritten(env, monkeypatch):  # noqa: F811
    path = selfcheck.cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"version": 2, "entries": {"\xff\xfe": {}}}')
    fake = _install(monkeypatch, 1.0)
    with warnings.catch_warnings(record=True) as record_:
        warnings.simplefilter("always")
        assert _layer().backend == "cutlass"
        assert _layer().backend == "cutlass"
    messages = [str(w.message) for w in record_ if w.category is selfcheck.SelfCheckWarning]
    assert len(messages) == 1 and "not UTF-8" in messages[0]
    assert fake.calls == 3
    assert json.loads(path.read_text(encoding="utf-8"))["version"] == 2


def test_an_older_version_is_re_probed_without_a_warning(env, monkeypatch):  # noqa: F811
    path, env_key, probe, entry = _recorded_file(monkeypatch)
    path.write_text(json.dumps({"version": 1, "entries": {env_key: {probe: entry}}}))
    layer, wrong, messages = _build_with_wrong_backend(monkeypatch)
    assert layer.backend == "reference" and wrong.calls > 0
    assert not [m for m in messages if "cache" in m], messages  # only the failed check's
    assert json.loads(path.read_text())["version"] == 2


def _writer(args) -> None:
    path, worker, count = args
    for i in range(count):
        result = CheckResult("triton", True, f"w{worker} #{i}", 0.1, 0.01, "2000-01-01 00:00 UTC")
        record(path, f"env {worker}", f"triton nvfp4 linear {i}", result, print)


def test_concurrent_writers_in_several_processes_keep_every_entry(tmp_path):
    path = tmp_path / "quantdispatch" / "selfcheck.json"
    workers, count = 8, 100
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(_writer, [(path, w, count) for w in range(workers)])
    entries = read_entries(path, pytest.fail)
    assert sum(len(v) for v in entries.values()) == workers * count
    assert not [p for p in path.parent.iterdir() if p.suffix == ".tmp"]

"""The Marlin columns of benchmarks/linear.py and benchmarks/moe.py (benchmarks/peers.py), on the
CPU: flags, the provider set-up and its "not available" reasons, the markdown columns with fake
rows, and the timed calls end to end on tests/marlin_fake.py (our adapter, not vLLM's kernel)
against the scripts' own references."""

from __future__ import annotations

import argparse
import lzma
import sys

import pytest
import torch
from marlin_fake import fake_ops

sys.path.insert(0, "benchmarks")

import peers  # benchmarks/peers.py

from quantdispatch.backends import marlin_providers

MS = [1, 16, 64, 256, 1024]
PARSE_ARGS = argparse.ArgumentParser.parse_args


def _args(**kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    peers.add_args(ap, default_ms=kw.pop("default_ms", "all"))
    ns = ap.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """A registered fake vLLM 0.33.0, no .peer/vllm, no GPU needed."""
    monkeypatch.setattr(marlin_providers, "_dist_version", lambda dist: None)
    monkeypatch.setattr(peers, "PEER_DIR", tmp_path / "no-peer")
    monkeypatch.setattr(peers, "REQUIRE_GPU", False)
    marlin_providers.reset()
    with fake_ops():
        marlin_providers.register("vllm", "0.33.0")
        yield
    marlin_providers.reset()


@pytest.fixture
def no_provider(monkeypatch, tmp_path):
    monkeypatch.setattr(marlin_providers, "_dist_version", lambda dist: None)
    monkeypatch.setattr(peers, "PEER_DIR", tmp_path / "no-peer")
    monkeypatch.setattr(peers, "LIB_DIR", tmp_path / "unpacked")
    monkeypatch.setattr(peers, "REQUIRE_GPU", False)
    marlin_providers.reset()
    yield tmp_path
    marlin_providers.reset()


# ---- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [("all", MS), ("none", []), ("quick", [1, 16, 256]), ("16, 1024", [16, 1024])],
)
def test_marlin_ms_values(text, want):
    assert peers.parse_ms(text, MS, quick=[1, 16, 256, 4096]) == want


@pytest.mark.parametrize(("text", "match"), [("1,x", "expected M values"), ("3", r"\[3\] not")])
def test_marlin_ms_rejects_bad_values(text, match):
    with pytest.raises(ValueError, match=match):
        peers.parse_ms(text, MS, quick=MS)


def _parsed(monkeypatch, module, argv: list[str]) -> argparse.Namespace:
    """The script's parsed arguments (main stops right after parsing)."""
    grabbed = {}

    def grab(self, *a, **k):
        grabbed["ns"] = PARSE_ARGS(self, *a, **k)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    with pytest.raises(SystemExit):
        module.main()
    return grabbed["ns"]


def test_linear_times_marlin_by_default_at_every_m(monkeypatch):
    pytest.importorskip("triton")
    import linear

    ns = _parsed(monkeypatch, linear, [])
    assert ns.kernels.split(",")[-2:] == ["marlin_nvfp4", "marlin_mxfp4"]
    assert (ns.marlin_ms, ns.marlin_lib, ns.marlin_version) == ("all", None, None)
    ns = _parsed(monkeypatch, linear, ["--marlin-lib", "/x", "--marlin-ms", "1,16"])
    assert (str(ns.marlin_lib), ns.marlin_ms) == ("/x", "1,16")


def test_moe_times_marlin_by_default_at_the_quick_ms(monkeypatch):
    pytest.importorskip("triton")
    import moe

    ns = _parsed(monkeypatch, moe, ["--format", "mxfp4"])
    assert ns.marlin_ms == "quick" and ns.marlin_lib is None


@pytest.mark.parametrize("script", ["linear", "moe"])
def test_scripts_reject_marlin_ms_outside_the_run(monkeypatch, capsys, script):
    pytest.importorskip("triton")
    module = __import__(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--ms", "1,16", "--marlin-ms", "1,4"])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2 and "[4] not among this run's M values" in capsys.readouterr().err


# ---- the provider ------------------------------------------------------------------------------


def test_setup_finds_the_registered_provider(fake_vllm):
    marlin = peers.setup(_args(), MS, [1, 16], "linear")
    assert marlin.available and marlin.status.startswith("vllm 0.33.0 [vllm-0.30")
    assert marlin.runs(16) and not marlin.runs(2)
    assert marlin.meta["ms"] == MS and marlin.meta["available"]


def test_setup_without_a_provider_says_why(no_provider):
    marlin = peers.setup(_args(), MS, MS, "moe")
    assert not marlin.available and not marlin.runs(1)
    assert marlin.status.startswith("not available: no usable Marlin provider (vllm: not installed")


def test_setup_with_marlin_ms_none_loads_nothing(no_provider, monkeypatch):
    monkeypatch.setattr(peers, "load_provider", lambda *a: pytest.fail("loaded"))
    marlin = peers.setup(_args(marlin_ms="none"), MS, MS, "linear")
    assert marlin.status.startswith("not run") and marlin.meta["ms"] == []
    assert peers.setup(_args(), MS, MS, "moe", skip="--smoke").status == "not run (--smoke)"


def test_setup_library_dir_reasons(no_provider):
    empty = no_provider / "empty"
    empty.mkdir()
    status = peers.setup(_args(marlin_lib=empty), MS, MS, "linear").status
    assert status == f"not available: no VERSION file in {empty}: pass --marlin-version"
    status = peers.setup(_args(marlin_lib=empty, marlin_version="0.33.0"), MS, MS, "linear").status
    assert status == f"not available: no *.so or *.so.xz in {empty}"
    status = peers.setup(_args(marlin_lib=no_provider / "nowhere"), MS, MS, "linear").status
    assert status.endswith("nowhere: no such directory")


def test_setup_decompresses_once_and_reports_a_library_that_does_not_load(no_provider):
    lib_dir = no_provider / "peer"
    lib_dir.mkdir()
    (lib_dir / "VERSION").write_text("vllm==0.33.0\n")
    with lzma.open(lib_dir / "_C_stable_libtorch.abi3.so.xz", "wb") as f:
        f.write(b"not an ELF file")
    marlin = peers.setup(_args(marlin_lib=lib_dir), MS, MS, "linear")
    unpacked = no_provider / "unpacked" / "_C_stable_libtorch.abi3.so"
    assert unpacked.read_bytes() == b"not an ELF file"
    assert marlin.status.startswith(f"not available: loading {unpacked}: BackendUnavailableError")


# ---- tables ------------------------------------------------------------------------------------


HEAD = {"device": "GPU", "date": "d", "torch": "t", "triton": "tr", "driver": "dr", "cuda": "c",
        "copy_bw_TBps": 4.0}  # fmt: skip


def _linear_meta(marlin: dict | None) -> dict:
    meta = {**HEAD, "shapes": [("down", 4096, 14336)], "ms": [16]}
    if marlin is not None:
        meta["marlin"] = marlin
    return meta


LINEAR_US = {"nvfp4_auto": 20.0, "mxfp4_auto": 22.0, "bf16": 80.0, "marlin_nvfp4": 40.0,
             "marlin_mxfp4": 44.0}  # fmt: skip


def _linear_rows(us: dict) -> list[dict]:
    return [
        {"shape": "down", "M": 16, "kernel": k, "us": v, "floor_us": 10.0} for k, v in us.items()
    ]


def test_linear_table_has_the_marlin_columns_and_ratios():
    pytest.importorskip("triton")
    import linear

    ok = {"status": "vllm 0.33.0 [vllm-0.30; ok]", "available": True, "ms": [16]}
    md = linear.markdown(_linear_meta(ok), _linear_rows(LINEAR_US))
    head = next(line for line in md.splitlines() if line.startswith("| shape"))
    assert head.endswith(
        "| auto/floor | Marlin NVFP4 | Marlin MXFP4 | bf16/Marlin NV | Marlin NV/auto "
        "| bf16/Marlin MX | Marlin MX/auto |"
    )
    row = next(line for line in md.splitlines() if line.startswith("| down"))
    assert row.endswith("| 40.0 | 44.0 | 2.00x | 2.00x | 1.82x | 2.00x |")
    sep = md.splitlines()[md.splitlines().index(head) + 1]
    assert head.count("|") == row.count("|") == sep.count("|")
    assert "Marlin NVFP4 / MXFP4 = vllm 0.33.0" in md and "MarlinBackend.linear" in md

    failed = {**LINEAR_US, "marlin_nvfp4": None}
    row = next(line for line in linear.markdown(_linear_meta(ok), _linear_rows(failed)).splitlines()
               if line.startswith("| down"))  # fmt: skip
    assert row.endswith("| FAIL | 44.0 | - | - | 1.82x | 2.00x |")


def test_linear_table_says_not_available_and_keeps_old_tables():
    pytest.importorskip("triton")
    import linear

    off = {"status": "not available: no usable Marlin provider (vllm: not installed)",
           "available": False, "ms": [16]}  # fmt: skip
    us = {k: v for k, v in LINEAR_US.items() if not k.startswith("marlin")}
    md = linear.markdown(_linear_meta(off), _linear_rows(us))
    assert "Marlin columns (n/a): not available: no usable Marlin provider" in md
    row = next(line for line in md.splitlines() if line.startswith("| down"))
    assert row.endswith("| n/a | n/a | - | - | - | - |")
    old = linear.markdown(_linear_meta(None), _linear_rows(us))
    assert "Marlin" not in old and old.splitlines()[-1].endswith("| 4.00x | 2.00x |")


def _moe_meta(marlin: dict) -> dict:
    models = {"gpt-oss-20b": (32, 4, 2880, 2880)}
    return {**HEAD, "format": "mxfp4", "bf16_path": "grouped_mm", "models": models,
            "ms": [1, 16], "marlin": marlin}  # fmt: skip


def _moe_rows(us: dict, m: int = 1) -> list[dict]:
    row = {"model": "gpt-oss-20b", "M": m, "rel_err": 4e-3, "floor_us": 5.0, "config": {},
           "experts_touched": 4.0}  # fmt: skip
    return [{**row, "kernel": k, "us": v} for k, v in us.items()]


def test_moe_table_has_the_marlin_column_and_ratios():
    pytest.importorskip("triton")
    import moe

    ok = {"status": "vllm 0.33.0 [vllm-0.30; ok]", "available": True, "ms": [1]}
    rows = _moe_rows({"mxfp4": 10.0, "mxfp4_ckpt": 12.0, "bf16": 30.0, "marlin": 15.0})
    rows += _moe_rows({"mxfp4": 20.0, "mxfp4_ckpt": 24.0, "bf16": 30.0}, m=16)
    md = moe.markdown(_moe_meta(ok), rows)
    lines = md.splitlines()
    head = next(line for line in lines if line.startswith("| model"))
    assert head.endswith("| config | marlin | bf16/marlin | marlin/mxfp4 | err marlin |")
    m1, m16 = (line for line in lines if line.startswith("| gpt-oss-20b"))
    assert m1.endswith("| 15.0 | 2.00x | 1.50x | 4.0e-03 |")
    assert m16.endswith("| - | - | - | - |")  # M outside --marlin-ms
    assert "marlin = vllm 0.33.0" in md and "MarlinBackend.moe" in md

    ok["skipped"] = {"gpt-oss-20b": "BackendUnavailableError: H=2880 ..."}
    md = moe.markdown(_moe_meta(ok), [r for r in rows if r["kernel"] != "marlin"])
    assert "gpt-oss-20b: not available: BackendUnavailableError" in md
    assert next(line for line in md.splitlines() if line.startswith("| gpt-oss")).endswith(
        "| n/a | - | - | - |"
    )


# ---- the timed calls on the fake provider ------------------------------------------------------


@pytest.mark.parametrize("kernel", peers.LINEAR_KERNELS)
def test_linear_marlin_calls_match_float64(fake_vllm, monkeypatch, kernel):
    pytest.importorskip("triton")
    import linear

    monkeypatch.setattr(linear, "DEVICE", "cpu")
    monkeypatch.setattr(linear, "ROTATE_BYTES", 1 << 16)
    gen = torch.Generator().manual_seed(0)
    p = linear.Problem(128, 256, gen)
    calls, ref = linear.make_calls(p, kernel, 5, gen)
    assert len(calls) == p.copies == 4
    assert linear.rel_err(calls[0](), ref()) < linear.BOUND
    assert torch.equal(calls[0](), calls[3]())  # the rotated copies hold the same weight
    prepared = p._marlin[kernel.removeprefix("marlin_")]
    linear.make_calls(p, kernel, 5, gen)
    assert p._marlin[kernel.removeprefix("marlin_")] is prepared  # prepared once per Problem


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_moe_marlin_column_matches_the_reference(fake_vllm, monkeypatch, fmt):
    pytest.importorskip("triton")
    import moe

    layer = moe.Layer(8, 2, 128, 64, torch.device("cpu"), seed=0, fmt=fmt)
    monkeypatch.setattr(layer, "nvfp4", layer.reference)  # no interpreter run for our columns
    monkeypatch.setattr(layer, "nvfp4_ckpt", layer.reference)
    marlin = peers.setup(_args(default_ms="quick"), [4], [4], "moe")
    peer = marlin.moe(layer, "tiny")
    assert peer is not None
    gen = torch.Generator().manual_seed(1)
    rows = moe.run_point(layer, "tiny", 4, gen, 0.0, graphs=False, marlin=peer)
    assert [r["kernel"] for r in rows] == [fmt, f"{fmt}_ckpt", "bf16", "marlin"]
    assert rows[3]["rel_err"] < moe.BOUND and rows[3]["us"] is not None
    assert rows[3]["path"] == "MarlinBackend.moe"
    without = moe.run_point(layer, "tiny", 4, gen, 0.0, graphs=False)
    assert [r["kernel"] for r in without] == [fmt, f"{fmt}_ckpt", "bf16"]


def test_moe_layer_marlin_cannot_run_is_recorded(fake_vllm):
    pytest.importorskip("triton")
    import moe

    marlin = peers.setup(_args(), [4], [4], "moe")
    layer = moe.Layer(8, 2, 128, 64, torch.device("cpu"), seed=0, fmt="nvfp4")
    layer.w13 = [layer.w13[0][..., :48], layer.w13[1][..., :6], layer.w13[2]]  # H = 96
    layer.w2 = [layer.w2[0][:, :96], layer.w2[1][:, :96], layer.w2[2]]
    assert marlin.moe(layer, "odd") is None
    assert "H=96" in marlin.meta["skipped"]["odd"]

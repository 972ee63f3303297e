"""benchmarks/tp_nccl.py, the two-GPU tensor / expert parallel run, works end to end on the
CPU: two gloo ranks, small shapes, every all-reduced output within its bound of the unsharded
layer in float64, the report written by rank 0 (timing is for NCCL on GPUs only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launcher import gloo_skip_reason, launch

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")


def run_script(rank: int, world: int, argv: list[str]) -> None:
    """One rank of the script (the launcher has joined the gloo group)."""
    sys.path.insert(0, BENCHMARKS)
    import tp_nccl

    tp_nccl.worker(rank, world, argv)


def test_script_runs_across_two_gloo_ranks(tmp_path):
    reason = gloo_skip_reason()
    if reason:
        pytest.skip(reason)
    argv = ["--backend", "gloo", "--device", "cpu", "--small"]
    argv += ["--work", str(tmp_path / "checkpoint"), "--out", str(tmp_path)]
    launch(run_script, 2, argv, timeout=180)
    (report_file,) = tmp_path.glob("tp-gloo-2x-*.json")
    report = json.loads(report_file.read_text())
    assert report["ranks"] == 2 and report["timing"] == []
    assert [c["m"] for c in report["checks"]] == [1, 16, 100, 1, 16, 100]
    assert report["all_within_bound"], report["checks"]
    assert all(0 < c["rel_error"] < c["bound"] for c in report["checks"])
    assert "| MoE 8 experts" in report_file.with_suffix(".md").read_text()

"""benchmarks/fp8_prefill.py imports cleanly and its CPU smoke run (tiny shape, plain-torch rule,
torch._scaled_mm emulated for the run only) writes its JSON and markdown: every path checked,
FP8 within its proven bound, the resident copy equal to per-call re-encoding."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

sys.path.insert(0, "benchmarks")

import fp8_prefill as bench  # benchmarks/fp8_prefill.py


def test_cpu_smoke_run(tmp_path):
    pytest.importorskip("triton")
    scaled_mm = torch._scaled_mm
    t0 = time.time()
    base = bench.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    assert time.time() - t0 < 60
    assert torch._scaled_mm is scaled_mm  # restored
    data = json.loads(base.with_suffix(".json").read_text())
    rows = data["rows"]
    assert {r["column"] for r in rows} >= {"bf16", "wo", "fp8", "fp8_res"}
    assert all(r["ok"] and r["us"] is not None for r in rows)
    fp8 = [r for r in rows if r["column"] == "fp8"]
    assert fp8 and all(r["bound_ratio"] <= 1 and r["res_equal"] for r in fp8)
    md = base.with_suffix(".md").read_text()
    assert "| shape | M | err bf16 |" in md and "crossover M" in md

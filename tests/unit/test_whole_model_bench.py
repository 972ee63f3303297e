"""benchmarks/whole_model.py on the CPU with a tiny model: the result file has the promised
row keys for every run and variant, and the graph decode's tokens equal the eager step's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("triton", reason="triton is not installed (optional extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import whole_model

KEYS = {"model", "run", "batch", "tokens", "bf16_ms", "bf16_fused_ms", "quant_ms", "format"}


def test_tiny_run_writes_every_row(tmp_path):
    whole_model.main([
        "--models", "tiny", "--layers", "1", "--device", "cpu", "--runs",
        "eager-decode,graph-decode,eager-prefill", "--batches", "1,2", "--prefill", "8",
        "--steps", "2", "--reps", "1", "--out", str(tmp_path),
    ])  # fmt: skip
    (path,) = tmp_path.glob("whole-model-cpu-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["run"], r["batch"]) for r in rows] == [
        ("eager-decode", 1), ("eager-decode", 2), ("graph-decode", 1), ("graph-decode", 2),
        ("eager-prefill", 1),
    ]  # fmt: skip
    for r in rows:
        assert set(r) >= KEYS and "error" not in r, r
        assert all(isinstance(r[k], float) for k in ("bf16_ms", "bf16_fused_ms", "quant_ms")), r
    assert all(r["tokens_match_eager"] for r in rows if r["run"] == "graph-decode")
    assert (tmp_path / path.name.replace(".json", ".md")).is_file()

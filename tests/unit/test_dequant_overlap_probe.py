"""benchmarks/probes/dequant_overlap.py on the CPU (interpreter, tiny shapes, no streams): the
overlapped chains (next layer, own slabs) give the sequential chain's bits and all are within
bf16 rounding of the float64 product, so the GPU run only has to time them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))

import dequant_overlap


def test_overlap_chain_equals_the_sequential_chain():
    # 384 rows in 3 slabs of 128: the slab way's loop and workspace reuse run too
    # and DequantGemm with a 64 Ki-element workspace: two slabs of 256 and 128 rows
    (row,) = dequant_overlap.measure("tiny", 384, 256, [5], 3, 1, torch.device("cpu"), 3, (1 / 16,))
    assert row["failed"] == []
    for way in ("overlap", "overlap_hi", "slabs", "slab0.0625M"):
        assert row[f"{way}_equals_seq"], way
        assert row[f"{way}_rel_err_vs_float64"] < 1e-2
        assert row[f"{way}_us"] > 0 and f"bf16/{way}" in row
    assert row["seq_rel_err_vs_float64"] < 1e-2

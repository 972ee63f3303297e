"""benchmarks/probes/dequant_overlap.py on the CPU (interpreter, tiny shapes, no streams): the
overlapped chain gives the sequential chain's bits and both are within bf16 rounding of the
float64 product, so the GPU run only has to time them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))

import dequant_overlap


def test_overlap_chain_equals_the_sequential_chain():
    (row,) = dequant_overlap.measure("tiny", 128, 256, [5], 3, 1, torch.device("cpu"))
    assert row["overlap_equals_seq"] and row["seq_rel_err_vs_float64"] < 1e-2
    assert row["bf16/seq"] > 0 and row["bf16/overlap"] > 0

"""The benchmark scripts' own argument parsing (no GPU): bad values get one clear message."""

from __future__ import annotations

import sys

import pytest

sys.path.insert(0, "benchmarks")

from moe import parse_shape  # benchmarks/moe.py


def test_moe_shape_parses():
    assert parse_shape("mine=64,6,2048,1408") == ("mine", (64, 6, 2048, 1408))


MALFORMED = ["mine", "=64,6,2048,1408", "mine=64,6,2048", "mine=64,x,2048,1408",
             "mine=4,8,2048,1408", "mine=64,0,2048,1408"]  # fmt: skip


@pytest.mark.parametrize("text", MALFORMED)
def test_moe_shape_rejects_malformed(text):
    with pytest.raises(ValueError, match="--shape"):
        parse_shape(text)

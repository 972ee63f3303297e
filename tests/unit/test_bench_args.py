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


def test_ksplit_probe_points_and_splits_parse():
    from ksplit_probe import parse_point, parse_split  # benchmarks/ksplit_probe.py

    assert parse_point("mxfp4:32,4,2880,2880:4") == ("mxfp4", 32, 4, 2880, 2880, 4)
    assert parse_split("1x4x1") == (1, 4, 1)


@pytest.mark.parametrize(
    "text", ["mxfp4:32,4,2880,2880", "fp8:32,4,2880,2880:4", "mxfp4:32,4,2880:4",
             "mxfp4:4,8,2048,768:4", "mxfp4:32,4,2880,2900:4", "mxfp4:32,4,2880,2880:0"],
)  # fmt: skip
def test_ksplit_probe_rejects_malformed_points(text):
    from ksplit_probe import parse_point

    with pytest.raises(ValueError, match="--points"):
        parse_point(text)


@pytest.mark.parametrize("text", ["1x4", "1x0x1", "axbxc", "1x4x1x2"])
def test_ksplit_probe_rejects_malformed_splits(text):
    from ksplit_probe import parse_split

    with pytest.raises(ValueError, match="WTxWKxUNROLL"):
        parse_split(text)

"""The benchmark scripts' own argument parsing (no GPU): bad values get one clear message."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/probes")  # the one-off probes (ksplit_probe.py)

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
    from ksplit_probe import parse_point, parse_split  # benchmarks/probes/ksplit_probe.py

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


def test_moe_sweep_times_dequantize_from_256_tokens_per_expert():
    """The crossover between the grouped GEMM and dequantize + grouped_mm lies between 512 and
    1024 tokens per expert, below the plan's threshold: the sweep must time both there."""
    from moe import sweep_configs

    from quantdispatch.kernels.common.moe_plan import DequantMoeConfig

    mixtral = (2, 8, 14336, 4096)  # top_k, E, I, H
    assert any(isinstance(c, DequantMoeConfig) for c in sweep_configs(2048, *mixtral))  # 512
    assert not any(isinstance(c, DequantMoeConfig) for c in sweep_configs(512, *mixtral))  # 128


def test_linear_rejects_unknown_tune_kinds(monkeypatch, capsys):
    """An unknown --tune-kinds value used to tune nothing, silently."""
    pytest.importorskip("triton")
    import linear  # benchmarks/linear.py

    monkeypatch.setattr(sys, "argv", ["linear.py", "--tune", "--tune-kinds", "nvfp4,fp4"])
    with pytest.raises(SystemExit) as exc:
        linear.main()
    assert exc.value.code == 2 and "unknown ['fp4']" in capsys.readouterr().err

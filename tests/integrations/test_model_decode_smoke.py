"""benchmarks/model_decode.py runs end to end on the CPU in its smoke mode (tiny config)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import model_decode  # benchmarks/model_decode.py


def test_cpu_smoke_run_writes_json_and_markdown(tmp_path):
    argv = ["--device", "cpu", "--quick", "--config", "tiny", "--out", str(tmp_path)]
    report = model_decode.main([*argv, "--keep-compile-caches"])
    rows = report["rows"]
    assert [(r["kind"], r["model"], r.get("compile")) for r in rows] == [
        ("ttft", "bf16", None),
        ("decode", "bf16", "none"),
        ("decode", "bf16", "graph"),
        ("ttft", "nvfp4", None),
        ("decode", "nvfp4", "none"),
        ("decode", "nvfp4", "graph"),
    ]
    assert all(r["logits_finite"] for r in rows if r["kind"] == "ttft")
    assert all(r["decode_tok_s"] > 0 and "error" not in r for r in rows if r["kind"] == "decode")
    # the graph mode's decoder (eager on the CPU) gives the tokens of its plain eager twin
    assert all(r["tokens_match_eager"] for r in rows if r.get("compile") == "graph")
    assert report["quantized_layers"] == {"nvfp4/reference": 14}
    (json_file,) = tmp_path.glob("model-decode-*.json")
    saved = json.loads(json_file.read_text())
    assert saved["versions"]["transformers"] and saved["rows"] == json.loads(json.dumps(rows))
    md = json_file.with_suffix(".md").read_text()
    assert "| none | 1 | nvfp4 |" in md and "TTFT cold" in md and "| graph | 1 | nvfp4 |" in md


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--batches", "1,x"], "--batches takes integers"),
        (["--batches", "0"], "positive integers"),
        (["--compile", "turbo"], "--compile takes"),
        (["--new-tokens", "1"], "at least 2"),
    ],
)
def test_bad_arguments_are_refused(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        model_decode.parse_args(argv)
    assert fragment in capsys.readouterr().err


def test_compile_modes_map_to_transformers_compile_configs():
    import torch

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert model_decode._compile_config("none", gpu) is None
    graphs = model_decode._compile_config("cudagraphs", gpu)
    assert graphs.backend == "cudagraphs" and graphs.mode is None
    assert not graphs._compile_all_devices
    inductor = model_decode._compile_config("inductor", cpu)
    assert inductor.backend == "inductor" and inductor.mode == "reduce-overhead"
    assert inductor._compile_all_devices
    assert isinstance(model_decode._graph_counters().get("unique_graphs"), int)

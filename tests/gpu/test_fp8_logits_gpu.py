"""GPU: FP8 compute for prefill on a whole model (benchmarks/fp8_logits.py). A 4-layer
Llama-style model quantized to NVFP4 runs one 4 x 1024-token prefill with fp8_compute off,
prefill and prefill-resident; the decisions name the FP8 prefill kernel exactly where it is on,
every layer of the FP8 models computes what the FP8 rule says on its input, and
their distance to the W4A16 semantics is larger than the weight-only kernels' (it is lossy) and
smaller than what quantizing the weights to FP4 itself changes. Needs SM 9.0 (block-scaled
recipes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.fixture(scope="module")
def report():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run tests/gpu in its own process")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 prefill rows are on SM 9.0 only")
    import fp8_logits

    return {r["mode"]: r for r in fp8_logits.measure(batch=4, seq=1024)["rows"]}


def test_decisions_name_the_fp8_kernel_only_where_it_is_on(report):
    assert all("fp8 prefill" not in k for k in report["off"]["kernels"])
    assert report["prefill"]["kernels"] == ["fp8 prefill"]
    assert report["prefill-resident"]["kernels"] == ["fp8 prefill"]


@pytest.mark.parametrize("mode", ["prefill", "prefill-resident"])
def test_every_layer_computes_the_fp8_rule(report, mode):
    """Each quantized layer's output in the model against the float64 FP8 rule on that layer's
    own input: within the bf16 output rounding (2^-9 relative per element) plus fp32
    accumulation. The weight-only model's layers are ~20x farther from the rule (FP8's own
    rounding), so the check tells the two apart."""
    fp8, off = report[mode], report["off"]
    assert fp8["finite"]
    assert fp8["layer_rel_error_vs_fp8_rule"] < 4e-3, fp8
    assert off["layer_rel_error_vs_fp8_rule"] > 1e-2, off


@pytest.mark.parametrize("mode", ["prefill", "prefill-resident"])
def test_fp8_error_between_weight_only_and_fp4_quantization(report, mode):
    off, fp8 = report["off"], report[mode]
    unquantized = report["bf16 weights (not quantized)"]
    assert off["finite"] and off["rel_error"] < 0.03, off  # bf16 activations, summation order
    assert off["rel_error"] < fp8["rel_error"] < unquantized["rel_error"], (off, fp8, unquantized)


@pytest.mark.parametrize("mode", ["prefill", "prefill-resident"])
def test_producers_quantize_every_input_but_attention_output(report, mode):
    """Per decoder layer: both norms and the MLP produce the codes (3 patched modules); q / k /
    v, gate / up and down take them from the handoff (6 shared), only o quantizes its input."""
    import fp8_logits

    fp8, layers = report[mode], fp8_logits.CONFIG["num_hidden_layers"]
    assert fp8["producers"] == 3 * layers, fp8
    assert (fp8["hits"], fp8["misses"]) == (6 * layers, layers), fp8
    off = report["off"]
    assert (off["producers"], off["hits"], off["misses"]) == (0, 0, 0), off

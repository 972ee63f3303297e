"""Whole tiny transformers models on a real GPU through the triton backend: checkpoints loaded
with load_model and float models quantized with quantize_model generate like the same model with
the decoded float weights; transformers' static cache with CUDA graphs / torch.compile gives the
eager tokens."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))

from hf_models import (  # noqa: E402  tests/integrations/hf_models.py
    assert_matches_reference,
    float_model,
    greedy,
    make_config,
    reference_model,
    write_checkpoint,
)

from quantdispatch import QuantLinear, QuantMoE, load_settings  # noqa: E402
from quantdispatch.integrations.transformers import (  # noqa: E402
    ReferenceBackendWarning,
    load_model,
    quantize_model,
)

DEV = torch.device("cuda")

CASES = [
    ("llama", "modelopt", "nvfp4"),
    ("llama", "ct", "fp8"),
    ("qwen3_moe", "modelopt", "nvfp4"),
    ("mixtral", "ct", "mxfp4"),
    ("gpt_oss", "gpt-oss", "mxfp4"),
]


def _triton(fmt):
    return load_settings({}, backend={fmt: "triton"})


def _layers(model):
    return [m for m in model.modules() if isinstance(m, (QuantLinear, QuantMoE))]


@pytest.mark.parametrize(("arch", "producer", "fmt"), CASES)
def test_checkpoint_on_triton_generates_like_the_decoded_float_model(tmp_path, arch, producer, fmt):
    config = make_config(arch)
    ref_state = write_checkpoint(
        float_model(config), tmp_path, arch=arch, fmt=fmt, producer=producer
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceBackendWarning)
        model = load_model(tmp_path, device=DEV, settings=_triton(fmt), attn_implementation="eager")
    layers = _layers(model)
    assert layers and {m.backend for m in layers} == {"triton"}
    assert all(t.device.type == DEV.type for t in [*model.parameters(), *model.buffers()])
    ref = reference_model(config, ref_state).to(DEV)
    # GPU kernels accumulate in another order than cuBLAS: near ties may part
    assert_matches_reference(model, ref, exact=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gpt_oss"])
def test_static_cache_with_cuda_graphs_gives_the_eager_tokens(tmp_path, arch):
    from transformers import CompileConfig

    config = make_config(arch)
    fmt = "mxfp4" if arch == "gpt_oss" else "nvfp4"
    write_checkpoint(float_model(config), tmp_path, arch=arch, fmt=fmt)
    attn = "eager" if arch == "gpt_oss" else "sdpa"
    model = load_model(tmp_path, device=DEV, settings=_triton(fmt), attn_implementation=attn)
    eager = greedy(model)
    graphs = CompileConfig(backend="cudagraphs", mode=None, fullgraph=True)
    assert greedy(model, cache_implementation="static", disable_compile=True) == eager
    assert greedy(model, cache_implementation="static", compile_config=graphs) == eager


def test_transformers_default_compile_reduce_overhead(tmp_path):
    """transformers' automatic compile (inductor, mode='reduce-overhead') of the decode step."""
    write_checkpoint(float_model(make_config("llama")), tmp_path, arch="llama")
    model = load_model(tmp_path, device=DEV, attn_implementation="sdpa")
    eager = greedy(model)
    torch._dynamo.reset()
    assert greedy(model, cache_implementation="static") == eager


def test_quantize_model_on_gpu_moe(tmp_path):
    config = make_config("qwen3_moe")
    model = float_model(config, dtype=torch.bfloat16).to(DEV)
    ref = float_model(config, dtype=torch.bfloat16).to(DEV)  # same seed: same weights
    from quantdispatch.formats import dequantize_nvfp4, quantize_nvfp4

    with torch.no_grad():
        for name, m in ref.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                m.weight.copy_(dequantize_nvfp4(quantize_nvfp4(m.weight.float())))
            elif type(m).__name__ == "Qwen3MoeExperts":
                inter = m.gate_up_proj.shape[1] // 2
                for e in range(m.gate_up_proj.shape[0]):
                    for rows in (slice(0, inter), slice(inter, None)):
                        w = m.gate_up_proj[e, rows].float()
                        m.gate_up_proj[e, rows] = dequantize_nvfp4(quantize_nvfp4(w))
                    m.down_proj[e] = dequantize_nvfp4(quantize_nvfp4(m.down_proj[e].float()))
    quantize_model(model, "nvfp4", settings=_triton("nvfp4"))
    assert {m.backend for m in _layers(model)} == {"triton"}
    assert_matches_reference(model, ref, exact=False)

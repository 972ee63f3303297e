"""install_fused_ops on tiny transformers models (CPU; the fused kernels run in Triton's
interpreter here): which modules it patches, that the patched models compute what the eager
modules compute (within the kernels' own fp32 rounding) and give the same greedy tokens, that
remove_fused_ops restores them, that ``fused_ops=False`` leaves them alone, and the custom ops
that torch.compile traces. The kernels' numerics against float64: tests/numerics/
test_fp8_producers.py; on the GPU: tests/gpu/test_transformers_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from hf_models import PROMPT, float_model, greedy, make_config

import quantdispatch.ops  # noqa: F401
from quantdispatch.integrations.transformers import (
    capture_decode,
    fused_ops,
    fused_rope,
    install_fused_ops,
    quantize_model,
    remove_fused_ops,
)
from quantdispatch.kernels.common.checks import interpreting

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="runs the fused kernels on CPU tensors in the interpreter"
)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Let the fused forwards run their kernels on CPU tensors (the interpreter)."""
    monkeypatch.setattr(fused_ops, "_kernels_run", lambda x: True)
    monkeypatch.setattr(fused_rope, "_kernel_call", lambda q, k, cos, sin: True)


def _patched(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if getattr(m, fused_ops.FUSED, False))


def _model(arch, dtype=torch.bfloat16):
    return float_model(make_config(arch), dtype=dtype)


@pytest.mark.parametrize(
    ("arch", "per_layer"),
    # norms (+ q / k norms), MLP, decoder layer, attention
    [("llama", 5), ("qwen3", 7), ("qwen3_moe", 6)],
)
def test_install_patches_the_known_modules_and_remove_restores_them(arch, per_layer):
    model = _model(arch)
    n = install_fused_ops(model)
    names = _patched(model)
    assert n == len(names) == 2 * per_layer + 1  # 2 decoder layers and the final norm
    assert "model.norm" in names and "model.layers.0" in names
    assert install_fused_ops(model) == 0  # already patched
    assert remove_fused_ops(model) == n
    assert _patched(model) == [] and all("forward" not in vars(m) for m in model.modules())


def test_unknown_architectures_keep_their_modules():
    model = _model("phi3")  # Phi3RMSNorm, fused qkv / gate_up: not a class fused here
    assert install_fused_ops(model) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_model_computes_the_eager_models_logits(kernels_on_cpu, arch, dtype):
    base = _model(arch, dtype)
    model = copy.deepcopy(base)
    install_fused_ops(model)
    with torch.no_grad():
        want = base(PROMPT).logits.double()
        got = model(PROMPT).logits.double()
    err = float((got - want).norm() / want.norm())
    assert err < (2e-2 if dtype == torch.bfloat16 else 3e-3), err
    assert greedy(model, 8) == greedy(base, 8)


def test_quantized_model_gets_fused_ops_by_default_and_not_when_off(kernels_on_cpu):
    model = quantize_model(_model("llama"), "nvfp4")
    assert len(_patched(model)) == 11
    off = quantize_model(_model("llama"), "nvfp4", fused_ops=False)
    assert _patched(off) == []
    with torch.no_grad():
        a, b = model(PROMPT).logits.double(), off(PROMPT).logits.double()
    assert float((a - b).norm() / b.norm()) < 2e-2


def test_the_attention_rotates_q_and_k_in_one_kernel_for_its_own_instances_only(
    kernels_on_cpu, monkeypatch
):
    """A patched attention runs the fused rotary kernel once per call, gives the eager model's
    logits bit for bit where nothing else is fused, and leaves its class and other models alone."""
    from quantdispatch.kernels.native import rope

    base = _model("llama")
    model = copy.deepcopy(base)
    cls = type(model.model.layers[0].self_attn)
    forward = cls.forward
    for layer in model.model.layers:
        fused_ops.patch_attention(layer.self_attn)
    calls = []
    real = rope.rope_launch
    monkeypatch.setattr(rope, "rope_launch", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, base(PROMPT).logits)
    assert len(calls) == len(model.model.layers)
    assert cls.forward is forward and "forward" not in vars(base.model.layers[0].self_attn)
    calls.clear()
    with torch.no_grad():
        base(PROMPT)
    assert calls == []


def test_the_decoder_layer_adds_the_residual_and_norms_once(kernels_on_cpu, monkeypatch):
    """The patched decoder layer calls the add + norm kernel once and the post-attention
    norm module never: the sum it returns is the eager residual stream."""
    model = _model("llama")
    install_fused_ops(model)
    calls = []
    from quantdispatch.kernels.native import fp8_producers

    real = fp8_producers.RmsNorm.__call__

    def counted(self, x, residual=None):
        calls.append(residual is not None)
        return real(self, x, residual)

    monkeypatch.setattr(fp8_producers.RmsNorm, "__call__", counted)
    with torch.no_grad():
        model(PROMPT)
    # per layer: input norm, add + post-attention norm; then the final norm
    assert calls == [False, True, False, True, False]


def test_bound_kernels_give_the_functions_bits():
    """The eager fast path's bound RmsNorm / SiluMul are the functions' kernels: same bits."""
    from quantdispatch.kernels.native.fp8_producers import RmsNorm, SiluMul, rmsnorm, silu_mul_fp8

    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        x, r = (torch.randn(6, 384, generator=g).to(dtype) for _ in range(2))
        w = (torch.rand(384, generator=g) + 0.5).to(dtype)
        norm = RmsNorm(w, 1e-5)
        assert torch.equal(norm(x), rmsnorm(x, w, 1e-5)[0])
        y, s = norm(x, r)
        want_y, want_s, _ = rmsnorm(x, w, 1e-5, residual=r)
        assert torch.equal(y, want_y) and torch.equal(s, want_s)
        silu = SiluMul(384, dtype, x.device)
        assert torch.equal(silu(x, r), silu_mul_fp8(x, r, quantize=False)[0])


def test_autograd_and_cpu_calls_run_the_modules_own_forward():
    model = _model("llama")
    install_fused_ops(model)
    base = _model("llama")
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, base(PROMPT).logits)  # CPU: own forwards


def test_custom_ops_match_the_kernels_and_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    r = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    w = (torch.rand(256, generator=g) + 0.5).to(torch.bfloat16)
    from quantdispatch.kernels.native.fp8_producers import rmsnorm, silu_mul_fp8

    y, s, _ = rmsnorm(x, w, 1e-5, residual=r)
    oy, os_ = torch.ops.quantdispatch.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(oy, y) and torch.equal(os_, s) and torch.equal(s, x + r)
    assert torch.equal(torch.ops.quantdispatch.rms_norm(x, w, 1e-5), rmsnorm(x, w, 1e-5)[0])
    want = silu_mul_fp8(x, r, quantize=False)[0]
    assert torch.equal(torch.ops.quantdispatch.silu_mul(x, r), want)
    for op, args in (
        (torch.ops.quantdispatch.rms_norm, (x, w, 1e-5)),
        (torch.ops.quantdispatch.add_rms_norm, (x, r, w, 1e-5)),
        (torch.ops.quantdispatch.silu_mul, (x, r)),
    ):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_capture_decode_gives_generates_greedy_tokens():
    """On the CPU the step runs eagerly (``capture`` needs CUDA): the same tokens as HF's
    greedy generate on a static cache."""
    model = quantize_model(_model("llama"), "nvfp4")
    graph = capture_decode(model, batch_size=1, max_len=32)
    out = graph.generate(PROMPT, 10)
    assert out.shape == (1, PROMPT.shape[1] + 10)
    assert out[0, PROMPT.shape[1] :].tolist() == greedy(model, 10, cache_implementation="static")
    with pytest.raises(Exception, match="max_len=32"):
        graph.generate(PROMPT, 40)
    with pytest.raises(Exception, match="batch_size=1"):
        graph.generate(PROMPT.repeat(2, 1), 4)


def test_compiling_a_patched_attention_traces_the_class_forward():
    """Dynamo guards a function's globals as its module's: a patched attention must give
    torch.compile its class's own forward (else guard creation fails)."""
    base = _model("llama")
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        fused_ops.patch_attention(layer.self_attn)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="eager", fullgraph=False)(PROMPT).logits
        want = base(PROMPT).logits
    torch._dynamo.reset()
    assert torch.equal(got, want)

"""GPU: the fused FP8 producers (RMSNorm, SiLU x mul) with the hardware rounding, on Llama-8B
widths and sizes that are not multiples of the row tile: the 16-bit output within two steps of
the eager module's arithmetic in float64, the codes bit-equal with the activation quantizer
run on that output, and a QuantLinear with FP8 compute taking them from the handoff inside a
sharing scope (the same output as quantizing itself). Needs SM 8.9+ for the rounding
instruction; the linear SM 9.0."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run tests/gpu in its own process")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 conversion needs SM 8.9+")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def same_codes(y: torch.Tensor, codes) -> None:
    from quantdispatch.kernels.native.fp8_prefill import quantize_activations

    q, s = quantize_activations(y, "128x128")
    assert torch.equal(codes[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(codes[1], s) and codes[1].stride() == s.stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 77, 1000, 4099])
def test_rmsnorm_fp8_gpu(dtype, m):
    from quantdispatch.kernels.native.fp8_producers import rmsnorm_fp8

    k = 4096
    g = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, k, generator=g, device="cuda") * 3).to(dtype)
    w = (torch.rand(k, generator=g, device="cuda") + 0.5).to(dtype)
    y, codes = rmsnorm_fp8(x, w, 1e-5)
    h = x.double()
    n = (h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    d = ulps(y, (w.double() * n.double()).to(dtype))  # float64, rounded where the module rounds
    assert int(d.max()) <= 2 and float((d > 0).float().mean()) < 0.01
    same_codes(y, codes)


@pytest.mark.parametrize("m", [5, 1000, 2051])
def test_silu_mul_fp8_gpu(m):
    from quantdispatch.kernels.native.fp8_producers import silu_mul_fp8

    i = 14336
    g = torch.Generator(device="cuda").manual_seed(m)
    gu = (torch.randn(m, 2 * i, generator=g, device="cuda") * 4).to(torch.bfloat16)
    gate, up = gu[:, :i], gu[:, i:]
    y, codes = silu_mul_fp8(gate, up)
    g = gate.double()
    ref = ((g / (1 + torch.exp(-g))).to(gate.dtype).double() * up.double()).to(gate.dtype)
    # exp(-gate) overflows fp32 below gate = -88.7: silu is -0 there, the true products < 2^-100
    d = torch.where((ref.float().abs() < 2.0**-100) & (y.float() == 0), 0, ulps(y, ref))
    assert int(d.max()) <= 2 and float((d > 0).float().mean()) < 0.01
    same_codes(y, codes)


def test_linear_takes_the_producers_codes():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 prefill rows are on SM 9.0 only")
    from quantdispatch import QuantLinear, load_settings
    from quantdispatch.integrations.transformers import fp8_handoff
    from quantdispatch.kernels.native.fp8_producers import rmsnorm_fp8

    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 1024, bias=True, dtype=torch.bfloat16, device="cuda")
    layer = QuantLinear.from_float(
        lin, "nvfp4", settings=load_settings({}, fp8_compute="prefill-resident")
    )
    m = 300
    assert layer.decision.kernel_for(m).family == "fp8 prefill"
    x = torch.randn(2, m // 2, 4096, device="cuda").to(torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    fp8_handoff.clear()
    with fp8_handoff.sharing():
        y, codes = rmsnorm_fp8(x.view(-1, 4096), w, 1e-6)
        fp8_handoff.offer(y, codes)  # what the HF integration's fused norm does
        shared = layer(y.view(2, m // 2, 4096))
    assert fp8_handoff.counts() == {"hits": 1, "misses": 0}
    fp8_handoff.clear()
    with fp8_handoff.sharing():
        own = layer(y.clone().view(2, m // 2, 4096))
    assert fp8_handoff.counts() == {"hits": 0, "misses": 1}
    assert torch.equal(shared, own)


def test_compiled_model_with_producers():
    """torch.compile traces the patched norms, MLPs and decoder layers (their own forwards while
    compiling: no producers, no sharing) and computes what the eager FP8 model does, up to the
    roundings where the eager producers' 16-bit outputs differ from torch's norm."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 prefill rows are on SM 9.0 only")
    transformers = pytest.importorskip("transformers")
    from quantdispatch import load_settings
    from quantdispatch.integrations.transformers import quantize_model
    from quantdispatch.integrations.transformers.fp8_producers import PATCHED

    cfg = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=512, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    settings = load_settings({}, fp8_compute="prefill-resident")
    model = quantize_model(base, "nvfp4", settings=settings)
    assert sum(hasattr(m, PATCHED) for m in model.modules()) == 6
    ids = torch.randint(0, 512, (1, 512), device="cuda")
    with torch.no_grad():
        eager = model(ids).logits.float()
        got = torch.compile(model)(ids).logits.float()
    assert bool(torch.isfinite(got).all())
    assert float((got - eager).norm() / eager.norm()) < 5e-2

"""The Marlin backend on a real GPU with vLLM's own compiled kernels.

    python3 -m pytest tests/gpu/test_marlin_gpu.py -q

The provider: vLLM's stable-ABI libraries from ``.peer/vllm/*.xz`` (written by
../shared/tools/peer-vllm-marlin.sh, decompressed here to /tmp/vllm), else an installed vLLM
package. Skipped, with the reason, without a GPU or without a provider that loads.

What this proves and the CPU tests cannot: that vLLM's kernels read our preparation (scale
order, S0E5M3 encoding, exponent offsets, padding) as docs/design/marlin.md says. Bounds are
normwise against float64: 1e-2 (bf16 output rounding plus the bf16 flush of block scales
below ~2^-14 of a weight's largest), 4e-3 for fp16; MoE 1.5e-2 / 4e-3 against the reference
backend (fp32 accumulation).
"""

from __future__ import annotations

import functools
import lzma
from pathlib import Path

import pytest
import torch

from quantdispatch.api import load_settings
from quantdispatch.backends import marlin_providers
from quantdispatch.formats import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)
from quantdispatch.layers import QuantLinear, QuantMoE
from quantdispatch.resolver import _resolve

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
PEER = Path(__file__).resolve().parents[2] / ".peer" / "vllm"
LIB_DIR = Path("/tmp/vllm")
BOUND = {torch.bfloat16: 1e-2, torch.float16: 4e-3}
MOE_BOUND = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}
CASES = [("nvfp4", torch.bfloat16), ("nvfp4", torch.float16), ("mxfp4", torch.bfloat16)]
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
TP_SHARDS = [(720, 2880), (1792, 4096), (4096, 1792)]  # gpt-oss / 4, Llama-3-8B down / 8


def _peer_libraries() -> tuple[list[Path], str] | None:
    """Decompress .peer/vllm/*.xz into /tmp/vllm once; (libraries, version) or None."""
    archives = sorted(PEER.glob("*.so.xz")) if PEER.is_dir() else []
    if not archives:
        return None
    LIB_DIR.mkdir(exist_ok=True)
    libs = []
    for xz in archives:
        out = LIB_DIR / xz.stem
        if not out.is_file():
            tmp = out.with_suffix(".part")
            with lzma.open(xz) as f:
                tmp.write_bytes(f.read())
            tmp.rename(out)
        libs.append(out)
    version_file = PEER / "VERSION"
    text = version_file.read_text().strip() if version_file.is_file() else "vllm==0.33.0"
    return libs, text.split("==")[-1]


@pytest.fixture(scope="module", autouse=True)
def vllm_marlin():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    marlin_providers.reset()
    peer = _peer_libraries()
    try:
        if peer is not None:
            libs, version = peer
            for lib in libs:  # _C (dense, repack) and _moe_C (MoE)
                marlin_providers.load_library(lib, provider="vllm", version=version)
        status = marlin_providers.active()
        if status is None:
            reasons = "; ".join(s.describe() for s in marlin_providers.statuses())
            pytest.skip(f"no usable Marlin provider: {reasons}")
        marlin_providers.ensure_loaded(status, ("gemm", "repack", "moe"))
    except Exception as exc:  # a library that does not load here is a reason to skip
        if isinstance(exc, pytest.skip.Exception):
            raise
        pytest.skip(f"vLLM's Marlin library is not usable here: {type(exc).__name__}: {exc}")
    _resolve.cache_clear()
    yield status
    marlin_providers.reset()
    _resolve.cache_clear()


def _forced(fmt: str, backend: str = "marlin"):
    return load_settings({}, backend={fmt: backend})


@functools.lru_cache(maxsize=4)
def _weight(fmt: str, n: int, k: int):
    g = torch.Generator(device=DEV).manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g, device=DEV) * 0.02
    w[: max(1, n // 64)] *= 1e-3  # some rows with subnormal block scales
    q = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_mxfp4(w)
    deq = dequantize_nvfp4 if fmt == "nvfp4" else dequantize_mxfp4
    return q, deq(q, dtype=torch.float64)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(out).all()), "NaN/inf in the output"
    return float((out.double() - ref).norm() / ref.norm())


def test_registered_ops_have_the_contract_schemas(vllm_marlin):
    row = vllm_marlin.contract
    assert row is not None and row.key == "vllm-0.30", vllm_marlin.describe()
    for role in ("gemm", "repack", "moe"):
        assert marlin_providers.schema_mismatch(row, role) is None


@pytest.mark.parametrize(("fmt", "act"), CASES, ids=["nvfp4-bf16", "nvfp4-fp16", "mxfp4-bf16"])
@pytest.mark.parametrize(("n", "k"), LLAMA3_8B + TP_SHARDS)
@pytest.mark.parametrize("m", [1, 16, 100, 1024])
def test_quant_linear_on_vllm_marlin_matches_float64(fmt, act, n, k, m):
    q, w64 = _weight(fmt, n, k)
    bias = torch.randn(n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(m))
    layer = QuantLinear(q, bias=bias, act_dtype=act, device=DEV, settings=_forced(fmt))
    assert layer.backend == "marlin"
    x = torch.randn(m, k, device=DEV, generator=torch.Generator(device=DEV).manual_seed(k))
    x = x.to(act)
    ref = x.double() @ w64.T + bias.double()
    assert _rel(layer(x), ref) < BOUND[act]


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_tiny_block_scales_under_a_unit_global_scale(act):
    """Block scales 2^-9..2^-6 with global scale 1 (the checkpoints vLLM #34577 fixed): fp16
    reads them unchanged, bf16 needs the power-of-two rescale."""
    from quantdispatch.formats import Nvfp4Weight

    g = torch.Generator(device=DEV).manual_seed(0)
    n, k = 4096, 4096
    packed = torch.randint(0, 256, (n, k // 2), generator=g, device=DEV).to(torch.uint8)
    scales = (torch.rand(n, k // 16, generator=g, device=DEV) * 2.0**-6 + 2.0**-9).to(
        torch.float8_e4m3fn
    )
    w = Nvfp4Weight(packed, scales, torch.tensor(1.0, device=DEV))
    layer = QuantLinear(w, act_dtype=act, device=DEV, settings=_forced("nvfp4"))
    x = torch.randn(16, k, device=DEV, generator=g).to(act)
    ref = x.double() @ dequantize_nvfp4(w, dtype=torch.float64).T
    assert _rel(layer(x), ref) < BOUND[act]


def test_fp16_large_activations_stay_finite():
    """The fp16 epilogue (vLLM #37135): partial sums before the global scale must not
    overflow for activations of ~16 on a 14336-wide reduction (outputs ~40, partial sums
    before a ~4e-3 global scale ~1e4: inside fp16 either way, a regression guard only)."""
    q, w64 = _weight("nvfp4", 4096, 14336)
    layer = QuantLinear(q, act_dtype=torch.float16, device=DEV, settings=_forced("nvfp4"))
    x = (torch.randn(64, 14336, device=DEV) * 16).to(torch.float16)
    assert _rel(layer(x), x.double() @ w64.T) < BOUND[torch.float16]


def test_cuda_graph_replay_equals_eager():
    q, _ = _weight("nvfp4", 720, 2880)  # padded N: the slice is captured too
    layer = QuantLinear(q, device=DEV, settings=_forced("nvfp4"))
    x = torch.randn(16, 2880, device=DEV).to(torch.bfloat16)
    eager = layer(x)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


def _experts(fmt: str, e: int, hidden: int, inter: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    quant = quantize_nvfp4 if fmt == "nvfp4" else quantize_mxfp4

    def one(n, k):
        return quant(torch.randn(n, k, generator=g, device=DEV) / k**0.5)

    return (
        [one(inter, hidden) for _ in range(e)],
        [one(inter, hidden) for _ in range(e)],
        [one(hidden, inter) for _ in range(e)],
    )


@functools.lru_cache(maxsize=2)
def _qwen3_moe(fmt: str, act: torch.dtype, held: tuple[int, ...] | None):
    """One Qwen3-30B-A3B MoE layer: 128 experts, top 8, hidden 2048, intermediate 768."""
    gate, up, down = _experts(fmt, 128 if held is None else len(held), 2048, 768, seed=1)
    kw = dict(
        top_k=8,
        num_experts=128,
        expert_ids=held,
        renormalize=True,
        routed_scaling_factor=2.5,  # applied once, by QuantMoE
        act_dtype=act,
        device=DEV,
    )
    marlin = QuantMoE(gate, up, down, settings=_forced(fmt), **kw)
    ref = QuantMoE(gate, up, down, settings=_forced(fmt, "reference"), **kw)
    return marlin, ref


@pytest.mark.parametrize(("fmt", "act"), CASES, ids=["nvfp4-bf16", "nvfp4-fp16", "mxfp4-bf16"])
@pytest.mark.parametrize("m", [1, 16, 100, 1024])
def test_qwen3_moe_layer_on_vllm_marlin_matches_reference(fmt, act, m):
    marlin, ref = _qwen3_moe(fmt, act, None)
    assert marlin.backend == "marlin"
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 2048, device=DEV, generator=g).to(act)
    logits = torch.randn(m, 128, device=DEV, generator=g)
    assert _rel(marlin(x, logits), ref(x, logits).double()) < MOE_BOUND[act]


def test_moe_expert_parallel_shard_skips_foreign_experts():
    held = tuple(range(0, 128, 2))
    marlin, ref = _qwen3_moe("nvfp4", torch.bfloat16, held)
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(64, 2048, device=DEV, generator=g).to(torch.bfloat16)
    logits = torch.randn(64, 128, device=DEV, generator=g)
    assert _rel(marlin(x, logits), ref(x, logits).double()) < MOE_BOUND[torch.bfloat16]

"""The checkpoint-layout mma.sync NVFP4 MoE kernels (kernels/common/moe_mma.py) on a
real GPU, against float64: every path (direct pairs, 8- and 16-pair sorted blocks), uneven K
splits, gpt-oss's clamped SwiGLU with biases, expert-parallel ids, poisoned buffers, CUDA
graphs. (The package never launches the kernel's LINEAR mode; the probes do:
benchmarks/probes/mma_sweep.py --ckpt checks it against float64 before timing it.)

    python3 -m pytest tests/gpu/test_checkpoint_layout_mma_gpu.py -q

Bounds as test_moe_gpu.py (three roundings)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from quantdispatch.errors import InputError
from quantdispatch.kernels.checkpoint_layout import moe as fm
from quantdispatch.kernels.checkpoint_layout import moe_plan
from quantdispatch.kernels.common import checks
from quantdispatch.kernels.common.device_facts import device_facts
from quantdispatch.kernels.common.moe_plan import MmaGemmConfig, MmaMoeConfig
from tests.gpu.test_moe_gpu import BOUND, DEV, moe64, rel, stacks

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _needs_sm80():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the mma kernels need an SM 8.0+ GPU")


def weights(e, h, i, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return stacks("nvfp4", e, 2 * i, h, gen), stacks("nvfp4", e, h, i, gen), gen


def routing(m, e, top_k, gen, dtype, h):
    x = torch.randn(m, h, generator=gen, device=DEV).to(dtype)
    logits = torch.randn(m, e, generator=gen, device=DEV)
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return x, ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def run(x, ids, w, w13, w2, cfg=None, b13=None, b2=None, activation="silu", params=()):
    return fm.fused_moe(x, ids, w, w13, w2, b13, b2, fmt="nvfp4", activation=activation,
                        params=list(params), config=cfg)  # fmt: skip


def gemm(wt=1, wk=4, unroll=2):
    return MmaGemmConfig(wt, wk, unroll)


CONFIGS = [
    MmaMoeConfig(1, gemm(1, 8, 2), gemm(1, 4, 1), direct=True),
    MmaMoeConfig(1, gemm(1, 2, 1), gemm(2, 1, 2), direct=False),
    MmaMoeConfig(2, gemm(1, 4, 2), gemm(1, 8, 2), direct=False),
    MmaMoeConfig(2, gemm(2, 2, 1), gemm(1, 2, 2), direct=False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{int(c.direct)}nt{c.nt}")
@pytest.mark.parametrize("m", [1, 3, 37])
def test_every_path_matches_float64(m, cfg, dtype):
    """Qwen3-like experts at reduced width (I = 384: 6 chunks, K splits that do not divide)."""
    e, top_k, h, i = 64, 8, 1024, 384
    w13, w2, gen = weights(e, h, i, seed=m)
    x, ids, w = routing(m, e, top_k, gen, dtype, h)
    out = run(x, ids, w, w13, w2, cfg)
    assert rel(out, moe64("nvfp4", x, ids, w, w13, w2)) < BOUND[dtype]


def test_heuristic_takes_the_mma_kernels_for_few_tokens_per_expert():
    facts = device_facts(DEV)
    cfg = moe_plan.checkpoint_layout_moe_plan(4, 8, 128, 768, 2048, "nvfp4", facts)
    assert isinstance(cfg, MmaMoeConfig)
    many = moe_plan.checkpoint_layout_moe_plan(4096, 8, 128, 768, 2048, "nvfp4", facts)
    assert not isinstance(many, MmaMoeConfig)
    mx = moe_plan.checkpoint_layout_moe_plan(4, 8, 128, 768, 2048, "mxfp4", facts)
    assert not isinstance(mx, MmaMoeConfig)


def test_real_sizes_match_the_tl_dot_kernels():
    """Mixtral (8 experts, top 2, 4096 x 14336) and DeepSeek-V3 (256, top 8, 7168 x 2048) expert
    shapes at M = 1 and 16: the mma path against float64 (on 2 experts' worth of tokens)."""
    for e, top_k, h, i, m in ((8, 2, 4096, 14336, 1), (8, 2, 4096, 14336, 16),
                              (32, 8, 7168, 2048, 4)):  # fmt: skip
        w13, w2, gen = weights(e, h, i, seed=h + m)
        x, ids, w = routing(m, e, top_k, gen, torch.bfloat16, h)
        cfg = moe_plan.checkpoint_layout_moe_plan(m, top_k, e, i, h, "nvfp4", device_facts(DEV))
        assert isinstance(cfg, MmaMoeConfig), cfg
        out = run(x, ids, w, w13, w2)
        assert rel(out, moe64("nvfp4", x, ids, w, w13, w2)) < BOUND[torch.bfloat16]


def test_gpt_oss_clamped_swiglu_with_biases():
    """H = I = 2880 (45 chunks: odd), biases on both GEMMs, alpha 1.702 and limit 7."""
    e, top_k, h, i = 32, 4, 2880, 2880
    w13, w2, gen = weights(e, h, i, seed=5)
    b13 = torch.randn(e, 2 * i, generator=gen, device=DEV)
    b2 = torch.randn(e, h, generator=gen, device=DEV)
    for m, cfg in ((1, None), (6, None), (6, CONFIGS[2])):
        x, ids, w = routing(m, e, top_k, gen, torch.bfloat16, h)
        out = run(x, ids, w, w13, w2, cfg, b13, b2, "swiglu_oai", (1.702, 7.0))
        ref = moe64("nvfp4", x, ids, w, w13, w2, b13, b2, "swiglu_oai", (1.702, 7.0))
        assert rel(out, ref) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=lambda c: f"d{int(c.direct)}nt{c.nt}")
def test_expert_parallel_ids_and_one_hot_expert(cfg):
    """Ids another rank holds (-1, >= E) contribute nothing; all tokens on one expert."""
    e, top_k, h, i = 16, 4, 512, 256
    w13, w2, gen = weights(e, h, i, seed=9)
    x, ids, w = routing(12, e, top_k, gen, torch.bfloat16, h)
    ids[0, 0], ids[3, 2], ids[5, 1] = -1, e, e + 7
    keep = (ids >= 0) & (ids < e)
    ref = moe64("nvfp4", x, torch.where(keep, ids, 0), w * keep, w13, w2)
    assert rel(run(x, ids, w, w13, w2, cfg), ref) < BOUND[torch.bfloat16]
    same = torch.full_like(ids, 3)
    assert rel(run(x, same, w, w13, w2, cfg), moe64("nvfp4", x, same, w, w13, w2)) < 1.5e-2


def test_poisoned_buffers_and_misaligned_activations(monkeypatch):
    e, top_k, h, i = 16, 4, 512, 256
    w13, w2, gen = weights(e, h, i, seed=10)
    x, ids, w = routing(9, e, top_k, gen, torch.bfloat16, h)
    want = run(x, ids, w, w13, w2, CONFIGS[1])

    def poisoned(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if dtype.is_floating_point else t.fill_(-7)

    monkeypatch.setattr(checks, "empty", poisoned)
    assert torch.equal(run(x, ids, w, w13, w2, CONFIGS[1]), want)
    monkeypatch.undo()
    big = torch.zeros(9, h + 3, dtype=x.dtype, device=DEV)
    big[:, 3:] = x
    assert torch.equal(run(big[:, 3:], ids, w, w13, w2, CONFIGS[1]), want)


def test_unaligned_weights_fall_back_and_a_forced_config_says_why():
    e, top_k, h, i = 8, 2, 512, 256
    w13, w2, gen = weights(e, h, i, seed=11)
    x, ids, w = routing(2, e, top_k, gen, torch.bfloat16, h)
    want = run(x, ids, w, w13, w2)
    wide = torch.zeros(e, 2 * i, h // 2 + 8, dtype=torch.uint8, device=DEV)
    wide[:, :, 8:] = w13[0]
    shifted = [wide[:, :, 8:], w13[1], w13[2]]  # rows 8-byte aligned only: tl.dot kernels
    out = run(x, ids, w, shifted, w2)
    assert rel(out, moe64("nvfp4", x, ids, w, w13, w2)) < BOUND[torch.bfloat16]
    assert rel(out, want.double()) < 1e-2
    with pytest.raises(InputError, match="mma kernels need"):
        run(x, ids, w, shifted, w2, CONFIGS[0])


def test_cuda_graph_replay_equals_eager():
    e, top_k, h, i = 64, 8, 1024, 384
    w13, w2, gen = weights(e, h, i, seed=12)
    for m in (1, 16):
        x, ids, w = routing(m, e, top_k, gen, torch.bfloat16, h)
        run(x, ids, w, w13, w2)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = run(x, ids, w, w13, w2)
        x2, ids2, w2_ = routing(m, e, top_k, gen, torch.bfloat16, h)
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2_)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(x2, ids2, w2_, w13, w2))

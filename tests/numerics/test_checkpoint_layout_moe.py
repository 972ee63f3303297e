"""The Triton fused MoE (quantdispatch.kernels.checkpoint_layout.moe) on the CPU interpreter, small
shapes.

Expected values come from the float64 oracle of test_moe.py (ref64 bit decoders, activations
written out, a per-token loop over the top-k experts). Every buffer the kernel allocates is
poisoned first (NaN for floats, 0 for the int32 routing buffers: an unwritten pad or block
entry would send pair 0 through the wrong expert), so an element the kernels do not write or
an alignment bug fails the test.

Bounds, ||out - ref|| / ||ref||: fp32 accumulation on exactly decoded weights, then three
roundings to the activation dtype (the intermediate after the activation, each per-slot
output row, the final sum), each <= u relative per element. The interpreter truncates fp32 to
bf16 instead of rounding (error up to 2u, biased), so bf16 (u = 2^-8) gets 3e-2 and fp16
(u = 2^-11, rounded correctly) 2e-3: 2.5-4x the measured errors (1.2e-2, 5e-4), far below
a wrong expert, slot, scale or activation (order 1).
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from ref64 import rel_err  # noqa: E402
from test_moe import make_experts, moe64, rand_x  # noqa: E402

from quantdispatch.backends.base import CheckpointMeta, Layout, encode_meta  # noqa: E402
from quantdispatch.errors import InputError, WeightFormatError  # noqa: E402
from quantdispatch.kernels.checkpoint_layout import moe_plan  # noqa: E402
from quantdispatch.kernels.checkpoint_layout.dequant import dequant_experts  # noqa: E402
from quantdispatch.kernels.checkpoint_layout.moe import fused_moe  # noqa: E402
from quantdispatch.kernels.checkpoint_layout.moe_plan import MoeConfig, MoeGemmConfig  # noqa: E402
from quantdispatch.kernels.checkpoint_layout.moe_stacks import unpack_stack  # noqa: E402
from quantdispatch.kernels.common import checks  # noqa: E402
from quantdispatch.kernels.common.device_facts import DeviceFacts  # noqa: E402
from quantdispatch.kernels.common.moe_activations import activation_args  # noqa: E402
from quantdispatch.kernels.common.moe_align import max_blocks_for, moe_align  # noqa: E402
from quantdispatch.kernels.common.moe_dequant import DequantExperts  # noqa: E402
from quantdispatch.kernels.common.moe_plan import (  # noqa: E402
    DequantMoeConfig,
    MmaGemmConfig,
    MmaMoeConfig,
)
from quantdispatch.kernels.common.moe_stages import ExpertWeights, MoeInputs, run_stages  # noqa: E402
from quantdispatch.layers import QuantMoE  # noqa: E402

if not checks.interpreting():
    pytest.skip(
        "the Triton kernels were compiled for a GPU in this process; run tests/numerics in "
        "its own pytest process (the GPU MoE tests are tests/gpu/test_moe_gpu.py)",
        allow_module_level=True,
    )

BOUND = {torch.bfloat16: 3e-2, torch.float16: 2e-3}
CPU = DeviceFacts.for_capability(None)
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    def empty(shape, dtype, device):
        if dtype.is_floating_point:
            return torch.full(shape, math.nan, dtype=dtype, device=device)
        return torch.zeros(shape, dtype=dtype, device=device)

    monkeypatch.setattr(checks, "empty", empty)


def stacked(ex, **kw):
    """The canonical stacked tensors of these experts (via the reference-backend layer)."""
    layer = QuantMoE(ex.gate or None, ex.up, ex.down, top_k=1, device="cpu", **kw)
    w13 = [getattr(layer, n) for n in layer._names13]
    w2 = [getattr(layer, n) for n in layer._names2]
    return w13, w2, layer._meta.block_size


def run(ex, x, ids, w, activation="silu", params=(), b13=None, b2=None, config=None, **kw):
    w13, w2, block = stacked(ex, activation=activation, **kw)
    return fused_moe(
        x,
        ids,
        w,
        w13,
        w2,
        b13,
        b2,
        fmt=ex.fmt,
        activation=activation,
        params=list(params),
        block_size=block,
        config=config,
    )


def routing(m, e, k, seed, *, choices=None):
    """Distinct experts per token (from ``choices`` if given) and positive weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(choices if choices is not None else range(e))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(m)])
    return ids.to(torch.int32), torch.rand(m, k, generator=g) + 0.1


# ---- alignment ---------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "k", "e", "bm"), [(5, 2, 6, 4), (3, 4, 4, 16), (60, 4, 256, 16)])
def test_align_groups_pairs_by_expert(m, k, e, bm):
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(-1, e + 1, (m, k), generator=g)  # includes -1 and E: no slot
    sorted_ids, block_expert, num_blocks = moe_align(ids, e, bm)
    flat = ids.flatten()
    counts = torch.bincount(flat[(flat >= 0) & (flat < e)], minlength=e)
    padded = (counts + bm - 1) // bm * bm
    assert int(num_blocks) == int(padded.sum()) // bm
    seen = []
    for b in range(int(num_blocks)):
        ex = int(block_expert[b])
        rows = sorted_ids[b * bm : (b + 1) * bm]
        for r in rows.tolist():
            if r == m * k:
                continue  # pad
            assert int(flat[r]) == ex
            seen.append(r)
    valid = [i for i in range(m * k) if 0 <= int(flat[i]) < e]
    assert sorted(seen) == valid  # every valid pair exactly once, nothing else
    assert sorted_ids.numel() == max_blocks_for(m * k, e, bm) * bm


# ---- numerics -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_random_routing_unused_experts_and_foreign_ids(dtype):
    """M = 7 (not a block multiple); experts 1 and 4 get no token; ids -1 and E (experts on
    other ranks) contribute nothing."""
    ex = make_experts("nvfp4", 6, 64, 32, seed=1)
    ids, w = routing(7, 6, 2, seed=2, choices=[0, 2, 3, 5])
    ids[0, 1] = -1
    ids[3, 0] = 6
    x = rand_x(7, 64, dtype, seed=3)
    out = run(ex, x, ids, w)
    assert out.dtype == dtype
    assert rel_err(out, moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[dtype]
    assert torch.equal(out, run(ex, x, ids, w))  # deterministic


def test_all_tokens_on_one_expert_and_top_k_equal_to_experts():
    ex = make_experts("nvfp4", 4, 64, 32, seed=4)
    x = rand_x(20, 64, torch.float16, seed=5)
    ids = torch.full((20, 1), 2, dtype=torch.int64)  # 20 pairs: two 16-row blocks of expert 2
    w = torch.rand(20, 1) + 0.5
    assert rel_err(run(ex, x, ids, w), moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[torch.float16]
    ids, w = routing(3, 4, 4, seed=6)  # top_k == E
    x3 = x[:3]
    assert rel_err(run(ex, x3, ids, w), moe64(x3, ids, w, ex.w13, ex.w2)) < BOUND[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_token_direct_path(dtype):
    ex = make_experts("nvfp4", 8, 64, 32, seed=7)
    ids, w = routing(1, 8, 2, seed=8)
    assert moe_plan.checkpoint_layout_moe_plan(1, 2, 8, 32, 64, "nvfp4", CPU).direct
    x = rand_x(1, 64, dtype, seed=9)
    assert rel_err(run(ex, x, ids, w), moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[dtype]


def test_direct_path_several_tokens_with_foreign_ids():
    """Direct path (4 * pairs <= E, no alignment): ids -1 / E skipped, and a token whose slots
    are all foreign gets exactly zero."""
    ex = make_experts("nvfp4", 24, 64, 32, seed=30)
    ids, w = routing(3, 24, 2, seed=31)
    ids[0, 0] = -1
    ids[2] = torch.tensor([24, -1])
    assert moe_plan.checkpoint_layout_moe_plan(3, 2, 24, 32, 64, "nvfp4", CPU).direct
    x = rand_x(3, 64, torch.float16, seed=32)
    out = run(ex, x, ids, w)
    assert rel_err(out[:2], moe64(x, ids, w, ex.w13, ex.w2)[:2]) < BOUND[torch.float16]
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("bm", [32, 64])
def test_large_m_tiles_with_ragged_k_and_n(bm):
    """Block rows 32/64; H = 96 and I = 48 are not multiples of the K (64) and N (32, 64) tiles."""
    ex = make_experts("nvfp4", 3, 96, 48, seed=10)
    ids, w = routing(41, 3, 2, seed=11)
    x = rand_x(41, 96, torch.bfloat16, seed=12)
    cfg = MoeConfig(bm, MoeGemmConfig(32, 64), MoeGemmConfig(64, 64))
    out = run(ex, x, ids, w, config=cfg)
    assert rel_err(out, moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[torch.bfloat16]


def test_mxfp4_biases_and_swiglu_oai():
    ex = make_experts("mxfp4", 4, 64, 64, seed=13)
    g = torch.Generator().manual_seed(14)
    b13 = torch.randn(4, 128, generator=g)
    b2 = torch.randn(4, 64, generator=g)
    ids, w = routing(6, 4, 2, seed=15)
    x = rand_x(6, 64, torch.bfloat16, seed=16)
    params = (1.5, 1.0)
    out = run(ex, x, ids, w, "swiglu_oai", params, b13, b2)
    ref = moe64(x, ids, w, ex.w13, ex.w2, b13, b2, "swiglu_oai", params)
    assert rel_err(out, ref) < BOUND[torch.bfloat16]


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("tensor", torch.float16), ("channel", torch.bfloat16), ("block", torch.float16)],
)
def test_fp8_scale_layouts(kind, dtype):
    ex = make_experts("fp8", 3, 64, 64, seed=17, fp8_kind=kind)
    ids, w = routing(5, 3, 2, seed=18)
    x = rand_x(5, 64, dtype, seed=19)
    out = run(ex, x, ids, w)
    assert rel_err(out, moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[dtype]


@pytest.mark.parametrize("activation", ["gelu", "relu2", "silu_nogate"])
def test_other_activations(activation):
    ex = make_experts("nvfp4", 3, 64, 32, seed=20, gated=activation == "gelu")
    ids, w = routing(4, 3, 2, seed=21)
    x = rand_x(4, 64, torch.float16, seed=22)
    out = run(ex, x, ids, w, activation)
    ref = moe64(x, ids, w, ex.w13, ex.w2, activation=activation)
    assert rel_err(out, ref) < BOUND[torch.float16]


def test_triton_backend_behind_the_custom_op():
    """torch.ops.quantdispatch.moe with backend 'triton' is this kernel; 'reference' agrees."""
    ex = make_experts("nvfp4", 4, 64, 32, seed=23)
    w13, w2, _ = stacked(ex)
    meta = encode_meta(Layout.CHECKPOINT, CheckpointMeta())
    ids, w = routing(5, 4, 2, seed=24)
    x = rand_x(5, 64, torch.bfloat16, seed=25)
    args = (x, ids, w, w13, w2, None, None)
    tri = torch.ops.quantdispatch.moe(*args, "triton", "nvfp4", "silu", [], meta)
    ref = torch.ops.quantdispatch.moe(*args, "reference", "nvfp4", "silu", [], meta)
    assert torch.equal(tri, run(ex, x, ids, w))
    assert rel_err(tri, ref.double()) < BOUND[torch.bfloat16]


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_inputs():
    ex = make_experts("nvfp4", 2, 64, 32, seed=26)
    w13, w2, block = stacked(ex)
    x = rand_x(3, 64, torch.bfloat16, seed=27)
    ids, w = routing(3, 2, 1, seed=28)
    kw = dict(fmt="nvfp4", activation="silu", params=[], block_size=block)
    with pytest.raises(InputError, match="x is float16/bfloat16"):
        fused_moe(x.float(), ids, w, w13, w2, None, None, **kw)
    with pytest.raises(InputError, match="topk_weights are float32"):
        fused_moe(x, ids, w.half(), w13, w2, None, None, **kw)
    with pytest.raises(InputError, match=r"topk_ids are int32/int64 \[M=3"):
        fused_moe(x, ids[:2], w, w13, w2, None, None, **kw)
    with pytest.raises(WeightFormatError, match="w13 is"):
        fused_moe(rand_x(3, 32, torch.bfloat16, 0), ids, w, w13, w2, None, None, **kw)
    with pytest.raises(WeightFormatError, match=r"and w2 \[E=1"):
        fused_moe(x, ids, w, w13, [t[:1] for t in w2], None, None, **kw)
    with pytest.raises(WeightFormatError, match="global scale"):
        fused_moe(x, ids, w, [*w13[:2], w13[2][:1]], w2, None, None, **kw)
    with pytest.raises(WeightFormatError, match="expert biases are float32"):
        fused_moe(x, ids, w, w13, w2, torch.zeros(2, 63), None, **kw)


# ---- many tokens per expert: dequantize + torch._grouped_mm -----------------------------------


def run_dequant(ex, x, ids, w, activation="silu", params=(0.0, 0.0), b13=None, b2=None, **kw):
    """The dequantize path called directly (the heuristic only takes it on SM 9.0+ GPUs)."""
    w13, w2, block = stacked(ex, activation=activation, **kw)
    s13, s2 = unpack_stack(ex.fmt, w13, "w13", block), unpack_stack(ex.fmt, w2, "w2", block)
    out = torch.empty(x.shape, dtype=x.dtype)
    weights = ExpertWeights(
        lambda dt: dequant_experts(ex.fmt, *s13[:3], dt),
        lambda dt: dequant_experts(ex.fmt, *s2[:3], dt),
        b13,
        b2,
    )
    inp = MoeInputs(x, ids, w, s13.e, activation_args(activation, params))
    run_stages(DequantExperts(weights), inp, out)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_grouped_mm_path_with_foreign_ids_and_idle_experts(dtype):
    """Experts 1 and 4 get no token, ids -1 and E contribute nothing, M = 37."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    ex = make_experts("nvfp4", 6, 64, 32, seed=40)
    ids, w = routing(37, 6, 2, seed=41, choices=[0, 2, 3, 5])
    ids[0, 1], ids[9, 0] = -1, 6
    x = rand_x(37, 64, dtype, seed=42)
    out = run_dequant(ex, x, ids, w)
    assert rel_err(out, moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[dtype]


def test_dequant_grouped_mm_path_mxfp4_biases_swiglu_and_relu2():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    ex = make_experts("mxfp4", 4, 64, 64, seed=43)
    g = torch.Generator().manual_seed(44)
    b13, b2 = torch.randn(4, 128, generator=g), torch.randn(4, 64, generator=g)
    ids, w = routing(9, 4, 2, seed=45)
    x = rand_x(9, 64, torch.bfloat16, seed=46)
    out = run_dequant(ex, x, ids, w, "swiglu_oai", (1.5, 1.0), b13, b2)
    ref = moe64(x, ids, w, ex.w13, ex.w2, b13, b2, "swiglu_oai", (1.5, 1.0))
    assert rel_err(out, ref) < BOUND[torch.bfloat16]
    ex = make_experts("nvfp4", 3, 64, 32, seed=47, gated=False)
    out = run_dequant(ex, x, ids % 3, w, "relu2")
    assert rel_err(out, moe64(x, ids % 3, w, ex.w13, ex.w2, activation="relu2")) < 3e-2


def test_forced_mma_config_off_an_sm80_gpu_says_why():
    ex = make_experts("nvfp4", 2, 64, 64, seed=51)
    ids, w = routing(3, 2, 1, seed=52)
    cfg = MmaMoeConfig(1, MmaGemmConfig(), MmaGemmConfig(), direct=True)
    with pytest.raises(InputError, match=r"mma kernels need NVFP4, a gated activation, SM 8\.0"):
        run(ex, rand_x(3, 64, torch.bfloat16, 53), ids, w, config=cfg)


def test_dequant_path_is_gpu_only_and_named_in_errors():
    ex = make_experts("nvfp4", 2, 64, 32, seed=48)
    ids, w = routing(3, 2, 1, seed=49)
    cfg = moe_plan.checkpoint_layout_moe_plan(8192, 2, 8, 14336, 4096, "nvfp4", CPU)
    assert not isinstance(cfg, DequantMoeConfig)
    with pytest.raises(InputError, match="grouped-GEMM config"):
        run(ex, rand_x(3, 64, torch.bfloat16, 50), ids, w, config=DequantMoeConfig())

"""NVFP4 MoE on repacked (mma16x64) experts: kernels/mma_layout/moe_gemm.py on the CPU interpreter.

The grouped GEMM (the mid regime) runs here: its decode has an interpreter twin of the PTX
(Triton integer ops, products in fp32), so the layout, the expert-sorted blocks, the fused
activation, the intermediate written in the MMA K order, the routing weights and the slot sum
are checked against the float64 oracle of test_moe.py. The mma.sync and dequantize regimes are
PTX / grouped_mm and run in tests/gpu/test_moe_gpu.py. Buffers the call allocates are poisoned
(NaN / 0) by test_checkpoint_layout_moe.py's autouse fixture. Bounds as there (three roundings to
the activation dtype; the interpreter truncates to bf16).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (optional extra)")

from ref64 import rel_err  # noqa: E402
from test_checkpoint_layout_moe import poisoned, routing, stacked  # noqa: E402, F401 (autouse fixture)
from test_moe import make_experts, moe64, rand_x  # noqa: E402

from quantdispatch.backends import get_backend  # noqa: E402
from quantdispatch.backends.base import (  # noqa: E402
    CheckpointMeta,
    ExpertStacks,
    Layout,
    Mma16x64Meta,
    encode_meta,
)
from quantdispatch.errors import InputError, WeightFormatError  # noqa: E402
from quantdispatch.kernels.common import checks  # noqa: E402
from quantdispatch.kernels.common.device_facts import DeviceFacts, device_facts  # noqa: E402
from quantdispatch.kernels.common.moe_plan import (  # noqa: E402
    DequantMoeConfig,
    MmaMoeConfig,
    mma_moe_config,
)
from quantdispatch.kernels.mma_layout import moe_gemm, moe_plan  # noqa: E402
from quantdispatch.kernels.mma_layout.moe_gemm import mma_layout_moe  # noqa: E402
from quantdispatch.kernels.mma_layout.moe_plan import (  # noqa: E402
    MoeGemmTile,
    SmallMoeConfig,
    mma_layout_moe_plan,
    moe_layout_supported,
    small_moe_config,
)
from quantdispatch.kernels.mma_layout.moe_stacks import (  # noqa: E402
    repack_experts,
    repack_experts_mx,
    unpack_experts,
)
from quantdispatch.request import Request  # noqa: E402

if not checks.interpreting():
    pytest.skip(
        "the Triton kernels were compiled for a GPU in this process; run tests/numerics in "
        "its own pytest process (the GPU tests are tests/gpu/test_moe_gpu.py)",
        allow_module_level=True,
    )

BOUND = {torch.bfloat16: 3e-2, torch.float16: 2e-3}
DTYPES = [torch.bfloat16, torch.float16]
CPU = DeviceFacts.for_capability(None)


def repacked(ex, dtype, zero_blocks=False):
    """(w13, w2) stacks in the mma16x64 layout, plus the float64 weights they hold (MXFP4
    experts: :func:`repack_experts_mx`, a global scale per expert)."""
    w13, w2, _ = stacked(ex)
    if ex.fmt == "mxfp4":
        mx13, mx2 = repack_experts_mx(w13[0], w13[1], dtype), repack_experts_mx(*w2, dtype)
        return [*mx13], [*mx2], ex.w13, ex.w2
    w13_64, w2_64 = ex.w13.clone(), ex.w2.clone()
    if zero_blocks:  # a zero block scale zeroes its 16 weights (the repack drops their codes)
        scales = w13[1].clone()
        scales.view(torch.uint8)[1, 3, ::2] = 0
        w13 = [w13[0], scales, w13[2]]
        for blk in range(0, scales.shape[2], 2):
            w13_64[1, 3, 16 * blk : 16 * blk + 16] = 0
    r13 = [*repack_experts(w13[0], w13[1], dtype), w13[2]]
    r2 = [*repack_experts(w2[0], w2[1], dtype), w2[2]]
    return r13, r2, w13_64, w2_64


def run(r13, r2, x, ids, w, config, activation="silu", params=(), b13=None, b2=None,
        packed_for=None, facts=None):  # fmt: skip
    return mma_layout_moe(
        x, ids, w, r13, r2, b13, b2, activation=activation, params=list(params),
        packed_for=packed_for or x.dtype, config=config, facts=facts,
    )  # fmt: skip


# ---- layout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_repack_experts_round_trip(dtype):
    ex = make_experts("nvfp4", 3, 128, 64, seed=1)
    w13, _, _ = stacked(ex)
    words, scales = repack_experts(w13[0], w13[1], dtype)
    assert words.shape == (3, 8, 2, 32, 4) and words.dtype == torch.int32
    assert scales.shape == (3, 8, 2, 32, 2) and scales.dtype == torch.uint8
    assert words.numel() * 4 + scales.numel() == w13[0].numel() + w13[1].numel()  # same bytes
    packed, codes = unpack_experts(words, scales, dtype)
    assert torch.equal(packed, w13[0])
    assert torch.equal(codes, w13[1].view(torch.uint8))


# ---- the grouped GEMM against float64 ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m", [16, 32])
def test_grouped_gemm_random_routing(dtype, block_m):
    """M = 9 (not a block multiple), experts 1 and 4 get no token, ids -1 and E contribute
    nothing; H = 192 is 3 chunks (not a multiple of the 2-chunk K step), I = 64 one chunk;
    subnormal, 448 and zero block scales."""
    ex = make_experts("nvfp4", 6, 192, 64, seed=2)
    r13, r2, w13, w2 = repacked(ex, dtype, zero_blocks=True)
    ids, w = routing(9, 6, 2, seed=3, choices=[0, 2, 3, 5])
    ids[0, 1] = -1
    ids[4, 0] = 6
    x = rand_x(9, 192, dtype, seed=4)
    out = run(r13, r2, x, ids, w, MoeGemmTile(block_m))
    assert out.dtype == dtype
    assert rel_err(out, moe64(x, ids, w, w13, w2)) < BOUND[dtype]
    assert torch.equal(out, run(r13, r2, x, ids, w, MoeGemmTile(block_m)))  # deterministic


def test_all_tokens_on_one_expert_and_top_k_equal_to_experts():
    """40 pairs on expert 2: three 16-pair blocks of one expert (the last partly padded)."""
    ex = make_experts("nvfp4", 4, 128, 64, seed=5)
    r13, r2, w13, w2 = repacked(ex, torch.float16)
    x = rand_x(40, 128, torch.float16, seed=6)
    ids = torch.full((40, 1), 2, dtype=torch.int64)
    w = torch.rand(40, 1) + 0.5
    out = run(r13, r2, x, ids, w, MoeGemmTile(16))
    assert rel_err(out, moe64(x, ids, w, w13, w2)) < BOUND[torch.float16]
    ids, w = routing(3, 4, 4, seed=7)  # top_k == E
    out = run(r13, r2, x[:3], ids, w, MoeGemmTile(16))
    assert rel_err(out, moe64(x[:3], ids, w, w13, w2)) < BOUND[torch.float16]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_wide_tiles_biases_and_swiglu_oai(fmt):
    """BLOCK_N 128 where it divides (I = H = 128), biases and gpt-oss's clamped SwiGLU."""
    ex = make_experts(fmt, 3, 128, 128, seed=8)
    r13, r2, w13, w2 = repacked(ex, torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    b13, b2 = torch.randn(3, 256, generator=g), torch.randn(3, 128, generator=g)
    ids, w = routing(5, 3, 2, seed=10)
    x = rand_x(5, 128, torch.bfloat16, seed=11)
    params = (1.702, 7.0)
    cfg = MoeGemmTile(16, block_n=128, warps=8, stages=3)
    out = run(r13, r2, x, ids, w, cfg, "swiglu_oai", params, b13, b2)
    ref = moe64(x, ids, w, w13, w2, b13, b2, "swiglu_oai", params)
    assert rel_err(out, ref) < BOUND[torch.bfloat16]


def test_block_n_falls_back_to_64_where_128_does_not_divide():
    ex = make_experts("nvfp4", 2, 128, 192, seed=12)  # I = 192: gate_up tiles of 64
    r13, r2, w13, w2 = repacked(ex, torch.float16)
    ids, w = routing(4, 2, 1, seed=13)
    x = rand_x(4, 128, torch.float16, seed=14)
    out = run(r13, r2, x, ids, w, MoeGemmTile(16, block_n=128, warps=8, stages=3))
    assert rel_err(out, moe64(x, ids, w, w13, w2)) < BOUND[torch.float16]


def test_triton_backend_runs_repacked_stacks_behind_the_custom_op():
    """The mma16x64 layout's meta sends torch.ops.quantdispatch.moe to this path (9 pairs per
    expert here: the grouped GEMM, which the interpreter runs); an empty batch is [0, H]."""
    ex = make_experts("nvfp4", 2, 128, 64, seed=19)
    r13, r2, w13, w2 = repacked(ex, torch.bfloat16)
    ids, w = routing(9, 2, 2, seed=20)
    x = rand_x(9, 128, torch.bfloat16, seed=21)
    meta = encode_meta(Layout.MMA16X64, Mma16x64Meta(torch.bfloat16))
    out = torch.ops.quantdispatch.moe(x, ids, w, r13, r2, None, None, "triton", "nvfp4", "silu",
                                      [], meta)  # fmt: skip
    assert torch.equal(out, run(r13, r2, x, ids, w, None))
    assert rel_err(out, moe64(x, ids, w, w13, w2)) < BOUND[torch.bfloat16]
    empty = run(r13, r2, x[:0], ids[:0], w[:0], None)
    assert empty.shape == (0, 128) and empty.dtype == torch.bfloat16


# ---- regime choice ------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "sorted"])
def test_mma_path_sizes_its_buffers_by_the_layers_sizes(monkeypatch, direct):
    """The mma.sync kernels are PTX (GPU only), so what the host side hands them is checked here:
    the intermediate is [pairs or padded pairs, I] and the per-pair output [pairs, H] for both
    layouts. (A session read I off w13's shape, which the repacked words do not carry.)"""
    from quantdispatch.kernels.common.moe_activations import activation_args
    from quantdispatch.kernels.common.moe_mma import MmaExperts
    from quantdispatch.kernels.common.moe_stages import ExpertWeights, MoeInputs, run_stages

    seen = {}

    def fake_apply(self, inp, work):
        seen["a"], seen["y"] = tuple(work.a.shape), tuple(work.y.shape)
        work.y.zero_()

    monkeypatch.setattr(MmaExperts, "apply", fake_apply)
    e, hidden, inter, m, top_k = 4, 128, 192, 5, 2
    ex = make_experts("nvfp4", e, hidden, inter, seed=3)
    w13, w2, _ = stacked(ex)
    r13, r2, _, _ = repacked(ex, torch.bfloat16)
    ids, tw = routing(m, e, top_k, seed=1)
    cfg = mma_moe_config(m * top_k, e, inter, hidden, direct=direct)
    for a13, a2 in ((tuple(w13), tuple(w2)), (tuple(r13), tuple(r2))):
        out = torch.empty(m, hidden, dtype=torch.bfloat16)
        x = rand_x(m, hidden, torch.bfloat16, seed=2)
        inp = MoeInputs(x, ids, tw, e, activation_args("silu"))
        run_stages(MmaExperts(ExpertWeights(a13, a2, None, None), cfg, inter), inp, out)
        assert seen["a"][1] == inter and seen["y"] == (m * top_k, hidden)
        if direct:
            assert seen["a"][0] == m * top_k
        else:
            assert seen["a"][0] >= m * top_k and seen["a"][0] % cfg.block_m == 0


def test_small_moe_launches_one_program_per_unit(monkeypatch):
    """The top-k-sum kernels are PTX (GPU only): what the host side launches is checked here.
    Gate/up: one program per (pair, 16-row I tile); down: one per (token, 16-row H tile), each
    with its own warps; the scratch intermediate is [pairs, I]."""
    import quantdispatch.kernels.mma_layout.moe_pairs as small

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            def run(**kw):
                launches.append((grid, kw))
                if not kw["GATE_UP"]:
                    kw["out_ptr"].zero_()

            return run

    monkeypatch.setattr(small, "_small_moe_kernel", FakeKernel())
    e, hidden, inter, m, top_k = 4, 128, 192, 3, 2
    r13, r2, _, _ = repacked(make_experts("nvfp4", e, hidden, inter, seed=3), torch.bfloat16)
    ids, tw = routing(m, e, top_k, seed=1)
    x = rand_x(m, hidden + 1, torch.bfloat16, seed=2)[:, 1:]  # rows 2 bytes off 16-byte alignment
    out = torch.empty(m, hidden, dtype=torch.bfloat16)
    cfg = SmallMoeConfig(2, 1, 8, 2)
    layer = small.SmallMoe(tuple(r13), tuple(r2), None, None, 0, 0.0, 0.0, inter, top_k)
    layer(x, ids, tw, cfg, out)
    (g1, k1), (g2, k2) = launches
    assert g1 == (m * top_k * inter // 16,) and (k1["W"], k1["num_warps"], k1["U"]) == (2, 2, 1)
    assert g2 == (m * hidden // 16,) and (k2["W"], k2["num_warps"], k2["U"]) == (8, 8, 2)
    assert (k1["CH1"], k1["TILES1"], k1["CH2"], k1["TILES2"]) == (2, 12, 3, 8)
    assert tuple(k1["a_ptr"].shape) == (m * top_k, inter) and k1["a_ptr"] is k2["a_ptr"]
    assert k1["stride_am"] == inter and k1["TOP_K"] == top_k
    xk = k1["x_ptr"]  # re-aligned for the kernel's 16-byte loads, same values
    assert xk.data_ptr() % 16 == 0 and xk.stride(0) % 8 == 0 and torch.equal(xk, x)
    assert not k1["PDL"] and not k2["PDL"] and "launch_pdl" not in k2 and k2["PF"] == 0
    launches.clear()  # a programmatic dependent down launch; prefetch capped at I's 3 chunks
    cfg = SmallMoeConfig(2, 1, 8, 2, pdl=True, prefetch=5)
    layer = small.SmallMoe(tuple(r13), tuple(r2), None, None, 0, 0.0, 0.0, inter, top_k)
    layer(x, ids, tw, cfg, out)
    (_, k1), (_, k2) = launches
    assert k1["PDL"] and "launch_pdl" not in k1 and k1["PF"] == 0  # gate/up: the trigger only
    assert k2["PDL"] and k2["launch_pdl"] is True and k2["PF"] == 3


def test_regimes_from_tokens_per_expert():
    # single pairs (4 x pairs <= E): gate/up 8 warps x 1 chunk on grids of <= 1024 programs,
    # else as the per-pair mma kernels were tuned; down programs (one per token and 16-row output
    # tile) widened until the grid has 3072 warps
    cfg = mma_layout_moe_plan(1, 8, 128, 768, 2048, CPU)  # 8 pairs x 48 tiles, 128 down tiles
    assert cfg == SmallMoeConfig(8, 1, 16, 2)
    cfg = mma_layout_moe_plan(4, 8, 128, 768, 2048, CPU)  # 32 pairs: 1536 gate/up programs
    assert cfg == SmallMoeConfig(1, 2, 8, 2)
    for m, k, e, i, h, want in [(1, 2, 8, 14336, 4096, None), (1, 8, 256, 2048, 7168, (8, 1, 8)),
                                (8, 8, 256, 2048, 7168, None)]:  # fmt: skip
        gate_up = mma_moe_config(m * k, e, i, h, direct=True, repacked=True).gemm1
        got = mma_layout_moe_plan(m, k, e, i, h, CPU)
        if want is None:  # big grids: the per-pair tuning; Mixtral 16 down warps, DeepSeek 4
            want = (gate_up.wk, gate_up.unroll, 16 if e == 8 else 4)
        assert got == SmallMoeConfig(*want, 2)
    assert small_moe_config(1, 1, 64, 64 * 16, 4, 2) == SmallMoeConfig(8, 1, 16, 2)  # cap at 16
    # a programmatic dependent down launch (SM 9.0+); its programs prefetch the first eighth of
    # their weights into L2 where I has 40+ chunks, at most PREFETCH_MAX_BYTES (576 B a chunk)
    # with it, gate/up keeps 8 x 1 on small grids only where K has 64+ chunks (DeepSeek-V3);
    # Qwen3 (32 chunks) and gpt-oss (45) keep the per-pair tuning they are given
    qwen3 = small_moe_config(1, 8, 768, 2048, 4, 2, pdl=True)
    assert qwen3 == SmallMoeConfig(4, 2, 16, 2, True, 0) and "pdl pf0" in qwen3.label()

    def gate_up(cfg: SmallMoeConfig) -> tuple[int, int]:
        return cfg.warps, cfg.unroll

    assert gate_up(small_moe_config(2, 8, 768, 2048, 4, 2, pdl=True)) == (4, 2)
    assert gate_up(small_moe_config(1, 8, 2048, 7168, 4, 2, pdl=True)) == (8, 1)  # DeepSeek-V3
    assert gate_up(small_moe_config(1, 4, 2880, 2880, 4, 2, pdl=True)) == (4, 2)  # gpt-oss
    assert gate_up(small_moe_config(1, 4, 2880, 2880, 4, 2)) == (8, 1)  # no PDL: as before
    assert small_moe_config(1, 8, 2048, 7168, 4, 2, pdl=True).prefetch == 0  # DeepSeek-V3
    assert small_moe_config(1, 2, 14336, 4096, 4, 2, pdl=True).prefetch == 28  # Mixtral: 224/8
    assert small_moe_config(1, 4, 2880, 2880, 4, 2, pdl=True).prefetch == 5  # gpt-oss: 45/8
    assert small_moe_config(16, 2, 14336, 4096, 4, 2, pdl=True).prefetch == 3  # 16 MB cap
    assert small_moe_config(1, 2, 14336, 4096, 4, 2).prefetch == 0  # no PDL, no prefetch
    assert not mma_layout_moe_plan(1, 8, 128, 768, 2048, CPU).pdl  # not on the CPU
    cfg = mma_layout_moe_plan(64, 8, 128, 768, 2048, CPU)  # 4 per expert
    assert isinstance(cfg, MmaMoeConfig) and not cfg.direct
    assert mma_layout_moe_plan(128, 8, 128, 768, 2048, CPU).block_m == 16  # 8 per expert
    assert mma_layout_moe_plan(256, 8, 128, 768, 2048, CPU).block_m == 32  # 16
    assert mma_layout_moe_plan(512, 8, 128, 768, 2048, CPU).block_m == 64  # 32
    assert mma_layout_moe_plan(1536, 8, 128, 768, 2048, CPU).block_m == 64  # 96
    assert mma_layout_moe_plan(2048, 8, 128, 768, 2048, CPU).block_m == 128  # 128 (settled sweep)
    wide = mma_layout_moe_plan(4096, 8, 128, 768, 2048, CPU)  # 256
    assert (wide.block_m, wide.block_n, wide.warps) == (128, 128, 8)
    # very many per expert: dequantize + grouped_mm only where grouped_mm runs (not on CPU)
    assert isinstance(mma_layout_moe_plan(4096, 2, 8, 14336, 4096, CPU), MoeGemmTile)


def test_eight_pair_blocks_split_k_only_evenly():
    """Repacked 8-pair blocks keep a K split only where its step (WK x UNROLL chunks) divides
    the chunks: gpt-oss (45 chunks) runs unsplit; Qwen3 / Mixtral / DeepSeek-V3 keep theirs."""
    oss = mma_moe_config(64, 128, 2880, 2880, direct=False, repacked=True)  # 120b M=16
    assert (oss.gemm1.wk, oss.gemm1.unroll, oss.gemm2.wk, oss.gemm2.unroll) == (1, 2, 1, 2)
    for pairs, e, i, h in [(128, 128, 768, 2048), (8, 8, 14336, 4096), (128, 256, 2048, 7168)]:
        repacked = mma_moe_config(pairs, e, i, h, direct=False, repacked=True)
        assert repacked == mma_moe_config(pairs, e, i, h, direct=False)
        assert repacked.gemm1.wk > 1
    # the checkpoint-layout kernels (not measured on 45 chunks) keep the split
    assert mma_moe_config(64, 128, 2880, 2880, direct=False).gemm1.wk == 2


def test_few_program_blocks_split_k_four_ways():
    """Repacked 8-pair blocks whose GEMM has few programs (the experts uniform routing touches x
    row tiles <= FEW_PROGRAMS) and 40+ chunks of K take a 4-way split, one chunk in flight:
    gpt-oss-20b (32 experts) at every 8-pair M; gpt-oss-120b only while its blocks are few."""
    from quantdispatch.kernels.common.moe_plan import FEW_PROGRAMS, expected_experts

    assert expected_experts(1, 32) == pytest.approx(1.0)
    assert expected_experts(32, 32) == pytest.approx(32 * (1 - (31 / 32) ** 32))
    for m in (3, 4, 8, 16, 32):  # gpt-oss-20b: at most ~32 x 180 programs
        cfg = mma_moe_config(4 * m, 32, 2880, 2880, direct=False, repacked=True)
        assert (cfg.gemm1.wk, cfg.gemm1.unroll, cfg.gemm2.wk, cfg.gemm2.unroll) == (4, 1, 4, 1)
    assert expected_experts(36, 128) * 180 <= FEW_PROGRAMS  # 120b M=9: still few
    for m in (12, 16):  # 120b: ~40 and ~51 blocks x 180 tiles: no split, as before
        cfg = mma_moe_config(4 * m, 128, 2880, 2880, direct=False, repacked=True)
        assert (cfg.gemm1.wk, cfg.gemm2.wk) == (1, 1)
    # short K (Qwen3: 32 / 12 chunks) and splits already 4-way (Mixtral) keep their configs
    qwen3 = mma_moe_config(40, 128, 768, 2048, direct=False, repacked=True)
    assert (qwen3.gemm1.wk, qwen3.gemm1.unroll, qwen3.gemm2.wk) == (2, 2, 1)
    mixtral = mma_moe_config(4, 8, 14336, 4096, direct=False, repacked=True)
    assert (mixtral.gemm1.wk, mixtral.gemm1.unroll, mixtral.gemm2.unroll) == (4, 2, 2)
    # the checkpoint-layout kernels were not measured this way
    assert mma_moe_config(16, 32, 2880, 2880, direct=False).gemm1.wk == 2


def test_small_experts_run_one_block_per_pair_up_to_half_a_token_per_expert():
    """Between single pairs (4 x pairs <= E) and 8-pair blocks, experts of at most
    DIRECT_MAX_EXPERT_ELEMENTS (I x H) run one mma block per pair (no expert sort) up to
    0.5 tokens per expert; bigger experts keep the blocks."""
    from quantdispatch.kernels.regimes import MMA_LAYOUT_MOE

    assert MMA_LAYOUT_MOE.direct is not None
    DIRECT_MAX_EXPERT_ELEMENTS = MMA_LAYOUT_MOE.direct.max_expert_elements
    for m in (5, 6, 8):  # Qwen3-30B-A3B: 768 x 2048, 0.31..0.5 per expert
        cfg = mma_layout_moe_plan(m, 8, 128, 768, 2048, CPU)
        assert isinstance(cfg, MmaMoeConfig) and cfg.direct
        assert cfg == mma_moe_config(8 * m, 128, 768, 2048, direct=True, repacked=True)
    assert not mma_layout_moe_plan(9, 8, 128, 768, 2048, CPU).direct  # 0.56 per expert
    assert isinstance(mma_layout_moe_plan(4, 8, 128, 768, 2048, CPU), SmallMoeConfig)
    assert 1024 * 2048 <= DIRECT_MAX_EXPERT_ELEMENTS < 1536 * 4096
    assert mma_layout_moe_plan(3, 8, 64, 1024, 2048, CPU).direct  # 64 experts, 0.375 per expert
    # Qwen3-235B-A22B-sized, gpt-oss-120b / 20b, DeepSeek-V3, Mixtral at 0.375..0.5 per expert
    for m, k, e, i, h in [(8, 8, 128, 1536, 4096), (12, 4, 128, 2880, 2880),
                          (4, 4, 32, 2880, 2880), (12, 8, 256, 2048, 7168),
                          (2, 2, 8, 14336, 4096)]:  # fmt: skip
        cfg = mma_layout_moe_plan(m, k, e, i, h, CPU)
        assert isinstance(cfg, MmaMoeConfig) and not cfg.direct, (m, k, e, i, h)


def test_wide_tiles_only_where_128_rows_divide_both_gemms():
    """Above 96 tokens per expert, 128-pair blocks on 128-row tiles with 8 warps; where 128
    does not divide I or H (gpt-oss: 2880) 64-row tiles with 4 warps, and a forced 128-row tile
    that falls back to 64 rows on such a GEMM runs it with 4 warps."""
    from quantdispatch.kernels.mma_layout.moe_gemm import _tile_warps

    qwen3 = mma_layout_moe_plan(2048, 8, 128, 768, 2048, CPU)
    assert (qwen3.block_m, qwen3.block_n, qwen3.warps) == (128, 128, 8)
    for m, e in ((1024, 32), (4096, 128)):  # gpt-oss-20b, 120b: 128 tokens per expert
        oss = mma_layout_moe_plan(m, 4, e, 2880, 2880, CPU)
        assert (oss.block_m, oss.block_n, oss.warps, oss.stages) == (128, 64, 4, 3)
    wide = MoeGemmTile(128, block_n=128, warps=8, stages=3)
    assert _tile_warps(wide, 128) == 8 and _tile_warps(wide, 64) == 4
    assert _tile_warps(MoeGemmTile(64), 64) == 4


def test_tiles_fit_the_gpus_shared_memory():
    """The 128-pair tile (~150 KB of pipeline by the upper bound) runs where 227 KB are
    available (H100 / H200); a 99 KB GPU (RTX 30/40/50, L40S) gets the 64-pair tile, which
    fits by that bound."""
    big = mma_layout_moe_plan(4096, 8, 128, 768, 2048, CPU)
    assert big.block_m == 128 and big.shared_bytes() > 99 * 1024
    assert DeviceFacts.for_capability((8, 9)).shared_bytes == 99 * 1024  # RTX 4090 / L40S
    rtx = DeviceFacts("rtx", (8, 9), 128, 99 * 1024)
    small = mma_layout_moe_plan(4096, 8, 128, 768, 2048, rtx)
    assert small.block_m == 64 and small.shared_bytes() + moe_plan._SHARED_MARGIN <= 99 * 1024
    # the smaller tiles fit as they are
    assert [mma_layout_moe_plan(m, 8, 128, 768, 2048, rtx).block_m for m in (128, 256, 512)] == [
        16,
        32,
        64,
    ]
    assert moe_plan._fit_shared(MoeGemmTile(16, stages=3), 20 * 1024) == MoeGemmTile(16, stages=2)


def test_which_layers_are_repacked():
    assert moe_layout_supported(768, 2048, True, (9, 0))
    assert moe_layout_supported(768, 2048, True, (8, 0))
    assert not moe_layout_supported(768, 2048, True, (7, 5))  # no bf16 mma.sync
    assert not moe_layout_supported(768, 2048, True, None)  # no GPU
    assert not moe_layout_supported(768, 2048, False, (9, 0))  # not gated
    assert not moe_layout_supported(720, 2048, True, (9, 0))  # I not a multiple of 64
    assert not moe_layout_supported(768, 2000, True, (9, 0))


def test_prepare_moe_keeps_the_canonical_stacks_off_the_gpu():
    ex = make_experts("nvfp4", 2, 128, 64, seed=15)
    w13, w2, _ = stacked(ex)
    names = ("packed", "block_scale", "global_scale")
    request = Request.make("nvfp4", "moe", torch.bfloat16)
    meta = CheckpointMeta()
    stacks = ExpertStacks(w13, w2, names, meta, gated=True)
    prepared = get_backend("triton").prepare_moe(stacks, request)
    assert prepared.names == names and prepared.meta == meta
    assert prepared.layout is Layout.CHECKPOINT
    assert all(a is b for a, b in zip(prepared.w13, w13, strict=True))


# ---- bad input --------------------------------------------------------------------------------


def test_bad_inputs():
    ex = make_experts("nvfp4", 2, 128, 64, seed=16)
    r13, r2, _, _ = repacked(ex, torch.bfloat16)
    x = rand_x(3, 128, torch.bfloat16, seed=17)
    ids, w = routing(3, 2, 1, seed=18)
    cfg = MoeGemmTile(16)
    with pytest.raises(InputError, match="the layout places codes for one 16-bit dtype"):
        run(r13, r2, x.half(), ids, w, cfg, packed_for=torch.bfloat16)
    with pytest.raises(InputError, match="gated activations"):
        run(r13, r2, x, ids, w, cfg, activation="relu2")
    with pytest.raises(WeightFormatError, match="repacked expert words are int32"):
        run([r13[0].view(torch.uint8), *r13[1:]], r2, x, ids, w, cfg)
    with pytest.raises(WeightFormatError, match="repacked expert scales are uint8"):
        run([r13[0], r13[1][:, :1], r13[2]], r2, x, ids, w, cfg)
    with pytest.raises(WeightFormatError, match="global scales"):
        run([*r13[:2], r13[2][:1]], r2, x, ids, w, cfg)
    with pytest.raises(WeightFormatError, match=r"w2 \[E=1"):
        run(r13, [t[:1] for t in r2], x, ids, w, cfg)
    with pytest.raises(InputError, match=r"int32/int64 \[M=3"):
        run(r13, r2, x, ids[:2], w, cfg)
    with pytest.raises(InputError, match="topk_weights"):
        run(r13, r2, x, ids, w.double(), cfg)
    with pytest.raises(WeightFormatError, match="float32"):
        run(r13, r2, x, ids, w, cfg, b13=torch.zeros(2, 63))
    with pytest.raises(InputError, match="the mma kernels are PTX"):
        run(r13, r2, x, ids, w, mma_layout_moe_plan(1, 1, 2, 64, 128, CPU))
    with pytest.raises(InputError, match=r"topk-sum w4u2/w8u2 off a CUDA GPU.*single-pair"):
        run(r13, r2, x, ids, w, SmallMoeConfig())
    with pytest.raises(InputError, match="MoeGemmTile with block_m a multiple of 16"):
        run(r13, r2, x, ids, w, MoeGemmTile(8))


def test_grouped_gemm_settles_where_the_hazard_holds(monkeypatch):
    """Its A operand is the decoded weight (register-operand wgmma on SM 9.x): both launches
    settle their accumulators where the device's rs_wgmma_hazard holds and keep their stages."""
    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(moe_gemm, "_moe_gemm_kernel", FakeKernel())
    monkeypatch.setattr(moe_gemm, "interpreting", lambda: False)  # compiled, as on the GPU
    settling = replace(device_facts(torch.device("cpu")), rs_wgmma_hazard=True)
    ex = make_experts("nvfp4", 4, 128, 64, seed=7)
    r13, r2, _, _ = repacked(ex, torch.bfloat16)
    ids, w = routing(5, 4, 2, seed=8)
    x = rand_x(5, 128, torch.bfloat16, seed=9)
    run(r13, r2, x, ids, w, MoeGemmTile(16, stages=3), facts=settling)
    assert [(k["SETTLE"], k["num_stages"]) for k in launches] == [(True, 3), (True, 3)]
    launches.clear()
    monkeypatch.setattr(moe_gemm, "interpreting", lambda: True)  # the interpreter runs no PTX
    run(r13, r2, x, ids, w, MoeGemmTile(16, stages=3), facts=settling)
    assert [k["SETTLE"] for k in launches] == [False, False]


# ---- MXFP4 experts on the same layout ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_experts_grouped_gemm(dtype):
    """H = 192 (3 chunks), I = 64; unused experts, ids -1: the shared scale pairs (int32 loads,
    each lane's pair picked by its position) and each expert's own global scale."""
    ex = make_experts("mxfp4", 5, 192, 64, seed=21)
    r13, r2, _, _ = repacked(ex, dtype)
    assert r13[1].shape[3] == 16 and r13[2].shape == (5,)
    ids, w = routing(9, 5, 2, seed=22, choices=[0, 2, 3])
    ids[0, 1] = -1
    x = rand_x(9, 192, dtype, seed=23)
    out = run(r13, r2, x, ids, w, MoeGemmTile(16))
    assert rel_err(out, moe64(x, ids, w, ex.w13, ex.w2)) < BOUND[dtype]


def test_mxfp4_expert_scales_too_wide_apart_are_refused():
    ex = make_experts("mxfp4", 2, 128, 64, seed=28)
    w13, _, _ = stacked(ex)
    scales = w13[1].clone()
    scales.view(torch.uint8)[1, 0, 0] = 1  # 2^-126 in expert 1, far below its other scales
    with pytest.raises(WeightFormatError, match="binades"):
        repack_experts_mx(w13[0], scales, torch.bfloat16)


def test_dequantize_only_large_experts_from_768_tokens_per_expert():
    """SM 9.0+ (torch._grouped_mm): Mixtral-sized experts (14336 x 4096) dequantize from 768
    tokens per expert (the H200 crossover lies between 640 and 768); smaller experts (Qwen3,
    gpt-oss, DeepSeek-V3) keep the grouped GEMM, which beat dequantize at 512..1024 per expert."""
    h200 = DeviceFacts.for_capability((9, 0))
    mixtral = (2, 8, 14336, 4096)  # top_k, E, I, H
    assert isinstance(mma_layout_moe_plan(3072, *mixtral, h200), DequantMoeConfig)  # 768 per expert
    assert isinstance(mma_layout_moe_plan(3068, *mixtral, h200), MoeGemmTile)  # 767
    for m, top_k, e, i, h in [(16384, 8, 128, 768, 2048), (65536, 4, 32, 2880, 2880),
                              (131072, 8, 256, 2048, 7168)]:  # fmt: skip
        assert isinstance(mma_layout_moe_plan(m, top_k, e, i, h, h200), MoeGemmTile), (e, i, h)
    a100 = DeviceFacts.for_capability((8, 0))  # no torch._grouped_mm: never
    assert isinstance(mma_layout_moe_plan(3072, *mixtral, a100), MoeGemmTile)


def test_prepare_moe_repacks_fp4_experts_where_the_gpu_takes_the_layout(monkeypatch):
    """The repack branch of the triton backend's prepare_moe, run on CPU tensors with an SM 9.0
    capability: the mma16x64 stacks, the same as repacking each stack directly."""
    from quantdispatch.backends.triton import prepare as triton_prepare
    from quantdispatch.kernels.mma_layout.moe_stacks import repack_experts

    monkeypatch.setattr(triton_prepare, "_capability", lambda device: (9, 0))
    ex = make_experts("nvfp4", 2, 128, 64, seed=16)
    w13, w2, _ = stacked(ex)
    names = ("packed", "block_scale", "global_scale")
    request = Request.make("nvfp4", "moe", torch.bfloat16)
    stacks = ExpertStacks(w13, w2, names, CheckpointMeta(), gated=True)
    prepared = get_backend("triton").prepare_moe(stacks, request)
    assert prepared.layout is Layout.MMA16X64
    assert prepared.names == ("mma_words", "mma_scales", "global_scale")
    want = repack_experts(w13[0], w13[1], torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(prepared.w13[:2], want, strict=True))
    assert prepared.w13[2] is w13[2] and prepared.w2[2] is w2[2]

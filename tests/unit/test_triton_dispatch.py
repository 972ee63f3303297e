"""The triton backend's kernel family for a call is one answer: the regime table read by the
pure dispatch (backends/triton/dispatch.py), which the run path and ``Decision.kernel_for``
both call. Checked without a GPU over a grid of M, shapes, formats, dtypes and SM families:

* the table reproduces the rules it replaced (written out below as an independent oracle);
* ``kernel_for(m)`` (from the ranges) equals the dispatch function at every M;
* the run path, given CPU tensors and a simulated GPU's facts, calls the launcher of that
  family (the launchers are replaced by recorders);
* with FP8 compute on (each mode), the same three hold with the FP8 prefill range added where
  its row applies (SM 9.0 with CUDA 12.9+, eligible shapes), and nowhere else.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from quantdispatch.api import load_settings, select
from quantdispatch.backends.base import (
    CheckpointMeta,
    Layout,
    LinearBinding,
    Mma16x64Meta,
    MoeCall,
)
from quantdispatch.backends.triton import dispatch, fp8_compute, run
from quantdispatch.device import preset_profile
from quantdispatch.errors import BackendUnavailableError
from quantdispatch.kernels.common.device_facts import DeviceFacts
from quantdispatch.kernels.regimes import Family

CPU = torch.device("cpu")

PRESETS = ("h200", "a100", "t4", "rtx4090", "b200", "rtx5090")
FORMATS = ("nvfp4", "mxfp4", "fp8")
DTYPES = (torch.bfloat16, torch.float16)
#: qkv, o, gate_up (2^25+), down (2^25+), 2^26 exactly, N not a multiple of 64, odd K.
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192),
          (48, 4096), (4096, 4160), (1000, 4096), (4096, 2880))  # fmt: skip
MS = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513,
      1024, 4096)  # fmt: skip


def _decision(fmt, op, act, preset, fp8="off", **shape):
    try:
        settings = load_settings({}, backend={fmt: "triton"}, fp8_compute=fp8)
        return select(fmt, op, act, device=preset, settings=settings, **shape)
    except BackendUnavailableError:  # e.g. bf16 before SM 8.0
        return None


def _with_cuda(preset, version):
    """A preset's profile with a torch build of CUDA ``version``: presets take this torch's
    CUDA version (12.8 assumed for a CPU build), which must not decide these tests."""
    return preset_profile(preset).model_copy(update={"cuda_version": version})


def _cuda13(preset):
    return _with_cuda(preset, "13.0")


FP8_MODES = ("prefill", "prefill-resident")
FP8_MS = (*MS, 1023, 1025, 2047, 2049, 4095, 4097, 8192)


def _old_family(fmt, m, n, k, act, cap):
    """The rules before the table (backends/triton.py's mma_layout_eligible, mma_path,
    gemm_eligible and use_dequant_gemm), written out."""
    repacked = (fmt in ("nvfp4", "mxfp4") and cap is not None and cap >= (8, 0)
                and n % 16 == 0 and k % 64 == 0 and n > 0 and k > 0)  # fmt: skip
    if repacked:
        large = n * k >= 2**25
        if cap[0] == 9 and n % 64 == 0 and k % 64 == 0:
            mma_top, gemm_top = (16, 512) if large else (32, 256)
        else:
            mma_top, gemm_top = (128 if large else 64), 0
        if m <= mma_top:
            return Family.MMA_GEMV
        return Family.WGMMA_GEMM if m <= gemm_top else Family.DEQUANT_CUBLAS
    dequant = m >= 512 if n * k > 2**26 else m >= 128
    if dequant:
        return Family.DEQUANT_CUBLAS
    return Family.FP8_TL_DOT if fmt == "fp8" else Family.CHECKPOINT_TL_DOT


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", DTYPES, ids=["bf16", "fp16"])
def test_kernel_for_is_the_dispatch_and_the_old_rules(preset, fmt, act):
    profile = preset_profile(preset)
    facts = dispatch.facts_for(profile)
    for n, k in SHAPES:
        d = _decision(fmt, "linear", act, preset, n=n, k=k)
        if d is None:
            continue
        layout = dispatch.linear_layout(fmt, n, k, act, profile.capability)
        meta = dispatch.prepared_meta(layout, act)
        for m in MS:
            family = dispatch.linear_family(fmt, layout, meta, m, n, k, facts)
            assert d.kernel_for(m).family is family, (preset, fmt, n, k, m)
            assert family is _old_family(fmt, m, n, k, act, profile.capability), (n, k, m)


@pytest.mark.parametrize("preset", ("h200", "rtx4090", "a100", "b200", "rtx5090"))
@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4"))
@pytest.mark.parametrize("mode", FP8_MODES)
def test_kernel_for_with_fp8_compute_is_the_dispatch(preset, fmt, mode):
    """FP8 compute on: kernel_for = the dispatch on the meta prepare gives; FP8 prefill from the
    row's M on SM 9.0 (eligible shapes: N % 16, K % 128), below it and elsewhere the weight-only
    families of the old rules."""
    profile = _cuda13(preset)
    facts, cap = dispatch.facts_for(profile), profile.capability
    min_m = {"prefill": 2048, "prefill-resident": 256}[mode]
    for act, (n, k) in itertools.product(DTYPES, SHAPES):
        d = _decision(fmt, "linear", act, profile, fp8=mode, n=n, k=k)
        if d is None:
            continue
        assert d.options.fp8_compute == mode
        layout = dispatch.linear_layout(fmt, n, k, act, cap)
        got = fp8_compute.mode_for(fmt, n, k, act, cap, mode, (13, 0))
        on = cap == (9, 0) and n % 16 == 0 and k % 128 == 0
        assert got == (mode if on else "off"), (preset, n, k)
        meta = dispatch.prepared_meta(layout, act, got)
        for m in FP8_MS:
            family = dispatch.linear_family(fmt, layout, meta, m, n, k, facts)
            assert d.kernel_for(m).family is family, (preset, fmt, n, k, m)
            if on and m >= min_m:
                assert family is Family.FP8_PREFILL, (n, k, m)
            else:
                assert family is _old_family(fmt, m, n, k, act, cap), (n, k, m)


def test_fp8_compute_rows_need_cuda_12_9_for_the_block_recipes():
    """An H200 with a CUDA 12.8 build of torch: no FP8 range, and the trace says why."""
    d = _decision("nvfp4", "linear", torch.bfloat16, _with_cuda("h200", "12.8"), fp8="prefill",
                  n=6144, k=4096)  # fmt: skip
    assert all(r.family != Family.FP8_PREFILL for r in d.kernel_ranges())
    assert "FP8 compute (prefill) not used: recipe 128x128 needs SM 9.0 and CUDA 12.9+" in d.reason


def test_an_fp16_rebased_mxfp4_weight_keeps_the_fused_kernels_at_every_m():
    meta, facts = CheckpointMeta(fp16_rebased=True), DeviceFacts.for_capability((9, 0))
    for m in MS:
        family = dispatch.linear_family("mxfp4", Layout.CHECKPOINT, meta, m, 4096, 4096, facts)
        assert family is Family.CHECKPOINT_TL_DOT


# ---- the run path ----------------------------------------------------------------------------


LAUNCHERS = {
    "mma_linear": Family.MMA_GEMV,
    "mma_gemm": Family.WGMMA_GEMM,
    "dequant_gemm": Family.DEQUANT_CUBLAS,
    "fp4_linear": Family.CHECKPOINT_TL_DOT,
    "fp8_weight_only_linear": Family.FP8_TL_DOT,
    "fp8_prefill_linear": Family.FP8_PREFILL,
    "fp8_prefill_linear_mma": Family.FP8_PREFILL,
    "mma_layout_moe": None,  # its family: the config it gets
    "fused_moe": None,
}


@pytest.fixture
def calls(monkeypatch):
    """Replace run.py's launchers by recorders; returns the list of (name, kwargs)."""
    seen: list = []
    for name in LAUNCHERS:

        def fake(*args, _name=name, **kw):
            seen.append((_name, kw))
            return torch.empty(0)

        monkeypatch.setattr(run, name, fake)
    return seen


def linear_tensors(fmt, layout, n, k):
    """A prepared weight's tensors of these shapes: zero codes, block scales of 1.0."""
    if layout is Layout.MMA16X64:
        words = torch.zeros((n // 16, k // 64, 32, 4), dtype=torch.int32)
        return [words, torch.zeros((n // 16, k // 64, 32, 2), dtype=torch.uint8), torch.ones(1)]
    if fmt == "fp8":
        return [torch.zeros((n, k), dtype=torch.uint8), torch.ones(())]
    group = 16 if fmt == "nvfp4" else 32
    scales = torch.full((n, k // group), 0x38 if fmt == "nvfp4" else 127, dtype=torch.uint8)
    return [torch.zeros((n, k // 2), dtype=torch.uint8), scales, torch.ones(1)]


@pytest.mark.parametrize("preset", ("h200", "a100", "t4", "b200"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_run_path_calls_the_launcher_of_kernel_for(monkeypatch, calls, preset, fmt):
    profile = preset_profile(preset)
    monkeypatch.setattr(run, "device_facts", lambda device: dispatch.facts_for(profile))
    for act, (n, k) in itertools.product(DTYPES, ((6144, 4096), (28672, 4096), (48, 4096))):
        d = _decision(fmt, "linear", act, preset, n=n, k=k)
        if d is None:
            continue
        layout = dispatch.linear_layout(fmt, n, k, act, profile.capability)
        meta = dispatch.prepared_meta(layout, act)
        tensors = linear_tensors(fmt, layout, n, k)
        for m in (1, 16, 17, 33, 64, 65, 128, 129, 256, 257, 512, 513):
            calls.clear()
            w = LinearBinding(tuple(tensors), None, fmt, layout, meta, True, CPU)
            run.linear(torch.empty((m, k), dtype=act), w)
            ((name, _),) = calls
            assert LAUNCHERS[name] is d.kernel_for(m).family, (preset, act, n, k, m, name)


@pytest.mark.parametrize("preset", ("h200", "rtx4090"))
@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4"))
@pytest.mark.parametrize("mode", FP8_MODES)
def test_the_fp8_compute_run_path_calls_the_launcher_of_kernel_for(
    monkeypatch, calls, preset, fmt, mode
):
    """FP8 compute on: the run path's launcher is kernel_for's family at every M, and the FP8
    prefill launchers get the block recipe and, for prefill-resident, the resident copy."""
    profile = _cuda13(preset)
    monkeypatch.setattr(run, "device_facts", lambda device: dispatch.facts_for(profile))
    cap = profile.capability
    for act, (n, k) in itertools.product(DTYPES, ((6144, 4096), (28672, 4096), (48, 4224))):
        d = _decision(fmt, "linear", act, profile, fp8=mode, n=n, k=k)
        layout = dispatch.linear_layout(fmt, n, k, act, cap)
        got = fp8_compute.mode_for(fmt, n, k, act, cap, mode, (13, 0))
        meta = dispatch.prepared_meta(layout, act, got)
        tensors = linear_tensors(fmt, layout, n, k)
        if got == "prefill-resident":
            stored = (
                (k // 128, n) if fp8_compute.recipe_for(k) == "1x128" else (-(-n // 128), k // 128)
            )
            tensors += [torch.empty((n, k), dtype=torch.uint8), torch.empty(stored)]
        for m in (1, 33, 255, 256, 257, 4095, 4096, 8192):
            calls.clear()
            w = LinearBinding(tuple(tensors), None, fmt, layout, meta, True, CPU)
            run.linear(torch.empty((m, k), dtype=act), w)
            ((name, kw),) = calls
            assert LAUNCHERS[name] is d.kernel_for(m).family, (preset, act, n, k, m, name)
            if LAUNCHERS[name] is Family.FP8_PREFILL:
                assert kw["recipe"] == fp8_compute.recipe_for(k) and kw["capability"] == (9, 0)
                res = kw["resident"]
                if mode == "prefill":
                    assert res is None
                else:
                    assert res.q.shape == (n, k) and res.q.dtype == torch.float8_e4m3fn
                    assert res.scale.t().is_contiguous() == (res.recipe == "1x128")


MOE_SHAPES = ((128, 8, 768, 2048), (8, 2, 14336, 4096), (8, 2, 1000, 4096))  # E, top-k, I, H


def _moe_stack(fmt, layout, e, n, k):
    if layout is Layout.MMA16X64:
        words = torch.empty((e, n // 16, k // 64, 32, 4), dtype=torch.int32)
        return (words, torch.empty((e, n // 16, k // 64, 32, 2), dtype=torch.uint8), torch.ones(e))
    if fmt == "fp8":
        return (torch.empty((e, n, k), dtype=torch.uint8), torch.ones(e))
    packed = torch.empty((e, n, k // 2), dtype=torch.uint8)
    scales = torch.empty((e, n, k // (16 if fmt == "nvfp4" else 32)), dtype=torch.uint8)
    return (packed, scales, torch.ones(e)) if fmt == "nvfp4" else (packed, scales)


@pytest.mark.parametrize("preset", ("h200", "a100"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_moe_run_path_runs_the_family_of_kernel_for(monkeypatch, calls, preset, fmt):
    """The plan's config that run.py hands the layout's launcher names kernel_for's family."""
    profile = preset_profile(preset)
    monkeypatch.setattr(run, "device_facts", lambda device: dispatch.facts_for(profile))
    for e, top_k, inter, hidden in MOE_SHAPES:
        d = _decision(fmt, "moe", torch.bfloat16, preset, n=inter, k=hidden, experts=e)
        layout = dispatch.moe_layout(fmt, inter, hidden, True, profile.capability)
        meta = Mma16x64Meta(torch.bfloat16) if layout is Layout.MMA16X64 else CheckpointMeta()
        w13 = _moe_stack(fmt, layout, e, 2 * inter, hidden)
        w2 = _moe_stack(fmt, layout, e, hidden, inter)
        for m in (1, 3, 8, 9, 16, 64, 65, 400, 1536, 1537, 2048, 3072, 4096):
            calls.clear()
            x = torch.empty((m, hidden), dtype=torch.bfloat16)
            ids = torch.zeros((m, top_k), dtype=torch.int32)
            call = MoeCall(x, ids, torch.ones((m, top_k)), w13, w2, None, None, fmt, "silu", (),
                           layout, meta)  # fmt: skip
            run.moe(call)
            ((name, kw),) = calls
            assert name == ("mma_layout_moe" if layout is Layout.MMA16X64 else "fused_moe")
            want = d.kernel_for(m, top_k=top_k)
            assert kw["config"].family is want.family, (preset, fmt, e, inter, hidden, m)
            if layout is Layout.MMA16X64:
                from quantdispatch.kernels.mma_layout.moe_plan import describe_moe_config

                assert describe_moe_config(kw["config"]) == want.detail
        calls.clear()  # an empty batch: no plan (the launcher returns [0, H] before one)
        x0, ids0 = torch.empty((0, hidden), dtype=torch.bfloat16), torch.zeros((0, top_k))
        run.moe(MoeCall(x0, ids0, ids0, w13, w2, None, None, fmt, "silu", (), layout, meta))
        assert calls[0][1]["config"] is None


def test_every_threshold_exists_once_in_the_table():
    """The names the rules had outside the table are gone (the plans read the table)."""
    from pathlib import Path

    import quantdispatch

    old = ("DEQUANT_GEMM_MIN_M", "LARGE_WEIGHT_ELEMENTS", "MMA_MAX_M", "GEMM_MAX_M",
           "MMA_MAX_TOKENS_PER_EXPERT", "DEQUANT_MIN_TOKENS_PER_EXPERT", "DEQUANT_MAX_BUFFER_BYTES",
           "DEQUANT_MIN_EXPERT_ELEMENTS", "DIRECT_MAX_TOKENS_PER_EXPERT",
           "DIRECT_MAX_EXPERT_ELEMENTS", "MMA_LAYOUT_TAG", "MX_FP16_REBASE_TAG")  # fmt: skip
    root = Path(quantdispatch.__file__).parent
    for path in root.rglob("*.py"):
        for line in path.read_text().splitlines():
            assert not any(line.startswith(f"{name} =") for name in old), (path, line)

"""Resolver invariants over every preset, plus the acceptance cases of the core issue."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from quantdispatch import select
from quantdispatch.api import load_settings
from quantdispatch.backends import get_facts
from quantdispatch.device import PRESETS, preset_profile
from quantdispatch.errors import BackendUnavailableError, ConfigurationError
from quantdispatch.policy import default_policy, parse_policy
from quantdispatch.request import Op, Request, Scheme
from quantdispatch.resolver import resolve

FORMATS = ["nvfp4", "mxfp4", "fp8"]
NO_ENV = load_settings({})


def _trace(decision):
    return {c.backend: c for c in decision.trace}


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("op", ["linear", "moe"])
@pytest.mark.parametrize("act", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme", ["weight_only", "weight_act"])
def test_every_preset_resolves_with_a_full_ordered_trace(preset, fmt, op, act, scheme):
    profile = preset_profile(preset)
    request = Request.make(fmt, op, act, scheme)
    decision = resolve(request, profile, NO_ENV, default_policy())
    candidates = default_policy().candidates(fmt, Op(op))
    # Every candidate is in the trace, in policy order, with a reason.
    assert [c.backend for c in decision.trace] == list(candidates)
    assert all(c.reason for c in decision.trace)
    # The chosen backend is the first accepted one, and its own check agrees.
    first_ok = next(c.backend for c in decision.trace if c.accepted)
    assert decision.backend == first_ok
    assert get_facts(decision.backend).explain_unsupported(request, profile) is None
    for c in decision.trace:
        backend = get_facts(c.backend)
        assert (backend.explain_unsupported(request, profile) is None) == c.accepted
        # A W4A4/W8A8 kernel is never chosen for a weight-only checkpoint.
        if scheme == "weight_only" and not backend.weight_only:
            assert not c.accepted
    # Invariant: on a W4A4/W8A8 checkpoint a weight-only backend never outranks a native one
    # that can run.
    if scheme == "weight_act":
        natives_ok = [
            c.backend for c in decision.trace if c.accepted and not get_facts(c.backend).weight_only
        ]
        if natives_ok:
            assert decision.backend in natives_ok


@pytest.mark.parametrize("preset", [p for p in PRESETS if PRESETS[p].capability])
def test_sm120_is_never_sm100(preset):
    profile = preset_profile(preset)
    d = select("nvfp4", device=profile, settings=NO_ENV)
    text = d.explain()
    if profile.capability[0] == 12:
        assert "sm120 family" in text
        for c in d.trace:
            if c.backend in ("cutlass", "torch"):
                assert "sm100 family kernels" not in c.reason


def test_v100_nvfp4_goes_to_reference_because_sm70_is_too_old():
    d = select("nvfp4", device="v100", settings=NO_ENV)
    assert d.backend == "reference"
    t = _trace(d)
    assert "SM 7.0 is below SM 7.5" in t["triton"].reason
    assert "SM 7.0 is below SM 7.5" in t["marlin"].reason
    assert "SM 7.0 has no FP4 tensor cores" in t["cutlass"].reason
    assert "SM 7.0 has no FP4 tensor cores" in t["torch"].reason


def test_t4_rejects_bf16_but_not_fp16():
    pytest.importorskip("triton")
    bf = _trace(select("nvfp4", act_dtype=torch.bfloat16, device="t4", settings=NO_ENV))
    fp = _trace(select("nvfp4", act_dtype=torch.float16, device="t4", settings=NO_ENV))
    for name in ("triton", "marlin"):
        assert "no bf16 tensor cores" in bf[name].reason
        assert "bf16" not in fp[name].reason
    assert fp["triton"].accepted


def test_h100_native_fp4_rejected_for_capability_fp8_not():
    nv = _trace(select("nvfp4", device="h100", settings=NO_ENV))
    assert "SM 9.0 has no FP4 tensor cores" in nv["cutlass"].reason
    assert "SM 9.0 has no FP4 tensor cores" in nv["torch"].reason
    f8 = _trace(select("fp8", device="h100", settings=NO_ENV))
    assert f8["torch"].accepted
    assert "tensor cores" not in f8["cutlass"].reason
    assert "SM 9.0" not in f8["cutlass"].reason


def test_h200_picks_triton_for_fp4_and_torch_for_fp8():
    pytest.importorskip("triton")
    assert select("nvfp4", device="h200", settings=NO_ENV).backend == "triton"
    assert select("mxfp4", device="h200", settings=NO_ENV).backend == "triton"
    assert select("fp8", device="h200", settings=NO_ENV).backend == "torch"
    # Ampere has no FP8 tensor cores: FP8 checkpoints run weight-only there.
    assert select("fp8", device="a100", settings=NO_ENV).backend == "triton"


def test_w4a4_on_weight_only_kernel_says_so():
    d = select("nvfp4", scheme="weight_act", device="h100", settings=NO_ENV)
    assert "weight-only" in d.reason and "W4A4" in d.reason


def test_weight_only_fp8_checkpoint_never_gets_w8a8_kernel():
    pytest.importorskip("triton")
    d = select("fp8", scheme="weight_only", device="h100", settings=NO_ENV)
    assert d.backend == "triton"
    assert "weight-only" in _trace(d)["torch"].reason


def test_block_scaled_fp8_goes_weight_only():
    pytest.importorskip("triton")
    d = select("fp8", scale_kind="block", device="h100", settings=NO_ENV)
    assert d.backend == "triton"
    assert "block-scaled" in _trace(d)["torch"].reason


def test_marlin_pads_shapes_off_its_tiles_instead_of_rejecting_them():
    # The padding note itself is checked in test_marlin_backend.py (needs a fake provider).
    d = select("nvfp4", n=4096 + 32, k=4096 + 32, device="a100", settings=NO_ENV)
    assert "tiles" not in _trace(d)["marlin"].reason


def test_triton_rejects_k_not_multiple_of_group():
    d = select("nvfp4", n=64, k=40, device="a100", settings=NO_ENV)
    assert "K=40 is not a multiple of the nvfp4 group size 16" in _trace(d)["triton"].reason
    assert d.backend == "reference"


def test_cpu_runs_reference():
    d = select("nvfp4", device="cpu", settings=NO_ENV)
    assert d.backend == "reference"
    assert "needs a CUDA GPU" in _trace(d)["triton"].reason


def test_forced_backend_that_can_run_is_used_and_traced():
    s = load_settings({"QUANTDISPATCH_BACKEND_NVFP4": "reference"})
    d = select("nvfp4", device="h100", settings=s)
    assert d.backend == "reference"
    assert d.forced_by == "QUANTDISPATCH_BACKEND_NVFP4=reference"
    assert all("not considered" in c.reason for c in d.trace if c.backend != "reference")
    assert not d.is_fallback  # forced: no fallback warning


def test_forced_backend_that_cannot_run_raises_with_its_reason():
    pytest.importorskip("triton")
    s = load_settings({"QUANTDISPATCH_BACKEND_NVFP4": "cutlass"})
    with pytest.raises(BackendUnavailableError) as e:
        select("nvfp4", device="h100", settings=s)
    msg = str(e.value)
    assert "QUANTDISPATCH_BACKEND_NVFP4=cutlass" in msg
    assert "SM 9.0 has no FP4 tensor cores" in msg
    assert "never falls back" in msg
    # The force applies to its format only.
    assert select("mxfp4", device="h100", settings=s).backend == "triton"


def test_sglang_marlin_switch_forces_marlin():
    s = load_settings({"SGLANG_FORCE_NVFP4_MARLIN": "1"})
    with pytest.raises(
        BackendUnavailableError, match="SGLANG_FORCE_NVFP4_MARLIN=1 forces backend 'marlin'"
    ):
        select("nvfp4", device="h100", settings=s)


def test_per_format_force_that_caught_an_op_its_backend_lacks_names_the_per_op_fix():
    """torch runs nvfp4 linear on a B200 but computes no MoE: force it per op instead."""
    s = load_settings({"QUANTDISPATCH_BACKEND_NVFP4": "torch"})
    with pytest.raises(BackendUnavailableError) as e:
        select("nvfp4", "moe", device="b200", settings=s)
    msg = str(e.value)
    assert "QUANTDISPATCH_BACKEND_NVFP4=torch forces backend 'torch'" in msg
    assert "QUANTDISPATCH_BACKEND_NVFP4=torch forces every op of nvfp4" in msg
    fix = "unset QUANTDISPATCH_BACKEND_NVFP4 and set QUANTDISPATCH_BACKEND_NVFP4_LINEAR=torch"
    assert fix in msg and e.value.fix.startswith(fix)
    followed = load_settings({"QUANTDISPATCH_BACKEND_NVFP4_LINEAR": "torch"})
    assert select("nvfp4", "linear", device="b200", settings=followed).backend == "torch"
    select("nvfp4", "moe", device="b200", settings=followed)


@pytest.mark.parametrize(
    ("env", "device", "op"),
    [
        ({"QUANTDISPATCH_BACKEND_NVFP4": "cutlass"}, "b200", "moe"),  # no provider for linear
        ({"QUANTDISPATCH_BACKEND_NVFP4": "cutlass"}, "h100", "linear"),
        ({"SGLANG_FORCE_NVFP4_MARLIN": "1"}, "h100", "moe"),  # no Marlin provider
    ],
)
def test_a_force_that_runs_no_op_of_its_format_here_says_unset_it(env, device, op):
    """The per-op form would fail as well: the fix is to unset the force, never to narrow it."""
    (var,) = env
    with pytest.raises(BackendUnavailableError) as e:
        select("nvfp4", op, device=device, settings=load_settings(env))
    assert e.value.fix.startswith(f"unset {var} (the policy then picks ")
    assert "QUANTDISPATCH_BACKEND_NVFP4_" not in e.value.fix
    select("nvfp4", op, device=device, settings=load_settings({}))


def test_per_op_force_that_cannot_run_says_so_without_the_per_op_hint():
    s = load_settings({"QUANTDISPATCH_BACKEND_NVFP4_MOE": "cutlass"})
    with pytest.raises(BackendUnavailableError) as e:
        select("nvfp4", "moe", device="b200", settings=s)
    msg = str(e.value)
    assert "QUANTDISPATCH_BACKEND_NVFP4_MOE=cutlass forces backend 'cutlass'" in msg
    assert "every op" not in msg


def test_per_op_forces_pick_per_op_and_win_over_the_per_format_one():
    pytest.importorskip("triton")
    s = load_settings(
        {"QUANTDISPATCH_BACKEND_NVFP4": "reference", "QUANTDISPATCH_BACKEND_NVFP4_MOE": "triton"}
    )
    moe = select("nvfp4", "moe", device="h100", settings=s)
    assert moe.backend == "triton" and moe.forced_by == "QUANTDISPATCH_BACKEND_NVFP4_MOE=triton"
    linear = select("nvfp4", "linear", device="h100", settings=s)
    assert linear.backend == "reference"
    assert linear.forced_by == "QUANTDISPATCH_BACKEND_NVFP4=reference"
    s = load_settings({"QUANTDISPATCH_BACKEND_NVFP4_LINEAR": "reference"})
    assert select("nvfp4", "linear", device="h100", settings=s).backend == "reference"
    assert select("nvfp4", "moe", device="h100", settings=s).forced_by is None


def test_disabled_backend_is_skipped_with_reason():
    s = load_settings({"QUANTDISPATCH_DISABLE": "triton, marlin"})
    d = select("nvfp4", device="h100", settings=s)
    assert d.backend == "reference"
    t = _trace(d)
    assert t["triton"].reason == "disabled by QUANTDISPATCH_DISABLE"
    assert not t["triton"].accepted


def test_no_runnable_backend_raises_listing_reasons():
    policy = default_policy().overlay(parse_policy({"nvfp4": {"linear": ["triton"]}}, "test.toml"))
    with pytest.raises(BackendUnavailableError) as e:
        select("nvfp4", device="cpu", settings=NO_ENV, policy=policy)
    assert "triton: needs a CUDA GPU" in str(e.value)
    assert "test.toml" in str(e.value)


def test_decisions_are_cached_and_deterministic():
    a = select("nvfp4", device="h100", settings=NO_ENV)
    b = select("nvfp4", device="h100", settings=load_settings({}))
    assert a is b


def test_fallback_to_reference_warns_once(caplog, monkeypatch):
    import quantdispatch.api

    monkeypatch.setattr(quantdispatch.api, "_warned", set())
    caplog.set_level(logging.INFO, logger="quantdispatch")
    # A real (probed) GPU profile: simulated ones never log.
    v100 = preset_profile("v100").model_copy(update={"simulated": False, "preset": None})
    for _ in range(3):
        select("mxfp4", op="moe", act_dtype="fp16", device=v100, settings=NO_ENV)
    select("mxfp4", device="v100", settings=NO_ENV)  # simulated: silent

    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "reference" in warnings[0].getMessage()
    assert "SM 7.0" in warnings[0].getMessage()


def test_bad_request_values_name_the_fix():
    with pytest.raises(ConfigurationError, match="valid formats"):
        select("nvfp5", settings=NO_ENV)
    with pytest.raises(ConfigurationError, match="valid ops"):
        select("nvfp4", op="conv", settings=NO_ENV)
    with pytest.raises(ConfigurationError, match="bf16 or fp16"):
        select("nvfp4", act_dtype=torch.float32, settings=NO_ENV)
    with pytest.raises(ConfigurationError, match="valid schemes"):
        select("nvfp4", scheme="w4a8", settings=NO_ENV)
    with pytest.raises(ConfigurationError, match="valid presets"):
        select("nvfp4", device="h300", settings=NO_ENV)


def test_scheme_defaults_follow_the_format():
    assert Request.make("nvfp4").scheme is Scheme.WEIGHT_ACT
    assert Request.make("mxfp4").scheme is Scheme.WEIGHT_ONLY
    assert Request.make("nvfp4", scheme="weight_only").scheme_label == "W4A16"


@pytest.mark.parametrize(
    ("preset", "op", "says", "not_says"),
    [
        ("h200", "linear", "mma.sync kernel", "tl.dot kernels on the checkpoint"),
        ("h200", "linear", "M <= 256: tl.dot (wgmma) GEMM decoding the same weight", None),
        ("a100", "linear", "mma.sync kernel", "wgmma"),  # the mid-M GEMM is an SM 9.x path
        ("h200", "moe", "torch._grouped_mm", None),
        ("h200", "moe", "experts repacked once (mma16x64", None),
        ("a100", "moe", "grouped tl.dot GEMM", "torch._grouped_mm"),  # no _grouped_mm < SM 9.0
        ("t4", "moe", "fused tl.dot kernels", "mma.sync"),  # no bf16 mma.sync before SM 8.0
        ("t4", "linear", "tl.dot kernels on the checkpoint layout", "mma16x64"),
    ],
)
def test_triton_names_the_nvfp4_kernel_family_it_runs(preset, op, says, not_says):
    """doctor's bracketed variant: which of the triton backend's kernels this GPU gets."""
    profile = preset_profile(preset)
    request = Request.make("nvfp4", op, "fp16", "weight_only", n=4096, k=4096)
    text = get_facts("triton").variant(request, profile)
    assert text is not None and says in text
    if not_says:
        assert not_says not in text


@pytest.mark.parametrize(
    ("preset", "op", "says"),
    [
        ("h200", "linear", "weights whose block scales span <= 18 binades: M <= 32: mma.sync"),
        ("h200", "linear", "wider spans: tl.dot kernels on the checkpoint layout"),
        ("t4", "linear", "tl.dot kernels on the checkpoint layout"),
    ],
)
def test_triton_names_the_mxfp4_kernel_family_it_runs(preset, op, says):
    profile = preset_profile(preset)
    request = Request.make("mxfp4", op, "fp16", "weight_only", n=4096, k=4096)
    text = get_facts("triton").variant(request, profile)
    assert text is not None and says in text
    moe = Request.make("mxfp4", "moe", "bf16", "weight_only", n=4096, k=4096)
    moe_text = get_facts("triton").variant(moe, profile)
    repacked = "gated layers with I and H multiples of 64 whose scales span <= 18 binades"
    assert repacked in moe_text if preset == "h200" else "checkpoint layout" in moe_text


@pytest.mark.parametrize(
    ("preset", "fmt", "says", "not_says"),
    [
        ("h200", "nvfp4", "M <= 32 (16 for weights of 2^25+ elements): mma.sync", None),
        ("h200", "nvfp4", "M <= 256 (512 for weights of 2^25+ elements) where N is", None),
        ("a100", "nvfp4", "M <= 64 (128 for weights of 2^25+ elements): mma.sync", "wgmma"),
        ("h200", "mxfp4", "span <= 18 binades, N a multiple of 16 and K of 64: M <= 32", None),
        ("t4", "nvfp4", "tl.dot kernels on the checkpoint layout", "mma.sync"),
    ],
)
def test_without_a_shape_triton_states_the_rules_by_weight_size(preset, fmt, says, not_says):
    """doctor without --shape: the M ranges for every weight size, not one made-up shape's."""
    pytest.importorskip("triton")
    request = Request.make(fmt, "linear", "fp16", "weight_only")
    text = get_facts("triton").variant(request, preset_profile(preset))
    assert text is not None and says in text
    if not_says:
        assert not_says not in text


def test_triton_says_when_the_installed_triton_makes_the_gemm_wait_each_step(monkeypatch):
    pytest.importorskip("triton")
    from quantdispatch.kernels.common import wgmma_guard as wgmma_hazard

    request = Request.make("nvfp4", "linear", "bf16", "weight_only", n=4096, k=4096)
    profile = preset_profile("h200")
    monkeypatch.setattr(wgmma_hazard, "triton_version", lambda: (3, 6))
    text = get_facts("triton").variant(request, profile)
    note = "each K step waits for its wgmmas: Triton 3.6 overlaps register-operand wgmma unsafely"
    assert note in text
    assert "triton-lang/triton#9433" in text
    monkeypatch.setattr(wgmma_hazard, "triton_version", lambda: (3, 9))
    text = get_facts("triton").variant(request, profile)
    note = "each K step waits for its wgmmas: Triton 3.9's fix of triton-lang/triton#9433 is not"
    assert note in text
    monkeypatch.setattr(wgmma_hazard, "VERIFIED_SAFE_FROM", (3, 9))
    assert "waits for its wgmmas" not in get_facts("triton").variant(request, profile)


def test_triton_says_whether_the_gemm_takes_activations_by_tma(monkeypatch):
    """The TMA activation tiles need Triton's host descriptors; doctor says so only when the
    installed Triton has them."""
    pytest.importorskip("triton")
    from quantdispatch.kernels.common import device_facts

    request = Request.make("nvfp4", "linear", "bf16", "weight_only", n=4096, k=4096)
    profile = preset_profile("h200")
    for has in (True, False):
        monkeypatch.setattr(device_facts, "has_host_descriptors", lambda has=has: has)
        text = get_facts("triton").variant(request, profile)
        assert ("activation tiles by TMA" in text) == has


def test_triton_states_the_mxfp4_fp16_rebase_and_the_fp8_w8a16_kernels():
    """doctor says what happens to MXFP4 scales fp16 cannot hold (rebased, fused kernels at
    every M) and which kernels FP8 weight-only runs; neither text for the other dtype/format."""
    pytest.importorskip("triton")
    triton_backend = get_facts("triton")
    t4 = preset_profile("t4")
    mx16 = triton_backend.variant(Request.make("mxfp4", "linear", "fp16", "weight_only"), t4)
    assert "block scales leave 2^-23..2^13 is rebased at load" in mx16
    mx_bf16 = Request.make("mxfp4", "linear", "bf16", "weight_only")
    assert "rebased" not in triton_backend.variant(mx_bf16, preset_profile("a100"))
    fp8 = triton_backend.variant(Request.make("fp8", "linear", "bf16", "weight_only"), t4)
    assert "K split inside each program" in fp8 and "dequantized slabs + cuBLAS" in fp8


def test_decision_names_the_kernel_family_for_each_m():
    pytest.importorskip("triton")
    d = select("nvfp4", device="h200", n=6144, k=4096)
    ranges = d.kernel_ranges()
    assert ranges[0].first_m == 1 and ranges[-1].last_m is None
    for a, b in itertools.pairwise(ranges):
        assert b.first_m == a.last_m + 1  # contiguous, no gaps
    assert [d.kernel_for(m).family for m in (1, 100, 4096)] == [
        "mma GEMV",
        "wgmma GEMM",
        "dequantize + cuBLAS",
    ]
    with pytest.raises(ConfigurationError, match="positive int"):
        d.kernel_for(0)


def test_kernel_for_needs_the_shape_it_depends_on():
    pytest.importorskip("triton")
    with pytest.raises(ConfigurationError, match="pass n= and k="):
        select("nvfp4", device="h200").kernel_for(1)
    moe = select("nvfp4", "moe", device="h200", n=768, k=2048, experts=128)
    with pytest.raises(ConfigurationError, match="top_k"):
        moe.kernel_for(1)
    assert moe.kernel_for(1, top_k=8).family == "mma single pairs"
    assert select("nvfp4", device="cpu").kernel_for(7).family == "reference"

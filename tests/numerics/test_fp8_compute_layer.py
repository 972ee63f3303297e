"""FP8 compute wired into the triton backend, on the CPU: a simulated SM 9.0 with CUDA 13 (the
device facts, prepare's capability, the recipe check) and ``torch._scaled_mm`` replaced by the
float64 emulation of test_fp8_prefill_linear.py. prepare records the mode in the meta (the
codec round-trips it) and keeps the resident copy as two more tensors; the custom op runs the
FP8 prefill linear (bit-equal with calling it directly); verify reports it in its own section
with its own bounds, never among the weight-only checks."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("triton")
from test_fp8_prefill_linear import ScaledMmEmulator

import quantdispatch.ops  # noqa: F401  (registers torch.ops.quantdispatch.*)
from quantdispatch import verify as verify_mod
from quantdispatch.backends.base import Layout, as_op_tensors, decode_meta
from quantdispatch.backends.triton import TritonBackend, fp8_compute, prepare, run
from quantdispatch.backends.triton.meta import fp8_compute_of_meta
from quantdispatch.backends.triton.options import TritonOptions
from quantdispatch.cli import main
from quantdispatch.device import preset_profile
from quantdispatch.formats import quantize_mxfp4, quantize_nvfp4
from quantdispatch.kernels.common.device_facts import DeviceFacts
from quantdispatch.kernels.native import fp8_prefill as fp8p
from quantdispatch.request import Request


@pytest.fixture
def hopper(monkeypatch):
    """This CPU as an SM 9.0 GPU with CUDA 13 for FP8 compute, torch._scaled_mm emulated."""
    monkeypatch.setattr(fp8p, "_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(prepare, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(run, "device_facts", lambda device: DeviceFacts.for_capability((9, 0)))

    def use(recipe: str) -> ScaledMmEmulator:
        emu = ScaledMmEmulator(recipe)
        monkeypatch.setattr(torch, "_scaled_mm", emu)
        return emu

    return use


def _weight(fmt, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    return quantize_nvfp4(w) if fmt == "nvfp4" else quantize_mxfp4(w)


def _prepare(weight, fmt, mode, act=torch.bfloat16):
    n, k = weight.shape
    request = Request.make(fmt, "linear", act, "weight_only", n=n, k=k)
    return TritonBackend().prepare(weight, request, options=TritonOptions(mode))


def _call(prepared, fmt, x, bias=None):
    return torch.ops.quantdispatch.linear(
        x, as_op_tensors(list(prepared.tensors)), bias, "triton", fmt, prepared.meta_args(),
        prepared.out_features,
    )  # fmt: skip


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_prepare_keeps_the_resident_copy_and_the_mode_in_the_meta(hopper, fmt):
    n, k = 256, 512
    weight = _weight(fmt, n, k)
    off = _prepare(weight, fmt, "off")
    res = _prepare(weight, fmt, "prefill-resident")
    per_call = _prepare(weight, fmt, "prefill")
    assert off.layout is res.layout is per_call.layout is Layout.MMA16X64
    assert (
        fp8_compute_of_meta(off.meta) == "off" and fp8_compute_of_meta(per_call.meta) == "prefill"
    )
    assert per_call.names == off.names and "fp8_resident_bytes" not in per_call.extra
    assert res.names == (*off.names, "fp8_weight", "fp8_scale")
    q, scale = res.tensors[-2:]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert scale.dtype == torch.float32 and scale.is_contiguous()
    size = fp8_compute.resident_bytes(n, k)
    assert res.extra["fp8_resident_bytes"] == size == q.numel() + scale.numel() * 4
    assert res.nbytes() == off.nbytes() + size
    for p in (off, res, per_call):
        assert decode_meta(p.meta_args()) == (p.layout, p.meta)
    # the copy is the checkpoint path's re-encoding (same bits, same scales)
    ck = fp8p.make_resident(weight.packed, weight.block_scale.view(torch.uint8),
                            getattr(weight, "global_scale", None), fmt=fmt, recipe="128x128",
                            impl="torch")  # fmt: skip
    assert torch.equal(q.view(torch.uint8), ck.q.view(torch.uint8))
    assert torch.equal(scale, ck.scale)


def test_prepare_leaves_weights_fp8_compute_cannot_take_weight_only(hopper, monkeypatch):
    odd = _prepare(_weight("nvfp4", 256, 320), "nvfp4", "prefill-resident")  # K % 128 != 0
    assert fp8_compute_of_meta(odd.meta) == "off" and "fp8_weight" not in odd.names
    monkeypatch.setattr(prepare, "_capability", lambda device: (8, 9))  # row-wise: not measured
    assert (
        fp8_compute_of_meta(_prepare(_weight("nvfp4", 256, 512), "nvfp4", "prefill").meta) == "off"
    )


def test_mxfp4_on_the_checkpoint_layout(hopper, caplog):
    """Scales spanning more than 18 binades keep the checkpoint layout; FP8 compute re-encodes
    from it; scales beyond the re-encoder's range keep the layer weight-only, with a warning."""
    n, k = 128, 512
    weight = _weight("mxfp4", n, k)
    weight.block_scale.view(torch.uint8)[0, 0] = 100  # 2^-27 next to ~2^-7: wide span
    res = _prepare(weight, "mxfp4", "prefill-resident")
    assert res.layout is Layout.CHECKPOINT and fp8_compute_of_meta(res.meta) == "prefill-resident"
    assert res.names[-2:] == fp8_compute.RESIDENT_NAMES
    weight.block_scale.view(torch.uint8)[0, 0] = 10  # 2^-117: outside 2^-100 .. 2^100
    with caplog.at_level(logging.WARNING, logger="quantdispatch"):
        kept = _prepare(weight, "mxfp4", "prefill-resident")
    assert fp8_compute_of_meta(kept.meta) == "off" and "fp8_weight" not in kept.names
    assert "FP8 compute off for this 128x512 weight" in caplog.text


def test_the_op_runs_the_fp8_prefill_linear_from_the_rows_m(hopper):
    """prefill-resident at M = 256 (the row's first M) through the custom op: bit-equal with
    fp8_prefill_linear_mma on the same tensors, with the bias; the checkpoint layout too."""
    emu = hopper("128x128")
    n, k, m = 256, 512, 256
    weight = _weight("nvfp4", n, k, seed=3)
    res = _prepare(weight, "nvfp4", "prefill-resident")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    y = _call(res, "nvfp4", x, bias)
    words, scales, gs = res.tensors[:3]
    want = fp8p.fp8_prefill_linear_mma(x, words, scales, gs, fmt="nvfp4", bias=bias,
                                       recipe="128x128", capability=(9, 0))  # fmt: skip
    assert torch.equal(y, want) and len(emu.calls) == 2
    ck = fp8p.fp8_prefill_linear(x, weight.packed, weight.block_scale.view(torch.uint8),
                                 weight.global_scale, fmt="nvfp4", bias=bias, recipe="128x128",
                                 capability=(9, 0), impl="torch")  # fmt: skip
    assert torch.equal(y, ck)


def test_per_call_re_encoding_from_m_4096(hopper):
    hopper("1x128")
    n, k, m = 64, 128, 4096  # K % 512 != 0: the 1x128 recipe
    weight = _weight("nvfp4", n, k, seed=5)
    per_call, res = (_prepare(weight, "nvfp4", mode) for mode in ("prefill", "prefill-resident"))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    y = _call(per_call, "nvfp4", x)
    assert y.shape == (m, n) and torch.equal(y, _call(res, "nvfp4", x))


def _h200():
    return preset_profile("h200").model_copy(update={"cuda_version": "13.0"})


def test_verify_reports_fp8_compute_apart_with_its_own_bounds(hopper):
    hopper("128x128")
    results, skipped = verify_mod.verify_fp8(
        ["nvfp4"], ("prefill-resident",), profile=_h200(), device=torch.device("cpu")
    )
    assert skipped == [] and {r.act_dtype for r in results} == {"bf16", "fp16"}
    for r in results:
        assert r.section == verify_mod.FP8_SECTION == "fp8 compute (lossy)"
        assert (r.backend, r.m, r.n, r.k) == ("triton", 256, 384, 512)
        assert r.bound == 0.06 and 0.02 < r.rel_err < 0.06  # e4m3 activations: ~3.4e-2
        assert 0 < r.bound_ratio <= 1 and r.ok
        assert r.note == "prefill-resident, from M >= 256"


def test_verify_says_what_it_could_not_check(hopper):
    profile = preset_profile("rtx4090")
    results, skipped = verify_mod.verify_fp8(["nvfp4"], ("prefill",), profile=profile)
    assert results == [] and len(skipped) == 2
    assert skipped[0].startswith("nvfp4 bf16 prefill: FP8 compute (prefill) not used: off on SM")


def test_verify_weight_only_checks_stay_weight_only(capsys, monkeypatch):
    """With the setting on, the weight-only rows keep their 1e-2 check (FP8 compute off for
    them) and the FP8 section is a separate block; here (a CPU) it says why nothing ran."""
    monkeypatch.setenv("QUANTDISPATCH_FP8_COMPUTE", "prefill")
    code = main(["verify", "--format", "nvfp4", "--json"])
    out = capsys.readouterr()
    assert code == 0
    rows = json.loads(out.out)
    assert rows and all(r["section"] == "weight-only" and r["bound_ratio"] is None for r in rows)
    assert "fp8 compute not checked: nvfp4 bf16: triton cannot run here" in out.err
    code = main(["verify", "--format", "mxfp4", "--fp8-compute"])
    text = capsys.readouterr().out
    assert code == 0
    head, _, fp8 = text.partition("\nfp8 compute (lossy): ")
    assert "reference" in head and "fp8" not in head.lower()
    assert fp8.startswith("the triton backend's FP8 compute vs float64 W4A16; rel.err <= 0.06")
    assert "not checked here: mxfp4 fp16: triton cannot run here" in fp8


def test_verify_checks_no_fp8_compute_while_it_is_off(capsys):
    assert main(["verify", "--format", "nvfp4"]) == 0
    assert "fp8 compute" not in capsys.readouterr().out

"""``quantdispatch verify``: run every backend that can run here on random data and compare it
with float64 maths, so a user sees that the numbers match before trusting a kernel.

Each check quantizes a random weight, runs the backend through ``QuantLinear`` (forced, so the
check covers it even when it is not the first choice), and reports ||out - ref|| / ||ref|| against
the bound for the activation dtype. W8A8 / W4A4 native kernels are compared with a reference
that quantizes activations the same way (the reference backend's emulation mode). These checks
run with FP8 compute off.

FP8 compute (lossy, opt-in: ``QUANTDISPATCH_FP8_COMPUTE``) is checked apart (:func:`verify_fp8`,
section "fp8 compute (lossy)"): the triton backend's NVFP4 / MXFP4 linear at its FP8 range's
first M, against the float64 W4A16 result, with its own bounds (quantdispatch.checking:
relative error <= FP8_REL_BOUND, every output within its proven componentwise bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantdispatch.checking import (
    FP8_BOUND_RATIO,
    FP8_REL_BOUND,
    bound_for,
    fp8_bound_ratio,
    linear_reference64,
    probe_weight,
    rel_error,
)
from quantdispatch.errors import BackendUnavailableError, format_error
from quantdispatch.formats import FP4_FORMATS

__all__ = ["FP8_SECTION", "VerifyResult", "verify", "verify_fp8"]

SHAPES = ((1, 384, 512), (33, 384, 512))  # (M, N, K): a GEMV-like and a tiled call
FP8_NK = (384, 512)  # FP8 compute: M is its range's first M
FP8_MODES = ("prefill", "prefill-resident")
WEIGHT_ONLY_SECTION = "weight-only"
FP8_SECTION = "fp8 compute (lossy)"


@dataclass
class VerifyResult:
    format: str
    act_dtype: str
    backend: str
    m: int
    n: int
    k: int
    rel_err: float
    bound: float
    ok: bool
    note: str = ""
    section: str = WEIGHT_ONLY_SECTION
    bound_ratio: float | None = None
    """FP8 compute: max |error| / its proven componentwise bound (must be <= 1)."""


def verify(formats: Sequence[str] | None = None) -> list[VerifyResult]:
    """Check every runnable backend on this machine; returns one result per (backend, shape)."""
    from quantdispatch.api import load_settings, select
    from quantdispatch.backends import get_facts
    from quantdispatch.device import device_profile
    from quantdispatch.formats import FORMATS, get_format
    from quantdispatch.layers import QuantLinear
    from quantdispatch.request import ACT_DTYPES

    _refuse_simulation()
    profile = device_profile(None)
    device = _device_of(profile)
    results: list[VerifyResult] = []
    gen = torch.Generator().manual_seed(0)
    for fmt in [get_format(f).name for f in formats] if formats else list(FORMATS):
        for act_name, act in ACT_DTYPES.items():
            decision = select(fmt, act_dtype=act, device=profile)
            runnable = [c.backend for c in decision.trace if c.accepted]
            for m, n, k in SHAPES:
                weight = probe_weight(fmt, n, k, gen)
                x = torch.randn(m, k, generator=gen).to(act)
                for backend in runnable:
                    # verify is the check itself: its layers run with the self-check off, and
                    # weight-only (FP8 compute has its own section: verify_fp8)
                    forced = load_settings(
                        {}, backend={fmt: backend}, self_check="off", fp8_compute="off"
                    )
                    layer = QuantLinear(weight, act_dtype=act, device=device, settings=forced)
                    native = not get_facts(backend).weight_only
                    ref = linear_reference64(fmt, weight, x, emulate=native)
                    out = layer(x.to(device))
                    err = rel_error(out, ref)
                    bound = bound_for(act, native)
                    results.append(
                        VerifyResult(
                            fmt,
                            act_name,
                            backend,
                            m,
                            n,
                            k,
                            err,
                            bound,
                            err < bound,
                            "vs emulated activations" if native else "",
                        )
                    )
    return results


def _refuse_simulation() -> None:
    from quantdispatch.api import current_settings

    if current_settings().device:
        raise BackendUnavailableError(
            format_error(
                f"QUANTDISPATCH_DEVICE={current_settings().device} simulates a GPU",
                "verify runs kernels, which only run on the probed device",
                "unset QUANTDISPATCH_DEVICE",
            )
        )


def _device_of(profile) -> torch.device:  # type: ignore[no-untyped-def]
    return torch.device("cuda", profile.index or 0) if profile.torch_cuda else torch.device("cpu")


def verify_fp8(
    formats: Sequence[str] | None = None,
    modes: Sequence[str] = FP8_MODES,
    *,
    profile: object = None,
    device: torch.device | None = None,
) -> tuple[list[VerifyResult], list[str]]:
    """Check FP8 compute (``modes``) on this machine: the triton backend's NVFP4 / MXFP4 linear
    (N, K = FP8_NK) at the first M of its FP8 range, per activation dtype. Returns the results
    and, for what could not run here, why (``profile`` / ``device``: tests simulate a GPU)."""
    from quantdispatch.backends import get_facts
    from quantdispatch.device import device_profile
    from quantdispatch.formats import get_format
    from quantdispatch.request import ACT_DTYPES, Request, Scheme

    if profile is None:
        _refuse_simulation()
        profile = device_profile(None)
    device = device if device is not None else _device_of(profile)
    names = [get_format(f).name for f in formats] if formats else list(FP4_FORMATS)
    results: list[VerifyResult] = []
    skipped: list[str] = []
    gen = torch.Generator().manual_seed(30)
    n, k = FP8_NK
    for fmt in [f for f in names if f in FP4_FORMATS]:
        for act_name, act in ACT_DTYPES.items():
            request = Request.make(fmt, "linear", act, Scheme.WEIGHT_ONLY, n=n, k=k)
            why = get_facts("triton").explain_unsupported(request, profile)  # type: ignore[arg-type]
            if why is not None:
                skipped.append(f"{fmt} {act_name}: triton cannot run here: {why}")
                continue
            for mode in modes:
                got = _fp8_check(fmt, act, mode, profile, device, gen)
                if isinstance(got, str):
                    skipped.append(f"{fmt} {act_name} {mode}: {got}")
                else:
                    results.append(got)
    return results, skipped


def _fp8_check(fmt, act, mode, profile, device, gen) -> VerifyResult | str:  # type: ignore[no-untyped-def]
    """One FP8 compute check through the layers' custom op, or why it cannot run here."""
    import quantdispatch.ops  # noqa: F401  (registers torch.ops.quantdispatch.*)
    from quantdispatch.api import load_settings, select
    from quantdispatch.backends import get_backend
    from quantdispatch.backends.base import as_op_tensors
    from quantdispatch.backends.triton import fp8_compute
    from quantdispatch.backends.triton.meta import fp8_compute_of_meta
    from quantdispatch.request import Scheme, dtype_name

    n, k = FP8_NK
    triton = get_backend("triton")
    settings = load_settings({}, backend={fmt: "triton"}, self_check="off", fp8_compute=mode)
    d = select(fmt, "linear", act, Scheme.WEIGHT_ONLY, n=n, k=k, device=profile,
               settings=settings)  # fmt: skip
    first = [r.first_m for r in d.kernel_ranges() if r.family == "fp8 prefill"]
    if not first:
        cuda = fp8_compute.cuda_of(profile.cuda_version)
        return fp8_compute.trace_note(fmt, n, k, act, profile.capability, mode, cuda)
    m = first[0]
    weight = probe_weight(fmt, n, k, gen, input_scale=None)
    prepared = triton.prepare(weight.to(device), d.request, options=d.options)
    if fp8_compute_of_meta(prepared.meta) != mode:
        return "prepare kept this weight weight-only here"
    x = torch.randn(m, k, generator=gen).to(act)
    out = torch.ops.quantdispatch.linear(
        x.to(device), as_op_tensors(list(prepared.tensors)), None, "triton", fmt,
        prepared.meta_args(), n,
    )  # fmt: skip
    err = rel_error(out, linear_reference64(fmt, weight, x))
    ratio = fp8_bound_ratio(fmt, weight, x, out, fp8_compute.recipe_for(k))
    return VerifyResult(
        fmt, dtype_name(act), "triton", m, n, k, err, FP8_REL_BOUND,
        err <= FP8_REL_BOUND and ratio <= FP8_BOUND_RATIO, f"{mode}, from M >= {m}",
        FP8_SECTION, ratio,
    )  # fmt: skip

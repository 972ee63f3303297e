"""``quantdispatch verify``: run every backend that can run here on random data and compare it
with float64 maths, so a user sees that the numbers match before trusting a kernel.

Each check quantizes a random weight, runs the backend through ``QuantLinear`` (forced, so the
check covers it even when it is not the first choice), and reports ||out - ref|| / ||ref|| against
the bound for the activation dtype. W8A8 / W4A4 native kernels are compared with a reference
that quantizes activations the same way (the reference backend's emulation mode).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from quantdispatch.errors import BackendUnavailableError, format_error

__all__ = ["VerifyResult", "run_verify", "verify"]

#: Bound on ||out - ref|| / ||ref|| per activation dtype: one rounding of the output plus fp32
#: accumulation order, with margin (bf16 half-ulp 2^-9 ~ 2e-3, fp16 2^-12 ~ 2.4e-4).
BOUNDS = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHAPES = ((1, 384, 512), (33, 384, 512))  # (M, N, K): a GEMV-like and a tiled call


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


def _weight(fmt: str, n: int, k: int, gen: torch.Generator):
    from quantdispatch.formats import quantize_fp8, quantize_mxfp4, quantize_nvfp4

    w = torch.randn(n, k, generator=gen) * 0.02
    w[0] *= 1e-3  # tiny rows: subnormal block scales
    if fmt == "nvfp4":
        return quantize_nvfp4(w, with_input_scale=0.05)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    return quantize_fp8(w, kind="channel")


def verify(formats: Sequence[str] | None = None) -> list[VerifyResult]:
    """Check every runnable backend on this machine; returns one result per (backend, shape)."""
    from quantdispatch.api import current_settings, load_settings, select
    from quantdispatch.backends import get_backend
    from quantdispatch.device import device_profile
    from quantdispatch.formats import FORMATS, get_format
    from quantdispatch.layers import QuantLinear
    from quantdispatch.request import ACT_DTYPES

    if current_settings().device:
        raise BackendUnavailableError(
            format_error(
                f"QUANTDISPATCH_DEVICE={current_settings().device} simulates a GPU",
                "verify runs kernels, which only run on the probed device",
                "unset QUANTDISPATCH_DEVICE",
            )
        )
    profile = device_profile(None)
    device = torch.device("cuda", profile.index or 0) if profile.torch_cuda else torch.device("cpu")
    results: list[VerifyResult] = []
    gen = torch.Generator().manual_seed(0)
    for fmt in [get_format(f).name for f in formats] if formats else list(FORMATS):
        for act_name, act in ACT_DTYPES.items():
            decision = select(fmt, act_dtype=act, device=profile)
            runnable = [c.backend for c in decision.trace if c.accepted]
            for m, n, k in SHAPES:
                weight = _weight(fmt, n, k, gen)
                x = torch.randn(m, k, generator=gen).to(act)
                for backend in runnable:
                    forced = load_settings({}, backend={fmt: backend})
                    layer = QuantLinear(weight, act_dtype=act, device=device, settings=forced)
                    native = not get_backend(backend).weight_only
                    ref_layer = QuantLinear(
                        weight,
                        act_dtype=act,
                        device="cpu",
                        settings=load_settings({}, backend={fmt: "reference"}),
                        emulate_activations=native,
                    )
                    ref = _float64_reference(ref_layer, x)
                    out = layer(x.to(device)).to("cpu", torch.float64)
                    finite = bool(torch.isfinite(out).all())
                    err = float((out - ref).norm() / ref.norm()) if finite else float("inf")
                    bound = BOUNDS[act] * (3 if native else 1)
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


def _float64_reference(ref_layer, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T in float64, W dequantized exactly (float32 dequant is exact for these formats)."""
    from quantdispatch.backends import get_backend
    from quantdispatch.formats import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4
    from quantdispatch.formats import fake_quantize_nvfp4_activations as fq

    weight = get_backend("reference").weight_object(
        ref_layer.format, ref_layer._tensors(), ref_layer._meta
    )
    dequant = {"nvfp4": dequantize_nvfp4, "mxfp4": dequantize_mxfp4, "fp8": dequantize_fp8}
    w64 = dequant[ref_layer.format](weight, dtype=torch.float64)
    xin = x
    if ref_layer._meta.emulate_activations:
        from quantdispatch.backends.reference import fake_quantize_fp8_activations

        if ref_layer.format == "nvfp4":
            xin = fq(x, weight.input_scale)
        else:
            xin = fake_quantize_fp8_activations(x, weight.input_scale)
    y = xin.to(torch.float64) @ w64.T
    if ref_layer.bias is not None:
        y = y + ref_layer.bias.to(torch.float64)
    return y


def run_verify(formats: Sequence[str] | None, *, as_json: bool) -> int:
    results = verify(formats)
    if as_json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(f"{'format':<7}{'act':<6}{'backend':<11}{'M':>4}{'N':>6}{'K':>6}  rel.err   bound   ")
        for r in results:
            status = "ok" if r.ok else "FAIL"
            print(
                f"{r.format:<7}{r.act_dtype:<6}{r.backend:<11}{r.m:>4}{r.n:>6}{r.k:>6}  "
                f"{r.rel_err:.1e}  {r.bound:.0e}  {status} {r.note}"
            )
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"quantdispatch: error: {len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0

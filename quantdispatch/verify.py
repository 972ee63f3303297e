"""``quantdispatch verify``: run every backend that can run here on random data and compare it
with float64 maths, so a user sees that the numbers match before trusting a kernel.

Each check quantizes a random weight, runs the backend through ``QuantLinear`` (forced, so the
check covers it even when it is not the first choice), and reports ||out - ref|| / ||ref|| against
the bound for the activation dtype. W8A8 / W4A4 native kernels are compared with a reference
that quantizes activations the same way (the reference backend's emulation mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quantdispatch.checking import bound_for, linear_reference64, probe_weight, rel_error
from quantdispatch.errors import BackendUnavailableError, format_error

__all__ = ["VerifyResult", "verify"]

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
                weight = probe_weight(fmt, n, k, gen)
                x = torch.randn(m, k, generator=gen).to(act)
                for backend in runnable:
                    # verify is the check itself: its layers run with the self-check off
                    forced = load_settings({}, backend={fmt: backend}, self_check="off")
                    layer = QuantLinear(weight, act_dtype=act, device=device, settings=forced)
                    native = not get_backend(backend).weight_only
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

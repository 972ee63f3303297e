"""First-use self-check: a backend is compared with float64 maths before its first layer runs.

The first time a backend is chosen for a request (format, op, scheme, activation dtype, FP8 scale
kind) on an environment (GPU name, compute capability, driver, CUDA, torch, the backend's kernel
provider and quantdispatch versions) with no recorded result, :func:`ensure_checked` runs a
small probe through the same custom op the layers call: linear at M = 1, 48 and 192 (N = 256,
K = 512, a bias on the middle one), MoE at M = 1 and 48 (4 experts, top-2, H = 256, I = 128,
SiLU), in the request's activation dtype. Each output is compared with float64 maths
(:mod:`quantdispatch.checking`: the bounds ``verify`` uses, the MoE GPU tests' for MoE; native
W4A4 / W8A8 backends against the emulated quantized activations).

* pass: recorded in ``$XDG_CACHE_HOME/quantdispatch/selfcheck.json`` (``~/.cache/...``), so
  later processes skip the probe (mode ``once``; ``always`` probes once per process);
* fail: recorded too (for ``doctor``), and the backend is rejected for this request for the
  rest of the process: :func:`failures_for` hands the resolver the reason with the measured
  error, the next candidate runs, and one warning names the fix. A later process probes again.

Never probed: the reference backend (it is the contract), a simulated device, a device that is
not a CUDA GPU (kernels run on the CPU only in tests), inside CUDA-graph capture or torch.compile
tracing (skipped, checked at the next eager construction), and with ``QUANTDISPATCH_SELF_CHECK=
off``. A corrupt or unwritable cache, or an entry that is not what a probe here recorded, is
ignored with one warning (:mod:`quantdispatch.selfcheck_cache` reads and writes the file).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantdispatch.selfcheck_cache import CheckResult, read_entries, record, recorded

if TYPE_CHECKING:
    from quantdispatch.device import DeviceProfile
    from quantdispatch.request import Request

__all__ = [
    "CACHE_FILE",
    "ELIGIBLE_DEVICE_TYPES",
    "CheckResult",
    "SelfCheckWarning",
    "cache_path",
    "ensure_checked",
    "environment_key",
    "failures_for",
    "probe_key",
    "reset",
    "results",
    "run_probe",
    "selfcheck_status",
    "skip_reason",
]

logger = logging.getLogger("quantdispatch")

CACHE_FILE = "selfcheck.json"
#: Device types the probe runs on (kernels run on the CPU only in tests, which widen this).
ELIGIBLE_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


class SelfCheckWarning(UserWarning):
    """A backend failed its self-check, or the self-check cache could not be used."""


_lock = threading.RLock()
_results: dict[tuple[str, str], CheckResult] = {}
"""(environment key, probe key) -> this process's result."""
_warned: set[object] = set()


def results() -> dict[tuple[str, str], CheckResult]:
    """This process's results: (environment key, probe key) -> result (a copy)."""
    with _lock:
        return dict(_results)


def reset() -> None:
    """Forget this process's results and warnings (tests; the disk cache stays)."""
    with _lock:
        _results.clear()
        _warned.clear()


# -- keys and the cache file ----------------------------------------------------------------------


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/quantdispatch/selfcheck.json``, else ``~/.cache/quantdispatch/...``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quantdispatch" / CACHE_FILE


def _provider_identity(backend: str, profile: DeviceProfile) -> str:
    """The kernel provider's name and version for ``backend`` (part of the environment key)."""
    from quantdispatch.backends import get_facts

    b = get_facts(backend)
    identity = b.selfcheck_identity(profile)
    if identity is not None:
        return identity
    if b.provider is not None:
        info = profile.provider(b.provider)
        return f"{info.name} {info.version or '?'}"
    return ""


def environment_key(backend: str, profile: DeviceProfile) -> str:
    """What a recorded result is valid for: GPU, driver, software and the backend's provider."""
    from quantdispatch import __version__

    parts = [
        profile.name,
        f"SM {profile.sm}",
        f"driver {profile.driver_version or '?'}",
        f"CUDA {profile.cuda_version or '?'}",
        f"torch {profile.torch_version}",
        f"quantdispatch {__version__}",
        f"{backend}: {_provider_identity(backend, profile)}",
    ]
    return " | ".join(parts)


def probe_key(backend: str, request: Request) -> str:
    """Which probe: backend, format, op, scheme, activation dtype, FP8 scale kind."""
    return " ".join(
        (
            backend,
            request.format,
            request.op.value,
            request.scheme_label,
            request.act_name,
            request.scale_kind or "-",
        )
    )


def _warn_once(key: object, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, SelfCheckWarning, stacklevel=4)


def _cache_warning(message: str) -> None:
    _warn_once("cache", message)


def _entries() -> dict:
    return read_entries(cache_path(), _cache_warning)


def _recorded(env: str, probe: str) -> CheckResult | None:
    return recorded(_entries(), env, probe, lambda m: _warn_once(("entry", env, probe), m))


def _record(env: str, probe: str, result: CheckResult) -> None:
    record(cache_path(), env, probe, result, _cache_warning)


# -- when the probe runs --------------------------------------------------------------------------


def _capturing_or_tracing() -> str | None:
    try:
        if torch.compiler.is_compiling():
            return "inside torch.compile tracing"
    except AttributeError:  # older torch without torch.compiler.is_compiling
        pass
    try:
        if torch.cuda.is_current_stream_capturing():
            return "inside CUDA-graph capture"
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA in this build
        pass
    return None


def skip_reason(
    backend: str, profile: DeviceProfile, device: torch.device | None, mode: str
) -> str | None:
    """Why no probe runs for ``backend`` here and now (None: it runs, or its result is known)."""
    if mode == "off":
        return "QUANTDISPATCH_SELF_CHECK=off"
    if backend == "reference":
        return "the reference backend is the contract the check compares with"
    if profile.simulated:
        return f"simulated device (preset {profile.preset!r})"
    if device is None or device.type not in ELIGIBLE_DEVICE_TYPES:
        return f"the layer runs on {device}, not a CUDA GPU"
    return _capturing_or_tracing()


def ensure_checked(
    backend: str,
    request: Request,
    profile: DeviceProfile,
    device: torch.device | None,
    mode: str = "once",
) -> CheckResult | None:
    """The self-check result for ``backend`` on this request here, probing if none is known.

    None when skipped (:func:`skip_reason`). A failure is kept for this process (see
    :func:`failures_for`) and warned about once."""
    if skip_reason(backend, profile, device, mode) is not None:
        return None
    assert device is not None
    env, probe = environment_key(backend, profile), probe_key(backend, request)
    with _lock:
        known = _results.get((env, probe))
        if known is not None:
            return known
        if mode == "once":
            found = _recorded(env, probe)
            if found is not None and found.passed:
                _results[(env, probe)] = found
                return found
        result = run_probe(backend, request, device)
        _results[(env, probe)] = result
    _record(env, probe, result)
    if result.passed:
        logger.info(
            "quantdispatch: self-check of %s for %s on %s passed in %.3f s (%s)",
            backend, request.describe(), profile.label(), result.seconds, result.detail,
        )  # fmt: skip
    else:
        _warn_once(
            (env, probe),
            f"quantdispatch: backend {backend!r} failed its self-check for {request.describe()} "
            f"on {profile.label()} ({result.detail}); it is not used for this in this process "
            f"and the next candidate runs. Fix: {_fix(backend, profile)}",
        )
    return result


def _fix(backend: str, profile: DeviceProfile) -> str:
    ident = _provider_identity(backend, profile)
    fix = f"set QUANTDISPATCH_DISABLE={backend} to skip it and its check"
    if ident and " " in ident:
        fix += f", or upgrade / reinstall {ident.rsplit(' ', 1)[0]} (found {ident})"
    return fix


def failures_for(request: Request, profile: DeviceProfile) -> dict[str, str]:
    """Backends that failed their self-check for ``request`` on ``profile`` in this process,
    with the reason the resolver shows (measured error and fix)."""
    out: dict[str, str] = {}
    with _lock:
        items = list(_results.items())
    for (env, probe), result in items:
        if result.passed:
            continue
        backend = result.backend
        if probe != probe_key(backend, request) or env != environment_key(backend, profile):
            continue
        out[backend] = f"{result.detail}; fix: {_fix(backend, profile)}"
    return out


# -- the probe ------------------------------------------------------------------------------------


def run_probe(backend: str, request: Request, device: torch.device) -> CheckResult:
    """Run the probe now (no cache): every call's error against float64 within its bound."""
    from quantdispatch.backends import get_backend
    from quantdispatch.checking import bound_for, probe_linear, probe_moe

    b = get_backend(backend)
    native = not b.facts.weight_only
    bound = bound_for(request.act_dtype, native, moe=request.op.value == "moe")
    start = time.perf_counter()
    errors: list[tuple[int, float]] = []
    try:
        if request.op.value == "moe":
            errors = probe_moe(b, request, device)
        else:
            errors = probe_linear(b, request, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # a kernel that cannot run here fails its check, with the error
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        detail = f"the probe raised {type(exc).__name__}: {msg}"[:400]
        return _result(backend, False, detail, float("inf"), start)
    worst = max(err / bound for _, err in errors)
    versus = "emulated quantized activations" if native else "float64"
    calls = ", ".join(f"M={m}: {err:.1e}" for m, err in errors)
    passed = worst < 1.0
    verdict = "within" if passed else "above"
    detail = f"rel. error {calls} vs {versus}, {verdict} the {request.act_name} bound {bound:.0e}"
    return _result(backend, passed, detail, worst, start)


def _result(backend: str, passed: bool, detail: str, worst: float, start: float) -> CheckResult:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return CheckResult(backend, passed, detail, worst, time.perf_counter() - start, now)


# -- for doctor -----------------------------------------------------------------------------------


def selfcheck_status(backend: str, profile: DeviceProfile) -> str:
    """One line for ``doctor``: "self-check passed on this GPU (date)", "not yet checked here"
    or "failed: ..." (this process's results first, then the cache file's)."""
    if backend == "reference":
        return "never checked: the reference backend is the contract the check compares with"
    if profile.simulated:
        return f"not checked: simulated device (preset {profile.preset!r})"
    if profile.kind not in ELIGIBLE_DEVICE_TYPES:
        return "not checked: not a CUDA GPU"
    env = environment_key(backend, profile)
    with _lock:
        mine = {p: r for (e, p), r in _results.items() if e == env}
    on_disk = {}
    for probe in _entries().get(env, {}):
        found = _recorded(env, probe)
        if found is not None:
            on_disk[probe] = found
    results = {**on_disk, **mine}
    if not results:
        return "not yet checked here"
    failed = {p: r for p, r in results.items() if not r.passed}
    if failed:
        probe, r = sorted(failed.items())[0]
        what = " ".join(probe.split(" ")[1:5])
        return f"failed: {what} ({r.date}): {r.detail}"
    last = max(r.date for r in results.values())
    checked = ", ".join(" ".join(p.split(" ")[1:5]) for p in sorted(results))
    return f"self-check passed on this GPU ({last}; {checked})"

"""The resolver: a pure function of (request, device profile, settings, policy) -> Decision.

It walks the policy's candidates for (format, op) in order and asks each backend whether it can
run the request on the device. The first that can is chosen; every candidate stays in the
trace, accepted or rejected with its reason. A forced backend that cannot run raises with its
own reason: forcing never falls back. Backends whose first-use self-check failed in this process
come in as data (``failed``: backend -> the measured reason) and are rejected with that reason.
The chosen backend's options (:meth:`Backend.options`, made from the settings and the policy)
go into the decision unread: layers hand them to that backend's prepare, doctor to its kernel
ranges.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quantdispatch.backends import get_facts
from quantdispatch.backends.facts import BackendFacts, KernelRange
from quantdispatch.device import DeviceProfile
from quantdispatch.errors import BackendUnavailableError, ConfigurationError, format_error
from quantdispatch.policy import Policy
from quantdispatch.request import Request
from quantdispatch.resolver_errors import forced_error, none_can_run_error
from quantdispatch.settings import ENV_PREFIX, Force, Settings

__all__ = ["Candidate", "Decision", "resolve"]


@dataclass(frozen=True)
class Candidate:
    """One line of a decision's trace."""

    backend: str
    accepted: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "accepted": self.accepted, "reason": self.reason}


@dataclass(frozen=True)
class Decision:
    """Which backend runs a request on a device, why, and why not each other candidate."""

    request: Request
    device: DeviceProfile
    backend: str
    reason: str
    trace: tuple[Candidate, ...]
    forced_by: str | None
    policy_source: str
    pdl: bool = True
    """Kernels may use programmatic dependent launches (the Settings.pdl it was made with);
    layers pass it to every call."""
    options: object = None
    """The chosen backend's options (:meth:`Backend.options`; None: it has none), opaque here:
    layers pass them to its prepare, doctor to its kernel ranges."""

    @property
    def is_fallback(self) -> bool:
        """True when a GPU ends up on the slow reference path without being asked to."""
        return self.backend == "reference" and self.device.is_gpu and self.forced_by is None

    def rejected(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.trace if not c.accepted)

    def explain(self) -> str:
        """The text ``quantdispatch doctor`` prints for this decision."""
        r = self.request
        lines = [f"{r.describe()} on {self.device.label()}"]
        for c in self.trace:
            mark = "->" if c.backend == self.backend else ("ok" if c.accepted else "no")
            reason = self.reason if c.backend == self.backend else c.reason
            lines.append(f"  {mark} {c.backend:<10} {reason}")
        return "\n".join(lines)

    def kernel_ranges(self, *, top_k: int | None = None) -> tuple[KernelRange, ...]:
        """The kernel family the chosen backend runs for each range of M, on this device."""
        facts = get_facts(self.backend)
        return facts.kernel_ranges(
            self.request, self.device, top_k=top_k, pdl=self.pdl, options=self.options
        )

    def options_dict(self) -> dict[str, Any]:
        """The chosen backend's options, JSON-ready (empty: it has none)."""
        return {} if self.options is None else dict(self.options.to_dict())  # type: ignore[attr-defined]

    def option_facts(self) -> dict[str, Any]:
        """What the chosen backend's options add to this decision's report (e.g. the bytes
        of an opt-in resident copy); empty: nothing."""
        facts = get_facts(self.backend)
        return facts.option_facts(self.request, self.device, self.options)

    def kernel_for(self, m: int, *, top_k: int | None = None) -> KernelRange:
        """The kernel family a call with ``m`` rows runs (the trace down to the kernel)."""
        if not isinstance(m, int) or m < 1:
            raise ConfigurationError(
                format_error(f"m={m!r}", "M is the number of rows, a positive int", "pass m >= 1")
            )
        for r in self.kernel_ranges(top_k=top_k):
            if r.covers(m):
                return r
        raise AssertionError(f"kernel ranges of {self.backend} do not cover M={m}")

    def unverified(self) -> str | None:
        """Why the chosen backend runs here only once its first-use self-check passes (None: it
        runs without that condition)."""
        return get_facts(self.backend).unverified_reason(self.request, self.device)

    def kernel_summary(self) -> str:
        """One short line: the kernel families the chosen backend runs for this request."""
        return get_facts(self.backend).kernel_summary(self.request, self.device)

    def summary(self) -> str:
        """One log line: which kernel runs and why."""
        return (
            f"{self.request.describe()} on {self.device.label()} -> {self.backend}: {self.reason}"
        )

    def to_dict(self) -> dict[str, Any]:
        r = self.request
        return {
            "format": r.format,
            "op": r.op.value,
            "act_dtype": r.act_name,
            "scheme": r.scheme.value,
            "scheme_label": r.scheme_label,
            "backend": self.backend,
            "reason": self.reason,
            "forced_by": self.forced_by,
            "policy": self.policy_source,
            **self.options_dict(),
            "trace": [c.to_dict() for c in self.trace],
        }


def _note(
    facts: BackendFacts,
    request: Request,
    profile: DeviceProfile,
    settings: Settings,
    policy: Policy,
) -> str:
    """A candidate's accepted note under its own options."""
    return facts.accepted_note(request, profile, facts.options(settings, policy))


def resolve(
    request: Request,
    profile: DeviceProfile,
    settings: Settings,
    policy: Policy,
    failed: Mapping[str, str] | None = None,
) -> Decision:
    """Decide which backend runs ``request`` on ``profile`` (cached: same inputs, same object).

    ``failed``: backends that failed their self-check for this request here, with the reason;
    they are rejected (a forced one raises)."""
    return _resolve(request, profile, settings, policy, tuple(sorted((failed or {}).items())))


@functools.lru_cache(maxsize=4096)
def _resolve(
    request: Request,
    profile: DeviceProfile,
    settings: Settings,
    policy: Policy,
    failed_items: tuple[tuple[str, str], ...] = (),
) -> Decision:
    failed = dict(failed_items)
    entry = policy.entry(request.format, request.op)
    forced = settings.forced(request.format, request.op)
    if forced is not None:
        if forced.backend in failed:
            raise BackendUnavailableError(
                format_error(
                    f"{forced.by} forces backend {forced.backend!r}, which failed its self-check "
                    f"for {request.describe()} on {profile.label()}: {failed[forced.backend]}",
                    "a forced backend never falls back silently",
                    f"unset {forced.by.split('=')[0]} to let the policy choose, or fix what the "
                    "self-check names",
                )
            )
        return _resolve_forced(
            request, profile, settings, policy, entry.candidates, entry.source, forced
        )

    trace: list[Candidate] = []
    chosen: str | None = None
    chosen_reason = ""
    for name in entry.candidates:
        backend = get_facts(name)
        if name in settings.disable:
            trace.append(Candidate(name, False, f"disabled by {ENV_PREFIX}DISABLE"))
            continue
        if name in failed:
            trace.append(Candidate(name, False, f"failed its self-check here: {failed[name]}"))
            continue
        why_not = backend.explain_unsupported(request, profile)
        if why_not is not None:
            trace.append(Candidate(name, False, why_not))
            continue
        note = _note(backend, request, profile, settings, policy)
        if chosen is None:
            chosen = name
            where = "first in" if not trace else "first that can run in"
            chosen_reason = f"{where} the policy order {' > '.join(entry.candidates)}: {note}"
            trace.append(Candidate(name, True, note))
        else:
            trace.append(Candidate(name, True, f"can run, ranked below {chosen}: {note}"))
    if chosen is None:
        rejected = tuple((c.backend, c.reason) for c in trace)
        raise none_can_run_error(
            request, profile, settings, entry.candidates, entry.source, rejected
        )
    return Decision(
        request=request,
        device=profile,
        backend=chosen,
        reason=chosen_reason,
        trace=tuple(trace),
        forced_by=None,
        policy_source=entry.source,
        pdl=settings.pdl,
        options=get_facts(chosen).options(settings, policy),
    )


def _resolve_forced(
    request: Request,
    profile: DeviceProfile,
    settings: Settings,
    policy: Policy,
    candidates: tuple[str, ...],
    source: str,
    forced: Force,
) -> Decision:
    name, by = forced.backend, forced.by
    backend = get_facts(name)
    why_not = backend.explain_unsupported(request, profile)
    if why_not is not None:
        raise forced_error(request, profile, settings, candidates, forced, why_not)
    trace = [
        Candidate(
            name, True, f"forced by {by}: {_note(backend, request, profile, settings, policy)}"
        )
    ]
    for other in candidates:
        if other != name:
            trace.append(Candidate(other, False, f"not considered: {by} forces {name}"))
    return Decision(
        request=request,
        device=profile,
        backend=name,
        reason=trace[0].reason,
        trace=tuple(trace),
        forced_by=by,
        policy_source=source,
        pdl=settings.pdl,
        options=backend.options(settings, policy),
    )

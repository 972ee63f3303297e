"""The resolver's two errors, each with a fix that works when followed: a forced backend that
cannot run the request, and a request no candidate can run. The fix is worked out from the
same facts the decision uses (which backends can run here, which ops a backend runs, what
QUANTDISPATCH_DISABLE holds, whether the policy lists the reference), so it never tells the user
to do what is already done or what fails as well. Each error also carries its parts (a short
headline, the rejected candidates, the fix) for ``doctor`` to lay out on lines of their own.
"""

from __future__ import annotations

from quantdispatch.backends import get_facts
from quantdispatch.device import DeviceProfile
from quantdispatch.errors import BackendUnavailableError, clauses, format_error
from quantdispatch.request import Op, Request
from quantdispatch.settings import ENV_PREFIX, Force, Settings, force_variable

__all__ = ["forced_error", "none_can_run_error"]


def _runs(name: str, request: Request, profile: DeviceProfile) -> bool:
    return get_facts(name).explain_unsupported(request, profile) is None


def _unset(by: str) -> str:
    """How to take a force away: unset its variable, or drop its key from the settings."""
    what = by.split("=", 1)[0]
    if what.startswith("settings."):
        return f"remove {what[len('settings.') :]} from the settings"
    return f"unset {what}"


def forced_error(
    request: Request,
    profile: DeviceProfile,
    settings: Settings,
    candidates: tuple[str, ...],
    forced: Force,
    why_not: str,
) -> BackendUnavailableError:
    """``forced`` names a backend that cannot run ``request`` here (``why_not``)."""
    name, by = forced.backend, forced.by
    fmt, op = request.format, request.op.value
    able = [c for c in candidates if c not in settings.disable and _runs(c, request, profile)]
    rule = "a forced backend never falls back silently"
    fix = _unset(by) + (f" (the policy then picks {able[0]})" if able else "")
    if forced.op is None:  # the per-format form reaches every op of the format
        rule += f"; {by} forces every op of {fmt}"
        computes = get_facts(name).supports.get(fmt, frozenset())
        runs = [
            o.value
            for o in Op
            if o in computes
            and o != request.op
            and _runs(name, Request.make(fmt, o, request.act_dtype, request.scheme), profile)
        ]
        if runs:
            narrow = " and ".join(f"{force_variable(fmt, o)}={name}" for o in runs)
            fix = f"{_unset(by)} and set {narrow} ({name} runs {fmt} {'/'.join(runs)} here)"
        else:
            fix += f" ({name} runs no {fmt} op here)" if not able else ""
    return BackendUnavailableError(
        format_error(
            f"{by} forces backend {name!r}, which cannot run {request.describe()} on "
            f"{profile.label()}: {why_not}",
            rule,
            fix,
        ),
        headline=f"forced {name} cannot run {fmt} {op} here",
        rejected=((name, why_not),),
        fix=fix,
    )


def none_can_run_error(
    request: Request,
    profile: DeviceProfile,
    settings: Settings,
    candidates: tuple[str, ...],
    source: str,
    rejected: tuple[tuple[str, str], ...],
) -> BackendUnavailableError:
    """Every candidate of the policy was rejected (``rejected``: backend, reason)."""
    disabled = [c for c in candidates if c in settings.disable and _runs(c, request, profile)]
    var = f"{ENV_PREFIX}DISABLE"
    if disabled:
        rest = sorted(settings.disable - set(disabled))
        enable = f"{var}={','.join(rest)}" if rest else f"unset {var}"
        fix = f"{enable} (it disables {', '.join(disabled)}, which can run it here)"
    elif "reference" not in candidates:
        fix = (
            f"add \"reference\" to the [{request.format}] {request.op.value} list in {source} "
            "(it runs everywhere)"
        )
    else:
        fix = "install what the reasons name (quantdispatch doctor --verbose shows each in full)"
    reasons = "; ".join(f"{b}: {clauses(r)[0]}" for b, r in rejected)
    return BackendUnavailableError(
        format_error(
            f"no backend can run {request.describe()} on {profile.label()} ({reasons})",
            f"the policy ({source}) lists {', '.join(candidates)}",
            fix,
        ),
        headline=f"no backend can run {request.format} {request.op.value} here",
        rejected=rejected,
        fix=fix,
    )

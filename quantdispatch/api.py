"""``select()``: the one call an engine makes to learn which backend runs a layer, and why.

Also the settings entry points bound to the package's names: :func:`load_settings` and
:func:`current_settings` check the environment against the registered formats, ops, backends
and device presets (``quantdispatch.settings`` imports none of those registries itself).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from quantdispatch import selfcheck
from quantdispatch.backends import backend_names
from quantdispatch.device import PRESETS, device_profile
from quantdispatch.formats import FORMATS
from quantdispatch.policy import Policy, load_policy
from quantdispatch.request import Op, Request, Scheme
from quantdispatch.resolver import Decision, resolve
from quantdispatch.settings import Registry, Settings
from quantdispatch.settings import current_settings as _current_settings
from quantdispatch.settings import load_settings as _load_settings

__all__ = ["current_settings", "load_settings", "select", "settings_registry"]

logger = logging.getLogger("quantdispatch")
_warned: set[tuple] = set()


@functools.cache
def settings_registry() -> Registry:
    """The names settings are checked against: every format, op, backend and device preset."""
    return Registry(
        formats=tuple(FORMATS),
        ops=tuple(op.value for op in Op),
        backends=tuple(backend_names()),
        presets=tuple(PRESETS),
    )


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from ``environ`` (default: the process environment) plus keyword overrides,
    e.g. ``load_settings({}, backend={"nvfp4": "reference"})`` (see quantdispatch.settings)."""
    return _load_settings(environ, registry=settings_registry(), **overrides)


def current_settings() -> Settings:
    """Settings of the process environment (cached until a relevant variable changes)."""
    return _current_settings(settings_registry())


def select(
    format: str,
    op: Op | str = "linear",
    act_dtype: torch.dtype | str = torch.bfloat16,
    scheme: Scheme | str | None = None,
    *,
    n: int | None = None,
    k: int | None = None,
    experts: int | None = None,
    scale_kind: str | None = None,
    device: object = None,
    settings: Settings | None = None,
    policy: Policy | str | Path | None = None,
    check_on: torch.device | str | None = None,
) -> Decision:
    """Decide which backend computes ``format``/``op`` here (or on ``device``) and why.

    ``device``: None (``QUANTDISPATCH_DEVICE`` or the current GPU or the CPU), a preset name to
    simulate (``"h100"``), ``"cuda:1"``, an index, or a DeviceProfile. ``settings`` default to the
    environment; ``policy`` to ``QUANTDISPATCH_POLICY`` laid over the packaged default.
    ``decision.explain()`` gives the text ``quantdispatch doctor`` prints.

    ``check_on``: the torch device a layer is being built on (layers pass it). The chosen backend
    then gets its first-use self-check there (quantdispatch.selfcheck, ``settings.self_check``);
    one that fails is rejected for this process and the next candidate is chosen (a forced one
    raises). Backends that failed earlier in this process are rejected either way.
    """
    request = Request.make(
        format, op, act_dtype, scheme, n=n, k=k, experts=experts, scale_kind=scale_kind
    )
    settings = settings if settings is not None else current_settings()
    if device is None and settings.device:
        device = settings.device
    profile = device_profile(device)
    if not isinstance(policy, Policy):
        policy = load_policy(policy if policy is not None else settings.policy)
    decision = resolve(request, profile, settings, policy, selfcheck.failures_for(request, profile))
    if check_on is not None:
        decision = _checked(decision, torch.device(check_on), settings, policy)
    _log_once(decision)
    return decision


def _checked(decision: Decision, device: torch.device, settings: Settings, policy: Policy):
    """The decision after the chosen backend's self-check: while the chosen one fails, resolve
    again with the failures as data (a forced backend that fails raises from resolve)."""
    request, profile = decision.request, decision.device
    unchecked: dict[str, str] = {}  # unverified backends refused because the check is off
    mode = settings.self_check
    while True:
        backend = decision.backend
        unverified = _unverified(backend, request, profile)
        if unverified and mode == "off" and not profile.simulated:
            unchecked[backend] = (
                f"{unverified}; it is taken only after its first-use self-check, which "
                "QUANTDISPATCH_SELF_CHECK=off turns off"
            )
        elif selfcheck.skip_reason(backend, profile, device, mode) is not None:
            return decision
        else:
            result = selfcheck.ensure_checked(backend, request, profile, device, mode)
            if result is None or result.passed:
                return decision
        failed = {**selfcheck.failures_for(request, profile), **unchecked}
        decision = resolve(request, profile, settings, policy, failed)


def _unverified(backend: str, request: Request, profile) -> str | None:
    """Why ``backend`` is accepted only behind the self-check here (None: it is not)."""
    from quantdispatch.backends import get_facts

    return get_facts(backend).unverified_reason(request, profile)


def _log_once(decision: Decision) -> None:
    """One log line per distinct decision on a real device: engines see which kernel runs."""
    key = (decision.request, decision.device, decision.backend)
    if decision.device.simulated or key in _warned:
        return
    _warned.add(key)
    if decision.is_fallback:
        reasons = "; ".join(f"{c.backend}: {c.reason}" for c in decision.rejected())
        logger.warning(
            "quantdispatch: %s falls back to the slow reference backend (%s)",
            f"{decision.request.describe()} on {decision.device.label()}",
            reasons,
        )
    else:
        logger.info("quantdispatch: %s", decision.summary())

"""``select()``: the one call an engine makes to learn which backend runs a layer, and why."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from quantdispatch.device import device_profile
from quantdispatch.policy import Policy, load_policy
from quantdispatch.request import Op, Request, Scheme
from quantdispatch.resolver import Decision, resolve
from quantdispatch.settings import Settings, current_settings

__all__ = ["select"]

logger = logging.getLogger("quantdispatch")
_warned: set[tuple] = set()


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
) -> Decision:
    """Decide which backend computes ``format``/``op`` here (or on ``device``) and why.

    ``device``: None (``QUANTDISPATCH_DEVICE`` or the current GPU or the CPU), a preset name to
    simulate (``"h100"``), ``"cuda:1"``, an index, or a DeviceProfile. ``settings`` default to the
    environment; ``policy`` to ``QUANTDISPATCH_POLICY`` laid over the packaged default.
    ``decision.explain()`` gives the text ``quantdispatch doctor`` prints.
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
    decision = resolve(request, profile, settings, policy)
    _log_once(decision)
    return decision


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

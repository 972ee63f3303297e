"""The triton backend's options: one object, :class:`TritonOptions`, made from the settings and
the policy (:meth:`TritonBackend.options`). The resolver hands it on without reading it
(``Decision.options``); prepare, the kernel ranges and the trace's words read it here.

Its one option is FP8 compute for prefill (opt-in, lossy: :mod:`.fp8_compute`), set by
``QUANTDISPATCH_FP8_COMPUTE`` / ``Settings.fp8_compute`` where set, else by the policy file's
top-level ``fp8_compute``, else off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantdispatch.settings import FP8_COMPUTE_MODES

if TYPE_CHECKING:
    from quantdispatch.policy import Policy
    from quantdispatch.settings import Settings

__all__ = ["TritonOptions", "fp8_compute_of", "options_of"]


@dataclass(frozen=True)
class TritonOptions:
    """``fp8_compute``: one of ``off``, ``prefill``, ``prefill-resident``; ``fp8_compute_by``:
    where it came from (for doctor)."""

    fp8_compute: str = FP8_COMPUTE_MODES[0]
    fp8_compute_by: str = "default"

    def to_dict(self) -> dict[str, object]:
        """What a decision's JSON says about them."""
        return {"fp8_compute": self.fp8_compute}


def fp8_compute_of(settings: Settings, policy: Policy) -> tuple[str, str]:
    """The FP8 compute mode and where it comes from: the settings' (the variable or an
    override) where set, else the policy file's ``fp8_compute``, else off."""
    if settings.fp8_compute_by is not None:
        return settings.fp8_compute, settings.fp8_compute_by
    found = policy.option("fp8_compute")
    if found is not None:
        return found[0], f"fp8_compute in {found[1]}"
    return FP8_COMPUTE_MODES[0], "default"


def options_of(settings: Settings, policy: Policy) -> TritonOptions:
    """The triton backend's options under ``settings`` and ``policy``."""
    return TritonOptions(*fp8_compute_of(settings, policy))

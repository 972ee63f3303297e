"""What a backend is, declaratively: what it can run and why not, the kernel family per M, the
words doctor prints, and the options it takes. Nothing here runs a kernel (the life cycle:
:mod:`.base`); the resolver and doctor read only this.

A backend never reads env vars and never ranks itself: the policy ranks, the settings force or
disable, the resolver decides. Its facts only answer "can you run this request on this device,
and if not, why" (``explain_unsupported``). A backend with options of its own makes them from
the settings and policy (:meth:`BackendFacts.options`); the resolver carries them in the
decision without reading them, and hands them back to that backend only.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from quantdispatch.capability import CapabilitySet, fmt_sm
from quantdispatch.kernels.regimes import m_span
from quantdispatch.request import Op, Request, Scheme

if TYPE_CHECKING:
    from quantdispatch.device import DeviceProfile
    from quantdispatch.policy import Policy
    from quantdispatch.settings import Settings

__all__ = ["BackendFacts", "KernelRange"]


@dataclass(frozen=True)
class KernelRange:
    """Which kernel family runs calls of ``first_m`` .. ``last_m`` rows (``last_m`` None: and
    above), with one line of detail (why, or its launch parameters)."""

    first_m: int
    last_m: int | None
    family: str
    detail: str = ""

    def covers(self, m: int) -> bool:
        return m >= self.first_m and (self.last_m is None or m <= self.last_m)

    def span(self) -> str:
        return m_span(self.first_m, self.last_m)

    def to_dict(self) -> dict[str, object]:
        return {
            "m_min": self.first_m,
            "m_max": self.last_m,
            "family": self.family,
            "detail": self.detail,
        }


class BackendFacts(ABC):
    """Base class: subclasses state what they run in class variables and why not in
    ``device_reasons`` / ``scheme_reasons`` / ``shape_reasons``."""

    name: ClassVar[str]
    title: ClassVar[str]
    """One line: what this backend is."""
    supports: ClassVar[dict[str, frozenset[Op]]]
    """The (format -> ops) this backend computes, implemented or not."""
    implemented: ClassVar[dict[str, frozenset[Op]]] = {}
    """The subset that quantdispatch has kernels for today."""
    provider: ClassVar[str | None] = None
    """Optional kernel library it needs (a name from ``quantdispatch.device.PROVIDERS``)."""
    weight_only: ClassVar[bool] = True
    """True if activations stay 16-bit (serves W4A16 and, saying so, W4A4 checkpoints)."""
    min_sm: ClassVar[tuple[CapabilitySet, CapabilitySet] | None] = None
    """The SMs a weight-only kernel runs on with fp16 and with bf16 activations (``at_least``
    sets: newer SMs run it too); None: its ``device_reasons`` state the rules."""

    def explain_unsupported(self, request: Request, profile: DeviceProfile) -> str | None:
        """None if this backend can run ``request`` on ``profile``, else every reason why not."""
        reasons = self.unsupported_reasons(request, profile)
        return "; ".join(reasons) if reasons else None

    def unsupported_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        """All reasons, capability first. Subclasses extend ``device_reasons``."""
        reasons: list[str] = []
        ops = self.supports.get(request.format)
        if ops is None or request.op not in ops:
            what = request.format if ops is None else f"{request.format} {request.op.value}"
            return [f"{self.name} does not compute {what}"]
        reasons += self.device_reasons(request, profile)
        reasons += self.scheme_reasons(request)
        reasons += self.shape_reasons(request)
        if self.provider is not None:
            info = profile.provider(self.provider)
            if not info.available:
                if (info.reason or "").startswith("ModuleNotFoundError"):
                    reasons.append(f"{info.name} is not installed ({info.install_hint})")
                else:
                    reasons.append(
                        f"{info.name} does not import ({info.reason}); {info.install_hint}"
                    )
        done = self.implemented.get(request.format, frozenset())
        if request.op not in done:
            variant = self.variant(request, profile)
            reasons.append(
                f"not implemented yet: quantdispatch has no {self.name} kernel binding for "
                f"{request.format} {request.op.value}" + (f" ({variant})" if variant else "")
            )
        return reasons

    def variant(self, request: Request, profile: DeviceProfile) -> str | None:
        """Which kernel family this request would use on this device, for messages."""
        return None

    def kernel_ranges(
        self,
        request: Request,
        profile: DeviceProfile,
        *,
        top_k: int | None = None,
        pdl: bool = True,
        options: object = None,
    ) -> tuple[KernelRange, ...]:
        """The kernel family for every range of M (MoE: ``top_k`` and the request's experts,
        N = I and K = H; ``pdl``: the decision's Settings.pdl; ``options``: the decision's
        options of this backend, :meth:`options`). Default: one family at every M."""
        return (KernelRange(1, None, self.name, self.title),)

    def kernel_summary(self, request: Request, profile: DeviceProfile) -> str:
        """One short line naming the kernel families this backend runs for ``request``."""
        return self.variant(request, profile) or self.title

    def device_reasons(self, request: Request, profile: DeviceProfile) -> list[str]:
        """Why the device (SM, dtype support, CUDA build) rules this backend out, if it does.
        Default: a CUDA GPU this torch drives, from :attr:`min_sm` on where that is set."""
        gpu = self.gpu_reasons(profile)
        if gpu or self.min_sm is None:
            return gpu
        return self.min_sm_reasons(profile, request, *self.min_sm)

    @staticmethod
    def group_reasons(request: Request) -> list[str]:
        """K must hold whole scale groups of the request's format."""
        from quantdispatch.formats import get_format

        group, k = get_format(request.format).group_size, request.k
        if group and k is not None and k % group != 0:
            return [f"K={k} is not a multiple of the {request.format} group size {group}"]
        return []

    def scheme_reasons(self, request: Request) -> list[str]:
        if not self.weight_only and request.scheme is Scheme.WEIGHT_ONLY:
            return [
                f"{self.name} quantizes activations (W{request.scheme_label[1]}A"
                f"{request.scheme_label[1]}), but this checkpoint is weight-only "
                f"({request.scheme_label}): that would change its numerics"
            ]
        return []

    def shape_reasons(self, request: Request) -> list[str]:
        return []

    def options(self, settings: Settings, policy: Policy) -> object:
        """This backend's options under ``settings`` and ``policy`` (None: it has none): an
        immutable object with ``to_dict()`` that only this backend reads."""
        return None

    def option_facts(self, request: Request, profile: DeviceProfile, options: object) -> dict:
        """Facts its options add to a decision's report (JSON-ready; empty: none)."""
        return {}

    def accepted_note(
        self, request: Request, profile: DeviceProfile, options: object = None
    ) -> str:
        """One line saying what will run, e.g. that a W4A4 checkpoint runs weight-only
        (``options``: this backend's, :meth:`options`)."""
        note = self.title
        variant = self.variant(request, profile)
        if variant:
            note += f" [{variant}]"
        if self.weight_only and request.scheme is Scheme.WEIGHT_ACT:
            note += (
                f"; runs the {request.scheme_label} checkpoint weight-only: activations stay "
                f"{request.act_name}, not quantized (close to, not bit-equal with, a native run)"
            )
        unverified = self.unverified_reason(request, profile)
        if unverified:
            note += f"; accepted only behind the first-use self-check: {unverified}"
        return note

    def unverified_reason(self, request: Request, profile: DeviceProfile) -> str | None:
        """Why it runs ``request`` here only once its first-use self-check passes (None: it
        runs without that condition)."""
        return None

    def selfcheck_identity(self, profile: DeviceProfile) -> str | None:
        """Its kernel provider's name and version for the self-check's cache key (None: the
        profile's provider of :attr:`provider`)."""
        return None

    # -- shared fact helpers ----------------------------------------------------------------

    @staticmethod
    def gpu_reasons(profile: DeviceProfile) -> list[str]:
        """A CUDA GPU that this torch build can drive."""
        if profile.kind != "cuda":
            return ["needs a CUDA GPU; this device is a CPU"]
        if not profile.torch_cuda:
            return [
                f"torch {profile.torch_version} cannot launch kernels on this GPU "
                "(install a CUDA build of torch)"
            ]
        return []

    @staticmethod
    def min_sm_reasons(
        profile: DeviceProfile,
        request: Request,
        fp16_min: CapabilitySet,
        bf16_min: CapabilitySet,
    ) -> list[str]:
        """Weight-only kernels are forward compatible: a minimum SM (an ``at_least`` set) per
        activation dtype."""
        cc = profile.capability
        if cc is None:
            return []
        need = bf16_min if request.act_name == "bf16" else fp16_min
        if cc not in fp16_min:
            low = fp16_min.at_least
            floor = fp16_min.name if low is None else f"SM {fmt_sm(low)}"
            return [f"SM {fmt_sm(cc)} is below {floor}, the minimum for this kernel"]
        if cc not in need:
            return [
                f"SM {fmt_sm(cc)} has no bf16 tensor cores (bf16 needs {need.name}); "
                "fp16 activations work here"
            ]
        return []

"""Typed settings from ``QUANTDISPATCH_*`` environment variables.

======================================  ========================================================
variable                                meaning
======================================  ========================================================
``QUANTDISPATCH_BACKEND_<FORMAT>``      force a backend for every op of a format
                                        (``..._NVFP4=triton``); a force never falls back
``QUANTDISPATCH_BACKEND_<FORMAT>_<OP>`` force one op (``..._NVFP4_MOE=triton``); wins for its op
``QUANTDISPATCH_DISABLE``               comma-separated backends never to choose (``marlin,torch``)
``QUANTDISPATCH_POLICY``                a policy TOML file laid over the packaged default
``QUANTDISPATCH_DEVICE``                a preset to simulate (explain only: kernels refuse to run)
``QUANTDISPATCH_PDL``                   ``0`` / ``false``: no programmatic dependent launches
                                        (default on where the GPU has them, SM 9.0+)
``QUANTDISPATCH_SELF_CHECK``            ``once`` (default): check a backend against float64 the
                                        first time it is chosen on this GPU / software, and
                                        remember a pass on disk; ``always``: every process;
                                        ``off``: never (quantdispatch.selfcheck)
``QUANTDISPATCH_FP8_COMPUTE``           lossy FP8 compute for prefill where the regime table
                                        enables it: ``off`` (default), ``prefill`` (FP4 weight
                                        re-encoded per call), ``prefill-resident`` (a resident
                                        FP8 copy); overrides the policy file's ``fp8_compute``
``SGLANG_FORCE_NVFP4_MARLIN=1``         SGLang's switch, read as ``..._BACKEND_NVFP4=marlin``
``load_settings(backend=...)``          ``{"nvfp4": "triton"}`` every op, ``{"nvfp4:moe": ...}``
                                        one op; merged over the variables
======================================  ========================================================

Two variables forcing one scope differently (``..._NVFP4`` and SGLang's switch) are an error; an
override replaces the variables' force of its scope. Unknown ``QUANTDISPATCH_*`` variables,
unknown names and malformed values are errors that list the valid values: a typo must not
silently change nothing. The valid names come in as a :class:`Registry` (``quantdispatch.api``
builds the package's): this module imports no registry.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NamedTuple

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from quantdispatch.errors import ConfigurationError, format_error

__all__ = [
    "ENV_PREFIX",
    "FP8_COMPUTE_MODES",
    "Force",
    "Registry",
    "Settings",
    "current_settings",
    "force_variable",
    "load_settings",
    "parse_fp8_compute",
    "parse_pdl",
    "parse_self_check",
]

ENV_PREFIX = "QUANTDISPATCH_"
BACKEND_PREFIX = ENV_PREFIX + "BACKEND_"
SGLANG_MARLIN_ENV = "SGLANG_FORCE_NVFP4_MARLIN"
_PLAIN_FIELDS = {"DISABLE": "disable", "POLICY": "policy", "DEVICE": "device", "PDL": "pdl"}
_PLAIN_FIELDS |= {"SELF_CHECK": "self_check", "FP8_COMPUTE": "fp8_compute"}
SELF_CHECK_MODES = ("once", "always", "off")
#: ``QUANTDISPATCH_FP8_COMPUTE`` / the policy file's ``fp8_compute`` (quantdispatch.resolver)
FP8_COMPUTE_MODES = ("off", "prefill", "prefill-resident")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_pdl(value: Any) -> bool:
    """``QUANTDISPATCH_PDL``: unset or empty -> True (the default), else a boolean word."""
    if value is None or isinstance(value, bool):
        return True if value is None else value
    flag = str(value).strip().lower()
    if flag == "" or flag in _TRUE:
        return True
    if flag in _FALSE:
        return False
    raise ValueError(
        format_error(
            f"{ENV_PREFIX}PDL={value!r} is not a boolean",
            "valid values: 1, true, yes, on (programmatic dependent launches where the GPU has "
            "them, the default) / 0, false, no, off (never)",
            f"set {ENV_PREFIX}PDL=0 or 1, or unset it",
        )
    )


def parse_self_check(value: Any) -> str:
    """``QUANTDISPATCH_SELF_CHECK``: unset or empty -> ``once``, else one of the modes."""
    if value is None or str(value).strip() == "":
        return "once"
    mode = str(value).strip().lower()
    if mode not in SELF_CHECK_MODES:
        raise ValueError(
            format_error(
                f"{ENV_PREFIX}SELF_CHECK={value!r} is not a self-check mode",
                "valid values: once (check a backend the first time it is chosen on this GPU "
                "and software, remember a pass; the default), always (every process), off",
                f"set {ENV_PREFIX}SELF_CHECK=once, always or off, or unset it",
            )
        )
    return mode


def parse_fp8_compute(value: Any, where: str = f"{ENV_PREFIX}FP8_COMPUTE") -> str:
    """One of :data:`FP8_COMPUTE_MODES`, case and spaces ignored (``where``: for the error)."""
    mode = str(value).strip().lower() if isinstance(value, str) else None
    if mode in FP8_COMPUTE_MODES:
        return mode
    valid = (
        "valid values: off (weight-only kernels at every M, the default), prefill (lossy FP8 "
        "compute from the regime table's M, the FP4 weight re-encoded per call), "
        "prefill-resident (the same on a resident FP8 copy of the weight)"
    )
    fix = f"set {where} to off, prefill or prefill-resident"
    raise ValueError(format_error(f"{where}={value!r} is not an FP8 compute mode", valid, fix))


@dataclass(frozen=True)
class Registry:
    """The names settings are checked against, in the order error messages list them."""

    formats: tuple[str, ...]
    ops: tuple[str, ...]
    backends: tuple[str, ...]
    presets: tuple[str, ...]


class Force(NamedTuple):
    """A forced backend for one (format, op): which, where it came from, and its scope."""

    backend: str
    by: str
    op: str | None
    """The op the force names, or None: the per-format form, which covers every op."""


def force_variable(fmt: str, op: str | None = None) -> str:
    """The variable that forces ``fmt`` (every op) or ``fmt``/``op``, e.g. ..._NVFP4_MOE."""
    return BACKEND_PREFIX + fmt.upper() + (f"_{op.upper()}" if op else "")


def _force_key(variable_suffix: str, registry: Registry) -> str:
    """``NVFP4`` -> ``nvfp4``; ``NVFP4_MOE`` -> ``nvfp4:moe`` (the override key form)."""
    rest = variable_suffix.lower()
    if rest in registry.formats:
        return rest
    fmt, sep, op = rest.rpartition("_")
    if sep and (fmt in registry.formats or op in registry.ops):
        return f"{fmt}:{op}"
    return rest


def _scope(key: object) -> str:
    """An override key as stored: ``"NVFP4:MOE "`` -> ``"nvfp4:moe"``."""
    return str(key).strip().lower()


_environ: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "quantdispatch_environ", default=None
)
_registry: contextvars.ContextVar[Registry | None] = contextvars.ContextVar(
    "quantdispatch_registry", default=None
)


def _names() -> Registry:
    registry = _registry.get()
    if registry is None:
        raise ValueError("Settings need the valid names: use load_settings(..., registry=...)")
    return registry


class _EnvSource:
    """Our variables from a snapshot of the environment (or load_settings' mapping)."""

    def __call__(self) -> dict[str, Any]:
        env = _environ.get()
        if env is None:
            env = environ_snapshot()
        registry = _names()
        values: dict[str, Any] = {}
        forced: dict[str, str] = {}
        forced_by: dict[str, str] = {}
        unknown: list[str] = []
        for key, raw in env.items():
            if key.startswith(BACKEND_PREFIX):
                scope = _force_key(key[len(BACKEND_PREFIX) :], registry)
                value = raw.strip().lower()
                if value in ("", "auto"):
                    continue
                forced[scope] = value
                forced_by[scope] = f"{key}={raw}"
            elif key.startswith(ENV_PREFIX):
                name = key[len(ENV_PREFIX) :]
                if name == "FP8_COMPUTE":
                    if raw.strip():  # empty: unset (the policy file's, else off)
                        values["fp8_compute"] = raw
                        values["fp8_compute_by"] = f"{key}={raw}"
                elif name in _PLAIN_FIELDS:
                    values[_PLAIN_FIELDS[name]] = raw
                else:
                    unknown.append(key)
        if unknown:
            valid = [
                BACKEND_PREFIX + "<FORMAT>",
                BACKEND_PREFIX + "<FORMAT>_<OP>",
                *(ENV_PREFIX + k for k in _PLAIN_FIELDS),
            ]
            raise ConfigurationError(
                format_error(
                    f"unknown environment variable(s) {', '.join(sorted(unknown))}",
                    f"quantdispatch reads {', '.join(valid)} and {SGLANG_MARLIN_ENV}",
                    "fix the spelling or unset them",
                )
            )
        if SGLANG_MARLIN_ENV in env:
            raw = env[SGLANG_MARLIN_ENV]
            flag = raw.strip().lower()
            if flag not in _TRUE | _FALSE:
                raise ConfigurationError(
                    format_error(
                        f"{SGLANG_MARLIN_ENV}={raw!r} is not a boolean",
                        "valid values: 1, true, yes, on / 0, false, no, off",
                        f"set {SGLANG_MARLIN_ENV}=1 to force marlin for nvfp4, or unset it",
                    )
                )
            if flag in _TRUE:
                if "nvfp4" in forced and forced["nvfp4"] != "marlin":
                    raise ConfigurationError(
                        format_error(
                            f"{SGLANG_MARLIN_ENV}={raw} forces marlin for nvfp4 but "
                            f"{forced_by['nvfp4']} forces {forced['nvfp4']}",
                            "one format can be forced to one backend",
                            "unset one of the two variables",
                        )
                    )
                forced.setdefault("nvfp4", "marlin")
                forced_by.setdefault("nvfp4", f"{SGLANG_MARLIN_ENV}={raw}")
        if forced:
            values["backend"] = forced
            values["forced_by"] = forced_by
        return values


class Settings(BaseModel):
    """Everything the environment can change about a decision. Frozen; compare by value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: dict[str, str] = Field(default_factory=dict)
    """Forced backends: ``"<format>"`` (every op) or ``"<format>:<op>"`` -> backend name."""
    forced_by: dict[str, str] = Field(default_factory=dict)
    """Where each force came from, e.g. ``{"nvfp4": "QUANTDISPATCH_BACKEND_NVFP4=marlin"}``."""
    disable: frozenset[str] = frozenset()
    policy: Path | None = None
    device: str | None = None
    pdl: bool = True
    """Kernels may use programmatic dependent launches (SM 9.0+); it changes no decision."""
    self_check: str = "once"
    """First-use self-check of a chosen backend: ``once``, ``always`` or ``off``."""
    fp8_compute: Annotated[str, BeforeValidator(parse_fp8_compute)] = "off"
    """FP8 compute for prefill (lossy); applies where set (``fp8_compute_by``: where, e.g.
    ``QUANTDISPATCH_FP8_COMPUTE=prefill``), else the policy file's (resolver.fp8_compute_of)."""
    fp8_compute_by: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _over_environment(cls, data: Any) -> dict[str, Any]:
        """Keyword values laid over the environment's (mappings merged key by key)."""
        values = _EnvSource()()
        for key, value in (data or {}).items():
            old = values.get(key)
            both = isinstance(value, Mapping) and isinstance(old, Mapping)
            values[key] = {**old, **value} if both else value
        return values

    @field_validator("backend", mode="before")
    @classmethod
    def _check_backend(cls, value: Any) -> dict[str, str]:
        if not isinstance(value, Mapping):
            raise ValueError(f"backend must be a mapping format -> backend, got {value!r}")
        registry = _names()
        formats, ops, backends = registry.formats, registry.ops, registry.backends
        out = {}
        for scope, name in value.items():
            f, _, op = _scope(scope).partition(":")
            b = str(name).strip().lower()
            variable = force_variable(f, op)
            if f not in formats:
                raise ValueError(
                    format_error(
                        f"{variable} names unknown format {f!r}",
                        f"valid formats: {', '.join(formats)}",
                        f"use {BACKEND_PREFIX}<FORMAT> or {BACKEND_PREFIX}<FORMAT>_<OP> with one "
                        "of those",
                    )
                )
            if op and op not in ops:
                raise ValueError(
                    format_error(
                        f"{variable} names unknown op {op!r} of format {f}",
                        f"valid ops: {', '.join(ops)}",
                        f"use {BACKEND_PREFIX}{f.upper()}_<OP> with one of those, or "
                        f"{force_variable(f)} for every op of {f}",
                    )
                )
            if b not in backends:
                raise ValueError(
                    format_error(
                        f"{variable}={name!r} names an unknown backend",
                        f"valid backends: {', '.join(backends)}",
                        "pick one of those, or unset the variable for automatic choice",
                    )
                )
            out[f"{f}:{op}" if op else f] = b
        return out

    @field_validator("disable", mode="before")
    @classmethod
    def _check_disable(cls, value: Any) -> frozenset[str]:
        if isinstance(value, str):
            items = [s.strip().lower() for s in value.split(",") if s.strip()]
        elif isinstance(value, (set, frozenset, list, tuple)):
            items = [str(s).strip().lower() for s in value]
        else:
            raise ValueError(f"disable must be a comma-separated string or a set, got {value!r}")
        backends = _names().backends
        bad = [s for s in items if s not in backends]
        if bad:
            raise ValueError(
                format_error(
                    f"{ENV_PREFIX}DISABLE names unknown backend(s) {', '.join(map(repr, bad))}",
                    f"valid backends: {', '.join(backends)}",
                    "list only those, comma-separated",
                )
            )
        return frozenset(items)

    @field_validator("pdl", mode="before")
    @classmethod
    def _check_pdl(cls, value: Any) -> bool:
        return parse_pdl(value)

    @field_validator("self_check", mode="before")
    @classmethod
    def _check_self_check(cls, value: Any) -> str:
        return parse_self_check(value)

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: Any) -> str | None:
        if value is None or str(value).strip() == "":
            return None
        presets = _names().presets
        key = str(value).strip().lower()
        if key not in presets:
            raise ValueError(
                format_error(
                    f"{ENV_PREFIX}DEVICE={value!r} is not a preset",
                    f"valid presets: {', '.join(presets)}",
                    "pick one of those to simulate that GPU, or unset it to probe this machine",
                )
            )
        return key

    @field_validator("policy", mode="before")
    @classmethod
    def _check_policy(cls, value: Any) -> Path | None:
        if value is None or str(value).strip() == "":
            return None
        path = Path(str(value)).expanduser()
        if not path.is_file():
            raise ValueError(
                format_error(
                    f"{ENV_PREFIX}POLICY={value!r}: no such file",
                    "the policy is a TOML file laid over the packaged default",
                    "point it at an existing file or unset it",
                )
            )
        return path

    @model_validator(mode="after")
    def _forced_not_disabled(self) -> Settings:
        for scope, name in self.backend.items():
            if name in self.disable:
                by = self.forced_by.get(scope, f"backend[{scope!r}]")
                raise ValueError(
                    format_error(
                        f"{by} forces {name!r}, which {ENV_PREFIX}DISABLE also disables",
                        "a backend cannot be forced and disabled at once",
                        "remove it from one of the two",
                    )
                )
        return self

    def forced(self, fmt: str, op: str) -> Force | None:
        """The force that applies to ``fmt``/``op``: its per-op one, else its per-format one."""
        op = str(op)  # an Op is a StrEnum: its str is its value
        for scope, scope_op in ((f"{fmt}:{op}", op), (fmt, None)):
            name = self.backend.get(scope)
            if name is not None:
                by = self.forced_by.get(scope, f"settings.backend[{scope!r}]={name}")
                return Force(name, by, scope_op)
        return None

    def cache_key(self) -> tuple:
        return (
            tuple(sorted(self.backend.items())),
            tuple(sorted(self.disable)),
            str(self.policy) if self.policy else None,
            self.device,
            self.fp8_compute,
            self.fp8_compute_by,
        )

    def __hash__(self) -> int:
        return hash(self.cache_key())

    def describe(self) -> dict[str, Any]:
        """JSON-ready view for doctor; ``forced`` is keyed like the overrides (``nvfp4:moe``)."""
        return {
            "forced": {
                scope: {"backend": b, "by": self.forced_by.get(scope)}
                for scope, b in sorted(self.backend.items())
            },
            "disabled": sorted(self.disable),
            "policy": str(self.policy) if self.policy else None,
            "device": self.device,
            "pdl": self.pdl,
            "self_check": self.self_check,
            "fp8_compute": self.fp8_compute,
            "fp8_compute_by": self.fp8_compute_by,
        }


def _clean(exc: ValidationError) -> str:
    msgs = []
    for err in exc.errors():
        msg = str(err.get("msg", ""))
        msgs.append(msg.removeprefix("Value error, "))
    return " | ".join(msgs)


def load_settings(
    environ: Mapping[str, str] | None = None, *, registry: Registry, **overrides: Any
) -> Settings:
    """Settings from ``environ`` (default: the process environment) plus keyword overrides,
    checked against ``registry``'s names."""
    backend = overrides.get("backend")
    if isinstance(backend, Mapping) and "forced_by" not in overrides:
        # Overrides merge over the environment's forces: say which force came from where.
        overrides["forced_by"] = {
            _scope(k): f"settings.backend[{_scope(k)!r}]={str(v).strip().lower()}"
            for k, v in backend.items()
        }
    if "fp8_compute" in overrides and "fp8_compute_by" not in overrides:  # it wins: say so
        overrides["fp8_compute_by"] = f"settings.fp8_compute={overrides['fp8_compute']!r}"
    env_token = _environ.set(environ)
    registry_token = _registry.set(registry)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigurationError(_clean(exc)) from None
    finally:
        _registry.reset(registry_token)
        _environ.reset(env_token)


_cache: dict[tuple[Registry, tuple[tuple[str, str], ...]], Settings] = {}


def current_settings(registry: Registry) -> Settings:
    """Settings of the current environment, re-read whenever the relevant variables change."""
    env = environ_snapshot()
    key = (registry, tuple(sorted(env.items())))
    if key not in _cache:
        _cache[key] = load_settings(env, registry=registry)
    return _cache[key]


def environ_snapshot() -> dict[str, str]:
    """Our variables; iterating ``os.environ`` raises if another thread deletes one meanwhile."""
    keys = [k for k in list(os.environ) if k.startswith(ENV_PREFIX) or k == SGLANG_MARLIN_ENV]
    return {k: v for k in keys if (v := os.environ.get(k)) is not None}

"""Typed settings from ``QUANTDISPATCH_*`` environment variables.

=================================  =============================================================
variable                           meaning
=================================  =============================================================
``QUANTDISPATCH_BACKEND_<FORMAT>`` force a backend for one format, e.g.
                                   ``QUANTDISPATCH_BACKEND_NVFP4=triton``. A forced backend that
                                   cannot run raises with its own reason; it never falls back.
``QUANTDISPATCH_DISABLE``          comma-separated backends never to choose, e.g. ``marlin,torch``
``QUANTDISPATCH_POLICY``           path of a policy TOML file laid over the packaged default
``QUANTDISPATCH_DEVICE``           a preset to simulate (explain only: kernels refuse to run)
``QUANTDISPATCH_PDL``              ``0`` / ``false``: no programmatic dependent launches (default
                                   on where the GPU has them, SM 9.0+; see kernels/gdc.py)
``SGLANG_FORCE_NVFP4_MARLIN=1``    SGLang's switch, read as ``QUANTDISPATCH_BACKEND_NVFP4=marlin``
=================================  =============================================================

Unknown ``QUANTDISPATCH_*`` variables, unknown names and malformed values are errors that list
the valid values: a typo must not silently change nothing.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from quantdispatch.errors import ConfigurationError, format_error

__all__ = ["ENV_PREFIX", "Settings", "current_settings", "load_settings", "parse_pdl"]

ENV_PREFIX = "QUANTDISPATCH_"
BACKEND_PREFIX = ENV_PREFIX + "BACKEND_"
SGLANG_MARLIN_ENV = "SGLANG_FORCE_NVFP4_MARLIN"
_PLAIN_FIELDS = {"DISABLE": "disable", "POLICY": "policy", "DEVICE": "device", "PDL": "pdl"}
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


_environ: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "quantdispatch_environ", default=None
)


def _valid_backends() -> list[str]:
    from quantdispatch.backends import backend_names

    return backend_names()


def _valid_formats() -> list[str]:
    from quantdispatch.formats import FORMATS

    return list(FORMATS)


class _EnvSource(PydanticBaseSettingsSource):
    """Reads our variables from the environment (or a mapping given to load_settings)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ does the work; pydantic-settings requires this hook

    def __call__(self) -> dict[str, Any]:
        env = _environ.get()
        if env is None:
            env = os.environ
        values: dict[str, Any] = {}
        forced: dict[str, str] = {}
        forced_by: dict[str, str] = {}
        unknown: list[str] = []
        for key, raw in env.items():
            if key.startswith(BACKEND_PREFIX):
                fmt = key[len(BACKEND_PREFIX) :].lower()
                value = raw.strip().lower()
                if value in ("", "auto"):
                    continue
                forced[fmt] = value
                forced_by[fmt] = f"{key}={raw}"
            elif key.startswith(ENV_PREFIX):
                name = key[len(ENV_PREFIX) :]
                if name in _PLAIN_FIELDS:
                    values[_PLAIN_FIELDS[name]] = raw
                else:
                    unknown.append(key)
        if unknown:
            valid = [BACKEND_PREFIX + "<FORMAT>", *(ENV_PREFIX + k for k in _PLAIN_FIELDS)]
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


class Settings(BaseSettings):
    """Everything the environment can change about a decision. Frozen; compare by value."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    backend: dict[str, str] = Field(default_factory=dict)
    """Forced backend per format (format -> backend name)."""
    forced_by: dict[str, str] = Field(default_factory=dict)
    """Where each force came from, e.g. ``{"nvfp4": "QUANTDISPATCH_BACKEND_NVFP4=marlin"}``."""
    disable: Annotated[frozenset[str], NoDecode] = frozenset()
    policy: Path | None = None
    device: str | None = None
    pdl: bool = True
    """Kernels may use programmatic dependent launches (SM 9.0+); it changes no decision."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _EnvSource(settings_cls))

    @field_validator("backend", mode="before")
    @classmethod
    def _check_backend(cls, value: Any) -> dict[str, str]:
        if not isinstance(value, Mapping):
            raise ValueError(f"backend must be a mapping format -> backend, got {value!r}")
        formats, backends = _valid_formats(), _valid_backends()
        out = {}
        for fmt, name in value.items():
            f, b = str(fmt).lower(), str(name).strip().lower()
            if f not in formats:
                raise ValueError(
                    format_error(
                        f"{BACKEND_PREFIX}{f.upper()} names unknown format {f!r}",
                        f"valid formats: {', '.join(formats)}",
                        f"use {BACKEND_PREFIX}<FORMAT> with one of those",
                    )
                )
            if b not in backends:
                raise ValueError(
                    format_error(
                        f"{BACKEND_PREFIX}{f.upper()}={name!r} names an unknown backend",
                        f"valid backends: {', '.join(backends)}",
                        "pick one of those, or unset the variable for automatic choice",
                    )
                )
            out[f] = b
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
        backends = _valid_backends()
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

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: Any) -> str | None:
        if value is None or str(value).strip() == "":
            return None
        from quantdispatch.device import PRESETS

        key = str(value).strip().lower()
        if key not in PRESETS:
            raise ValueError(
                format_error(
                    f"{ENV_PREFIX}DEVICE={value!r} is not a preset",
                    f"valid presets: {', '.join(PRESETS)}",
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
        for fmt, name in self.backend.items():
            if name in self.disable:
                by = self.forced_by.get(fmt, f"backend[{fmt!r}]")
                raise ValueError(
                    format_error(
                        f"{by} forces {name!r}, which {ENV_PREFIX}DISABLE also disables",
                        "a backend cannot be forced and disabled at once",
                        "remove it from one of the two",
                    )
                )
        return self

    def forced(self, fmt: str) -> tuple[str, str] | None:
        """(backend, where the force came from) for a format, or None."""
        name = self.backend.get(fmt)
        if name is None:
            return None
        return name, self.forced_by.get(fmt, f"settings.backend[{fmt!r}]={name}")

    def cache_key(self) -> tuple:
        return (
            tuple(sorted(self.backend.items())),
            tuple(sorted(self.disable)),
            str(self.policy) if self.policy else None,
            self.device,
        )

    def __hash__(self) -> int:
        return hash(self.cache_key())

    def describe(self) -> dict[str, Any]:
        """JSON-ready view for doctor."""
        return {
            "forced": {
                f: {"backend": b, "by": self.forced_by.get(f)} for f, b in self.backend.items()
            },
            "disabled": sorted(self.disable),
            "policy": str(self.policy) if self.policy else None,
            "device": self.device,
            "pdl": self.pdl,
        }


def _clean(exc: ValidationError) -> str:
    msgs = []
    for err in exc.errors():
        msg = str(err.get("msg", ""))
        msgs.append(msg.removeprefix("Value error, "))
    return " | ".join(msgs)


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from ``environ`` (default: the process environment) plus keyword overrides."""
    token = _environ.set(environ)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigurationError(_clean(exc)) from None
    finally:
        _environ.reset(token)


_cache: dict[tuple[tuple[str, str], ...], Settings] = {}


def current_settings() -> Settings:
    """Settings of the current environment, re-read whenever the relevant variables change."""
    key = tuple(
        sorted(
            (k, v)
            for k, v in os.environ.items()
            if k.startswith(ENV_PREFIX) or k == SGLANG_MARLIN_ENV
        )
    )
    if key not in _cache:
        _cache[key] = load_settings()
    return _cache[key]

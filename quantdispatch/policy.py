"""Policy tables: the preference order of backends per (format, op), as validated data.

The packaged default lives in ``policies/default.toml`` (shipped as ``quantdispatch.policies``).
A user or engine file is laid over it: the (format, op) entries it has replace the default's,
the others stay. Top-level keys besides ``version`` are backend options (:data:`OPTION_KEYS`),
kept as strings for the backend that reads them: ``fp8_compute = "off" | "prefill" |
"prefill-resident"`` is the triton backend's FP8 compute (``QUANTDISPATCH_FP8_COMPUTE`` wins over
it; quantdispatch.settings says what the modes do). The last file that sets an option wins.
Every problem in a file is an error naming the file, the key and the valid values.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import stat
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from quantdispatch.errors import ConfigurationError, format_error
from quantdispatch.request import Op
from quantdispatch.settings import FP8_COMPUTE_MODES, parse_fp8_compute

__all__ = ["DEFAULT_POLICY_NAME", "Policy", "default_policy", "load_policy", "parse_policy"]

DEFAULT_POLICY_NAME = "default.toml"
SCHEMA_VERSION = 1


class _Option(NamedTuple):
    """A top-level option: its value's parser (raises ValueError) and the error's words."""

    parse: Callable[[object], str]
    what: str
    valid: str
    fix: str


#: The top-level option keys a policy file may set.
OPTION_KEYS = {
    "fp8_compute": _Option(
        lambda v: parse_fp8_compute(v, "fp8_compute"),
        "unknown FP8 compute mode",
        f"valid values: {', '.join(FP8_COMPUTE_MODES)} (off: weight-only kernels at every M; "
        "prefill: lossy FP8 compute, the weight re-encoded per call; prefill-resident: on a "
        "resident FP8 copy)",
        'write fp8_compute = "off" (or leave it out)',
    ),
}


class PolicyEntry(BaseModel):
    model_config = ConfigDict(frozen=True)

    format: str
    op: Op
    candidates: tuple[str, ...]
    source: str
    """The file this entry came from."""


class Policy(BaseModel):
    """Ordered candidates per (format, op), with the file each entry came from."""

    model_config = ConfigDict(frozen=True)

    entries: tuple[PolicyEntry, ...]
    sources: tuple[str, ...]
    options: tuple[tuple[str, str, str], ...] = ()
    """The top-level options the files set: (key, value, the file it came from)."""

    def option(self, key: str) -> tuple[str, str] | None:
        """(value, file) of the top-level option ``key`` (None: no file sets it)."""
        return next(((v, src) for k, v, src in self.options if k == key), None)

    def entry(self, fmt: str, op: Op) -> PolicyEntry:
        for e in self.entries:
            if e.format == fmt and e.op == op:
                return e
        raise ConfigurationError(
            format_error(
                f"the policy ({' + '.join(self.sources)}) has no entry for {fmt}.{op.value}",
                "every (format, op) a layer asks for needs an ordered list of backends",
                f"add [{fmt}] {op.value} = [...] to your policy file",
            )
        )

    def candidates(self, fmt: str, op: Op) -> tuple[str, ...]:
        return self.entry(fmt, op).candidates

    def __hash__(self) -> int:
        return hash((self.entries, self.sources, self.options))

    def overlay(self, other: Policy) -> Policy:
        """This policy with ``other``'s entries replacing ours for the same (format, op), and
        its options replacing ours for the same key."""
        replaced = {(e.format, e.op) for e in other.entries}
        kept = tuple(e for e in self.entries if (e.format, e.op) not in replaced)
        theirs = {k for k, _, _ in other.options}
        options = tuple(o for o in self.options if o[0] not in theirs) + other.options
        return Policy(
            entries=kept + other.entries, sources=self.sources + other.sources, options=options
        )


def _fail(source: str, key: str, what: str, valid: str, fix: str) -> ConfigurationError:
    return ConfigurationError(
        format_error(f"policy file {source}, key {key!r}: {what}", valid, fix)
    )


def parse_policy(data: dict[str, Any], source: str) -> Policy:
    """Validate a parsed TOML mapping. ``source`` names the file in error messages."""
    from quantdispatch.backends import backend_names
    from quantdispatch.formats import FORMATS

    formats = list(FORMATS)
    backends = backend_names()
    if not isinstance(data, dict):
        raise _fail(source, "<top>", "not a table", "a TOML file of [format] tables", "")
    version = data.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise _fail(
            source,
            "version",
            f"unsupported version {version!r}",
            f"this quantdispatch reads version {SCHEMA_VERSION}",
            f"set version = {SCHEMA_VERSION}",
        )
    options = tuple((k, _option(k, data[k], source), source) for k in OPTION_KEYS if k in data)
    entries: list[PolicyEntry] = []
    for fmt, table in data.items():
        if fmt == "version" or fmt in OPTION_KEYS:
            continue
        if fmt not in formats:
            keys = ", ".join(repr(k) for k in ("version", *OPTION_KEYS))
            raise _fail(
                source,
                fmt,
                "unknown format",
                f"valid formats: {', '.join(formats)} (and the keys {keys})",
                "rename or remove that table",
            )
        entries += _format_entries(fmt, table, source, backends)
    return Policy(entries=tuple(entries), sources=(source,), options=options)


def _option(key: str, value: object, source: str) -> str:
    """A top-level option's value, checked by its parser (:data:`OPTION_KEYS`)."""
    option = OPTION_KEYS[key]
    try:
        return option.parse(value)
    except ValueError:
        raise _fail(source, key, f"{option.what} {value!r}", option.valid, option.fix) from None


def _format_entries(fmt: str, table: object, source: str, backends: list[str]) -> list[PolicyEntry]:
    """The entries of one ``[format]`` table: op = [backends]."""
    ops = [o.value for o in Op]
    if not isinstance(table, dict):
        raise _fail(
            source,
            fmt,
            f"expected a table of op = [backends], got {type(table).__name__}",
            f"valid ops: {', '.join(ops)}",
            f'write [{fmt}] then linear = ["triton", "reference"]',
        )
    entries = []
    for op, cands in table.items():
        key = f"{fmt}.{op}"
        if op not in ops:
            raise _fail(
                source, key, "unknown op", f"valid ops: {', '.join(ops)}", "rename or remove it"
            )
        names = _candidates(key, op, cands, source, backends)
        entries.append(PolicyEntry(format=fmt, op=Op(op), candidates=names, source=source))
    return entries


def _candidates(
    key: str, op: str, cands: object, source: str, backends: list[str]
) -> tuple[str, ...]:
    """One op's list of backend names, checked: names known, none twice, at least one."""
    if not isinstance(cands, list) or not all(isinstance(c, str) for c in cands):
        raise _fail(
            source,
            key,
            f"expected a list of backend names, got {cands!r}",
            f"valid backends: {', '.join(backends)}",
            f'write {op} = ["triton", "reference"]',
        )
    if not cands:
        raise _fail(
            source,
            key,
            "empty list",
            "each entry lists at least one backend",
            'end every list with "reference", which runs everywhere',
        )
    names = [c.strip().lower() for c in cands]
    unknown = [c for c in names if c not in backends]
    if unknown:
        raise _fail(
            source,
            key,
            f"unknown backend(s) {', '.join(map(repr, unknown))}",
            f"valid backends: {', '.join(backends)}",
            "fix the names",
        )
    dups = sorted({c for c in names if names.count(c) > 1})
    if dups:
        raise _fail(
            source,
            key,
            f"duplicate backend(s) {', '.join(map(repr, dups))}",
            "each backend appears once per list",
            "remove the repeats",
        )
    return tuple(names)


def _read_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ConfigurationError(
            format_error(
                f"policy file {source} is not valid TOML: {exc}",
                "policy files are TOML",
                "fix the syntax (quantdispatch doctor validates it)",
            )
        ) from None


@functools.lru_cache(maxsize=1)
def default_policy() -> Policy:
    """The packaged default policy (validated once)."""
    source = f"<packaged>/{DEFAULT_POLICY_NAME}"
    try:
        res = importlib.resources.files("quantdispatch.policies").joinpath(DEFAULT_POLICY_NAME)
        text = res.read_text(encoding="utf-8")
    except ModuleNotFoundError:
        # Running from a source tree without installing (PYTHONPATH=checkout): the table is in
        # the top-level policies/ folder that the wheel maps to quantdispatch.policies.
        path = Path(__file__).resolve().parent.parent / "policies" / DEFAULT_POLICY_NAME
        text, source = path.read_text(encoding="utf-8"), str(path)
    return parse_policy(_read_toml(text, source), source)


#: Largest policy file read (a policy is a few hundred bytes).
MAX_POLICY_BYTES = 1 << 20


def _unreadable(shown: str, what: str, fix: str = "check the path") -> ConfigurationError:
    return ConfigurationError(
        format_error(f"policy file {shown} {what}", "a policy is a regular UTF-8 TOML file", fix)
    )


def _read_policy_bytes(path: Path, shown: str) -> bytes:
    """The bytes of a regular file of at most MAX_POLICY_BYTES; anything else (a directory, a
    FIFO, a device such as /dev/zero, a huge file) is refused without blocking on it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise _unreadable(shown, f"cannot be read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise _unreadable(shown, f"is {kind}", "pass the path of a .toml file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise _unreadable(shown, f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_POLICY_BYTES:
        raise _unreadable(shown, f"is larger than {MAX_POLICY_BYTES >> 10} KiB")
    return data


@functools.lru_cache(maxsize=32)
def _parse_file(path: str, data: bytes) -> Policy:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _unreadable(
            path, f"is not UTF-8 ({exc.reason} at byte {exc.start})", "save it as UTF-8"
        ) from None
    return parse_policy(_read_toml(text, path), path)


def load_policy(path: str | Path | None = None) -> Policy:
    """The default policy, with the file at ``path`` (if any) laid over it. The file is read
    at every call (it is small) and parsed once per content, so a rewrite is always seen."""
    base = default_policy()
    if path is None:
        return base
    p = Path(path).expanduser()
    return base.overlay(_parse_file(str(p), _read_policy_bytes(p, repr(str(path)))))

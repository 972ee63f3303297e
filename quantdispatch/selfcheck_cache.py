"""The self-check cache file: results shared by every process of a user (and of containers that
mount the same home), so it is parsed, not trusted, and written under a lock.

* Read: at most ``MAX_BYTES``, UTF-8 JSON, a declared schema per entry. An entry counts only if
  it is what :func:`record` writes: typed fields, its ``backend`` the probe's, ``passed`` exactly
  ``worst < 1``, and a digest binding it to its environment and probe keys (an entry edited by
  hand, or copied from another GPU or software version, does not match). Anything else is
  ignored with one warning, probed again and rewritten.
* Write: read-modify-write under a file lock (``filelock``) next to the file, into a temporary
  file with a unique name in the same directory, then an atomic ``os.replace``: concurrent
  writers in several processes keep every entry, and a reader never sees half a file.

The digest detects damage and mix-ups, not a forger with write access to the cache (who could
replace the installed package as easily).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictStr, ValidationError

__all__ = ["FILE_VERSION", "MAX_BYTES", "CheckResult", "read_entries", "record", "recorded"]

FILE_VERSION = 2
#: Largest cache file read (an entry is ~0.5 kB).
MAX_BYTES = 16 << 20
#: Seconds a writer waits for the lock before keeping its result in memory only.
LOCK_SECONDS = 10.0

Warn = Callable[[str], None]


@dataclass(frozen=True)
class CheckResult:
    """One probe's outcome: ``worst`` is the largest error / bound ratio over its calls."""

    backend: str
    passed: bool
    detail: str
    worst: float
    seconds: float
    date: str

    def reason(self) -> str:
        return self.detail


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    backend: StrictStr
    passed: StrictBool
    detail: StrictStr
    worst: StrictFloat | int
    seconds: StrictFloat | int
    date: StrictStr
    digest: StrictStr


class _File(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)

    version: Literal[2]
    entries: dict[StrictStr, dict[StrictStr, Any]]


def _digest(env: str, probe: str, result: CheckResult) -> str:
    body = json.dumps([env, probe, asdict(result)], sort_keys=True, allow_nan=True)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def _parse(data: bytes) -> dict[str, dict[str, Any]]:
    """The entries of a cache file's bytes; ValueError says what is wrong."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        raw = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    version = raw.get("version") if isinstance(raw, dict) else None
    if version in range(1, FILE_VERSION):
        return {}  # an older quantdispatch's file: re-probed and rewritten, nothing to warn
    if version != FILE_VERSION:
        raise ValueError(f"not a version-{FILE_VERSION} self-check cache (version {version!r})")
    try:
        return dict(_File.model_validate(raw).entries)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise ValueError(f"{where}: {err.get('msg')}") from None


def read_entries(path: Path, warn: Warn) -> dict[str, dict[str, Any]]:
    """{environment: {probe: raw entry}}; a missing file is empty, an unreadable or malformed
    one is empty with a warning (it is rewritten at the next record)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as exc:
        warn(f"quantdispatch: self-check cache {path} is unreadable ({exc})")
        return {}
    try:
        return _parse(data)
    except ValueError as exc:
        warn(
            f"quantdispatch: self-check cache {path} is corrupt ({exc}); ignored (it is "
            "rewritten at the next recorded check; delete it to silence this)"
        )
        return {}


def recorded(
    entries: dict[str, dict[str, Any]], env: str, probe: str, warn: Warn
) -> CheckResult | None:
    """The valid recorded result of (env, probe), or None (an invalid one is warned about)."""
    raw = entries.get(env, {}).get(probe)
    if raw is None:
        return None
    problem = None
    try:
        entry = _Entry.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        problem = f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}"
    else:
        fields = entry.model_dump(exclude={"digest"})
        result = CheckResult(**{**fields, "worst": float(entry.worst)})
        if entry.backend != probe.split(" ", 1)[0]:
            problem = f"backend {entry.backend!r} is not the probe's"
        elif entry.passed != (math.isfinite(result.worst) and result.worst < 1.0):
            problem = f"passed={entry.passed} disagrees with worst={entry.worst}"
        elif entry.digest != _digest(env, probe, result):
            problem = "its digest does not match (edited, or copied from another environment)"
        else:
            return result
    warn(
        f"quantdispatch: self-check cache entry for {probe!r} ignored ({problem}); the backend "
        "is probed again and the entry rewritten"
    )
    return None


def record(path: Path, env: str, probe: str, result: CheckResult, warn: Warn) -> None:
    """Add one result to the cache file (locked read-modify-write, atomic replace)."""
    from filelock import FileLock, Timeout

    entry = {**asdict(result), "digest": _digest(env, probe, result)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path.with_name(path.name + ".lock")), timeout=LOCK_SECONDS):
            entries = read_entries(path, lambda _msg: None)  # a bad file is replaced
            entries.setdefault(env, {})[probe] = entry
            body = json.dumps({"version": FILE_VERSION, "entries": entries}, indent=1)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(body)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    except (OSError, Timeout) as exc:
        warn(
            f"quantdispatch: cannot write the self-check cache {path} ({exc}); results are "
            "kept for this process only (set XDG_CACHE_HOME to a writable directory)"
        )

"""The doctor's concise text: one screen, one line per decision's chosen backend with its kernel
family and one per rejected candidate, its reason cut to the first clause (``--verbose``, in
quantdispatch.cli.doctor, prints every word)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from quantdispatch import __version__
from quantdispatch.capability import SM90_PLUS
from quantdispatch.cli.phrases import WIDTH, gist, prefixed, shorten
from quantdispatch.cli.report import Answer, Row, Shard
from quantdispatch.errors import BackendUnavailableError, QuantDispatchError

__all__ = [
    "Header",
    "concise",
    "error_line",
    "fp8_line",
    "marlin_lines",
    "pdl_applies",
    "shard_label",
]



@dataclass(frozen=True)
class Header:
    """What the header describes: the device, the settings, the policy, and who chose the
    device (``--device`` or ``QUANTDISPATCH_DEVICE``)."""

    profile: Any
    settings: Any
    policy: Any
    device_by: str


# ---------------------------------------------------------------------------------------------
# Concise


def selfcheck_lines(profile, backends) -> list[str]:
    """The first-use self-check's state per backend (``selfcheck_status``), for ``backends``."""
    from quantdispatch.selfcheck import selfcheck_status

    return [f"{b}: {selfcheck_status(b, profile)}" for b in backends if b != "reference"]


def chosen_backends(rows: list[Row]) -> list[str]:
    seen = [r.answer.decision.backend for r in rows if r.answer.decision is not None]
    return list(dict.fromkeys(seen))


def concise(h: Header, rows: list[Row], tp: int | None) -> list[str]:
    lines = _concise_header(h)
    if h.profile.kind == "cuda" and not h.profile.simulated:  # a real GPU: what was checked
        for x in selfcheck_lines(h.profile, chosen_backends(rows)):
            lines += prefixed("checked   ", x)
    lines += ["", "Decisions: -> chosen, no: rejected (first clause; --verbose: every word)"]
    blocks: list[tuple[tuple, list[str], Row]] = []  # (facts, dtypes, row)
    for row in rows:
        facts = _facts(row)
        if blocks and blocks[-1][0] == facts:
            blocks[-1][1].append(row.dt)
        else:
            blocks.append((facts, [row.dt], row))
    for _, dts, row in blocks:
        lines += _block(_label(row, dts), row, tp)
    return lines


def _concise_header(h: Header) -> list[str]:
    p = h.profile
    title = f"quantdispatch {__version__} doctor"
    if p.simulated:
        title += f": SIMULATED preset {p.preset!r} ({h.device_by}), explains only, runs nothing"
    lines = [title]
    if p.kind == "cpu":
        found = (
            ", no GPU found: the decisions are for this CPU" if "no GPU found" in p.notes else ""
        )
        lines.append(f"device    {p.name}{found}")
    else:
        facts = [p.name, f"SM {p.sm}"]
        facts += [f"{p.sm_count} SMs"] if p.sm_count else []
        facts += [f"{p.memory_bytes / 2**30:.1f} GiB"] if p.memory_bytes else []
        facts += [f"driver {p.driver_version}"] if p.driver_version else []
        lines.append("device    " + ", ".join(facts))
    cuda = f"CUDA {p.cuda_version}" if p.cuda_version else "no CUDA build"
    launch = "" if p.torch_cuda or p.kind == "cpu" else ", cannot launch kernels on this GPU"
    lines.append(f"torch     {p.torch_version}, {cuda}{launch}")
    for note in p.notes:  # the title and the device line already say these two
        if not note.startswith(("simulated", "no GPU found")):
            lines += prefixed("note      ", note, whole=True)
    lines += prefixed("kernels   ", _providers_line(p.providers), whole=True)
    for status in marlin_lines():
        lines += prefixed("marlin    ", status)
    s = h.settings.describe()
    if s["forced"]:
        forced = ", ".join(f"{f}={v['backend']} ({v['by']})" for f, v in s["forced"].items())
        lines.append(f"forced    {forced}")
    if s["disabled"]:
        lines.append(f"disabled  {', '.join(s['disabled'])}")
    if len(h.policy.sources) > 1:
        lines.append(f"policy    {' + '.join(h.policy.sources)}")
    if pdl_applies(p) and not s["pdl"]:
        lines.append("PDL       dependent launches off (QUANTDISPATCH_PDL)")
    if fp8_compute_in_effect(h.settings, h.policy)[0] != "off":
        lines += prefixed("fp8       ", fp8_line(h.settings, h.policy))
    return lines


def fp8_compute_in_effect(settings, policy) -> tuple[str, str]:
    """The triton backend's FP8 compute mode in effect and where it comes from."""
    from quantdispatch.backends.triton.options import fp8_compute_of

    return fp8_compute_of(settings, policy)


def fp8_line(settings, policy, *, verbose: bool = False) -> str:
    """The FP8 compute setting in one line (``verbose``: what the mode does, too)."""
    mode, by = fp8_compute_in_effect(settings, policy)
    if mode == "off":
        return f"off ({by}; QUANTDISPATCH_FP8_COMPUTE=prefill or prefill-resident turns it on)"
    if not verbose:
        return f"{mode}, lossy ({by})"
    what = "FP4 weight re-encoded per call" if mode == "prefill" else "on a resident FP8 copy"
    return f"{mode}: lossy FP8 compute for prefill, {what}, where the regime table says ({by})"


def _providers_line(providers) -> str:
    parts = [f"{x.name} {x.version or '(version unknown)'}" for x in providers if x.available]
    missing = [
        x.name
        for x in providers
        if not x.available and (x.reason or "").startswith("ModuleNotFoundError")
    ]
    parts += [
        f"{x.name}: {shorten(x.reason or 'not importable', 40)}"
        for x in providers
        if not x.available and x.name not in missing
    ]
    if missing:
        parts.append(f"{', '.join(missing)} not installed")
    return "; ".join(parts) or "none"


def marlin_lines() -> list[str]:
    from quantdispatch.backends import marlin_providers

    return [s.describe() for s in marlin_providers.statuses()]


def pdl_applies(profile) -> bool:
    """Dependent launches exist on SM 9.0+ GPUs (real or simulated)."""
    return profile.kind == "cuda" and profile.capability in SM90_PLUS


def _facts(row: Row) -> tuple:
    """Everything the concise block of ``row`` shows apart from its dtype: rows of one format
    and op with equal facts share a block."""
    a = row.answer
    d = a.decision
    if d is None:
        f = a.failure
        if isinstance(f, BackendUnavailableError) and f.headline:  # its parts name no dtype
            return (row.fmt, row.op, None, f.headline, f.rejected, f.fix)
        return (row.fmt, row.op, None, a.error)
    shards = tuple((s.parallel, s.ranks, s.n, s.k, _answer_facts(s.answer)) for s in row.shards)
    trace = tuple((c.backend, c.accepted, shorten(c.reason)) for c in d.trace if not c.accepted)
    ok = tuple(c.backend for c in d.trace if c.accepted and c.backend != d.backend)
    return (row.fmt, row.op, _answer_facts(a), _summary(d), shards, row.shard_error, trace, ok)


def _answer_facts(a: Answer) -> tuple:
    d = a.decision
    if d is None:
        return (None, a.error)
    return (
        d.backend,
        d.forced_by,
        _as_weight_only(d),
        tuple(_range_parts(a)),
        d.request.scheme_label,
    )


def _summary(d) -> str:
    try:
        return d.kernel_summary()
    except QuantDispatchError as exc:
        return str(exc)


def _as_weight_only(d) -> str:
    """ " as W4A16" where a weight-only backend runs a checkpoint that quantizes activations."""
    from quantdispatch.backends import get_facts
    from quantdispatch.request import Scheme

    if get_facts(d.backend).weight_only and d.request.scheme is Scheme.WEIGHT_ACT:
        return f" as {d.request.scheme_label.split('A')[0]}A16"
    return ""


def _label(row: Row, dts: list[str]) -> str:
    d = row.answer.decision
    scheme = f" {d.request.scheme_label}" if d is not None else ""
    layer = ""
    if row.shape is not None:
        n, k = row.shape
        layer = f" E={row.experts} top-{row.top_k} H={k} I={n}" if row.experts else f" {n}x{k}"
    return f"{row.fmt} {row.op}{layer}{scheme} {'/'.join(dts)}"


def _range_parts(a: Answer) -> list[str]:
    """The kernel families by M, neighbouring ranges of one family merged (a backend that
    names no family of its own: its one-line description)."""
    from quantdispatch.backends.base import KernelRange

    if a.ranges_error:
        return [shorten(a.ranges_error)]
    merged: list[KernelRange] = []
    for r in a.ranges:
        family = r.family
        if a.decision is not None and family == a.decision.backend and r.detail:
            family = shorten(r.detail, 60)
        if merged and merged[-1].family == family:
            merged[-1] = replace(merged[-1], last_m=r.last_m)
        else:
            merged.append(KernelRange(r.first_m, r.last_m, family))
    return [f"{r.span()}: {r.family}" for r in merged]


def _fit(head: str, parts: list[str], indent: str = "  ") -> list[str]:
    """``head: part; part`` on one line where it fits, else the parts on lines of their own
    under ``head``, as many to a line as fit."""
    text = "; ".join(parts)
    if not text:
        return [head]
    if len(head) + 2 + len(text) <= WIDTH:
        return [f"{head}: {text}"]
    lines, cur = [head], ""
    for part in parts:
        if cur and len(indent) + len(cur) + 2 + len(part) > WIDTH:
            lines.append(f"{indent}{cur};")
            cur = part
        else:
            cur = f"{cur}; {part}" if cur else part
    return [*lines, indent + cur]


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


#: The chosen line where its backend's summary has no first clause short enough to show.
BY_SHAPE = "kernels by M and layer shape (--shape NxK names them)"


def _rejected(backend: str, reason: str) -> list[str]:
    return prefixed(f"  no {backend:<10} ", reason)


def _error_block(label: str, a: Answer) -> list[str]:
    """A decision that could not be made: what, each candidate's reason, the fix (whole)."""
    f = a.failure
    if not (isinstance(f, BackendUnavailableError) and f.headline):
        return prefixed(f"{label} -> ERROR: ", a.error or "", whole=True)
    lines = prefixed(f"{label} -> ERROR: ", f.headline, whole=True)
    for backend, reason in f.rejected:
        lines += _rejected(backend, reason)
    return lines + prefixed(f"  {'fix':<13} ", f.fix or "", whole=True)


def _chosen(head: str, d) -> list[str]:
    """The chosen line: its backend's summary, the first clause, where it fits (on the line, or
    on the next), else :data:`BY_SHAPE`."""
    summary = _summary(d)
    same = gist(summary, WIDTH - len(head) - 2, phrases=False)
    if same is not None:
        return [f"{head}: {same}"]
    below = gist(summary, WIDTH - 2, phrases=False)
    return [head, f"  {below}"] if below is not None else [f"{head}: {BY_SHAPE}"]


def _block(label: str, row: Row, tp: int | None) -> list[str]:
    a = row.answer
    d = a.decision
    if d is None:
        return _error_block(label, a)
    head = f"{label} -> {d.backend}{_as_weight_only(d)}"
    if d.forced_by:  # the header's "forced" line says by what
        head += " (forced)"
    lines = _fit(head, _range_parts(a)) if row.shape is not None else _chosen(head, d)
    for s in row.shards:
        lines += _shard_lines(s, tp, d)
    if row.shard_error:
        lines += prefixed(f"  TP {tp}: cannot split: ", row.shard_error)
    for c in d.trace:
        if not c.accepted:
            lines += _rejected(c.backend, c.reason)
    ok = [c.backend for c in d.trace if c.accepted and c.backend != d.backend]
    if ok:
        lines.append(f"  ok {', '.join(ok)} (could also run)")
    return lines


def shard_label(s: Shard, tp: int | None) -> str:
    """``TP 4 column 1536x4096``; ``TP 4 I=736 (ranks 0-1)`` where ranks differ."""
    shape = f"I={s.n}" if s.parallel == "intermediate" else f"{s.parallel} {s.n}x{s.k}"
    every = len(s.ranks) == tp
    return f"TP {tp} {shape}" + ("" if every else f" ({_ranks(s.ranks)})")


def _shard_lines(s: Shard, tp: int | None, whole) -> list[str]:
    """A shard's kernel ranges, led by its backend where that is not the whole layer's."""
    head = f"  {shard_label(s, tp)}"
    d = s.answer.decision
    if d is None:
        return [f"{head} -> ERROR: {s.answer.error}"]
    if (d.backend, _as_weight_only(d)) != (whole.backend, _as_weight_only(whole)):
        head += f" -> {d.backend}{_as_weight_only(d)}"
    return _fit(head, _range_parts(s.answer), "    ")


def error_line(row: Row) -> str:
    """The one line doctor ends with on stderr for a decision it could not make: the short
    what and the fix where the error has them, else its whole text."""
    f = row.answer.failure
    if isinstance(f, BackendUnavailableError) and f.headline:
        why = f" ({shorten(f.rejected[0][1])})" if len(f.rejected) == 1 else ""
        return f"{row.fmt} {row.op} {row.dt}: {f.headline}{why}; fix: {f.fix}"
    return row.answer.error or ""

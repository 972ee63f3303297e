"""The doctor's concise text: one screen, one line per decision's chosen backend with its kernel
family and one per rejected candidate, its reason cut to the first clause (``--verbose``, in
quantdispatch.cli.doctor, prints every word)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from quantdispatch import __version__
from quantdispatch.cli.report import Answer, Row, Shard
from quantdispatch.errors import QuantDispatchError

__all__ = [
    "Header",
    "concise",
    "fp8_line",
    "marlin_lines",
    "pdl_applies",
    "shard_label",
    "shorten",
]

WIDTH = 100  # concise lines stay within this many columns where they can
REASON_WIDTH = 80


@dataclass(frozen=True)
class Header:
    """What the header describes: the device, the settings, the policy, and who chose the
    device (``--device`` or ``QUANTDISPATCH_DEVICE``)."""

    profile: Any
    settings: Any
    policy: Any
    device_by: str


# ---------------------------------------------------------------------------------------------
# Shortening


def _clauses(text: str) -> list[str]:
    """``text`` split at "; " outside brackets."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if depth == 0 and text.startswith("; ", i):
            out.append(text[start:i])
            start = i + 2
    return [*out, text[start:]]


def _drop_brackets(text: str) -> str:
    """``text`` without its outermost parenthesised / bracketed asides."""
    out, depth = [], 0
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return re.sub(r"\s+([,;:.])", r"\1", re.sub(r"\s{2,}", " ", "".join(out))).strip()


def _cut(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    head = text[: width - 3].rsplit(" ", 1)[0]
    return head.rstrip(",;:(") + "..."


def shorten(text: str, width: int = REASON_WIDTH) -> str:
    """The first clause of a reason, without its asides if that is what it takes to fit in
    ``width``, cut at a word if even that does not fit."""
    first = _clauses(text)[0].strip()
    if len(first) <= width:
        return first
    bare = _drop_brackets(first)
    return _cut(bare or first, width)


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
        lines += [
            _cut(f"checked   {x}", WIDTH) for x in selfcheck_lines(h.profile, chosen_backends(rows))
        ]
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
            lines.append(_cut(f"note      {note}", WIDTH))
    lines.append(_cut("kernels   " + _providers_line(p.providers), WIDTH))
    lines += [_cut(f"marlin    {s}", WIDTH) for s in marlin_lines()]
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
    if fp8_mode(h.settings, h.policy)[0] != "off":
        lines.append(_cut(f"fp8       {fp8_line(h.settings, h.policy)}", WIDTH))
    return lines


def fp8_mode(settings, policy) -> tuple[str, str]:
    """The FP8 compute mode in effect and where it comes from."""
    from quantdispatch.resolver import fp8_compute_of

    return fp8_compute_of(settings, policy)


def fp8_line(settings, policy, *, verbose: bool = False) -> str:
    """The FP8 compute setting in one line (``verbose``: what the mode does, too)."""
    mode, by = fp8_mode(settings, policy)
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
    return (
        profile.kind == "cuda" and profile.capability is not None and profile.capability >= (9, 0)
    )


def _facts(row: Row) -> tuple:
    """Everything the concise block of ``row`` shows apart from its dtype: rows of one format
    and op with equal facts share a block."""
    a = row.answer
    d = a.decision
    if d is None:
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
    from quantdispatch.backends import get_backend
    from quantdispatch.request import Scheme

    if get_backend(d.backend).weight_only and d.request.scheme is Scheme.WEIGHT_ACT:
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


def _span(first: int, last: int | None) -> str:
    if last is None:
        return "any M" if first == 1 else f"M >= {first}"
    if first == last:
        return f"M = {first}"
    return f"M <= {last}" if first == 1 else f"M {first}..{last}"


def _range_parts(a: Answer) -> list[str]:
    """The kernel families by M, neighbouring ranges of one family merged (a backend that
    names no family of its own: its one-line description)."""
    if a.ranges_error:
        return [shorten(a.ranges_error)]
    merged: list[list] = []
    for r in a.ranges:
        family = r.family
        if a.decision is not None and family == a.decision.backend and r.detail:
            family = shorten(r.detail, 60)
        if merged and merged[-1][2] == family:
            merged[-1][1] = r.last_m
        else:
            merged.append([r.first_m, r.last_m, family])
    return [f"{_span(lo, hi)}: {family}" for lo, hi, family in merged]


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


def _block(label: str, row: Row, tp: int | None) -> list[str]:
    a = row.answer
    d = a.decision
    if d is None:
        return [f"{label} -> ERROR: {a.error}"]
    head = f"{label} -> {d.backend}{_as_weight_only(d)}"
    if d.forced_by:  # the header's "forced" line says by what
        head += " (forced)"
    if row.shape is not None:
        lines = _fit(head, _range_parts(a))
    elif WIDTH - len(head) - 2 >= 40:
        lines = [f"{head}: {shorten(_summary(d), WIDTH - len(head) - 2)}"]
    else:
        lines = [head, "  " + shorten(_summary(d), WIDTH - 2)]
    for s in row.shards:
        lines += _shard_lines(s, tp, d)
    if row.shard_error:
        lines.append(f"  TP {tp}: cannot split: {row.shard_error}")
    lines += [f"  no {c.backend:<10} {shorten(c.reason)}" for c in d.trace if not c.accepted]
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

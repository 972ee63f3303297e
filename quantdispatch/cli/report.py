"""What ``quantdispatch doctor`` found, as data: a decision per (format, op, activation dtype),
for a layer's shape its kernel family at each M (``Decision.kernel_ranges``), for ``--tp`` each
rank's shard (the split rules of quantdispatch.checkpoints); and the JSON view of it all. Asks
the resolver and the backends, never the kernels."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from quantdispatch.errors import ConfigurationError, QuantDispatchError

__all__ = ["Answer", "Row", "Shard", "collect", "to_json"]


@dataclass
class Answer:
    """A decision (or the error that stopped it) and, for a given shape, its kernel ranges."""

    decision: Any  # quantdispatch.resolver.Decision
    error: str | None = None
    failure: QuantDispatchError | None = None  # what raised ``error`` (its parts, if any)
    ranges: tuple[Any, ...] = ()  # quantdispatch.backends.base.KernelRange
    ranges_error: str | None = None


@dataclass
class Shard:
    """The distinct shard shape some tensor-parallel ranks hold, with its answer."""

    parallel: str  # "column", "row" (linear) or "intermediate" (MoE: each rank's I)
    ranks: tuple[int, ...]
    n: int
    k: int
    answer: Answer


@dataclass
class Row:
    """One (format, op, act dtype): its answer, the layer it was asked for, its shards."""

    fmt: str
    op: str
    dt: str
    answer: Answer
    shape: tuple[int, int] | None = None  # (N, K); MoE: (I, H)
    experts: int | None = None
    top_k: int | None = None
    shards: list[Shard] = field(default_factory=list)
    shard_error: str | None = None


# ---------------------------------------------------------------------------------------------
# Asking the decisions


def collect(args: argparse.Namespace, formats, ops, dtypes, profile, settings, policy) -> list[Row]:
    """One Row per (format, op, act dtype) in that order, with --shape / --moe / --tp applied."""

    def ask(fmt: str, op: str, dt: str, n=None, k=None, experts=None, top_k=None) -> Answer:
        from quantdispatch.api import select

        try:
            d = select(
                fmt, op, dt, args.scheme, n=n, k=k, experts=experts, device=profile,
                settings=settings, policy=policy,
            )  # fmt: skip
        except ConfigurationError:
            raise
        except QuantDispatchError as exc:
            return Answer(None, str(exc), failure=exc)
        if n is None:
            return Answer(d)
        try:
            return Answer(d, ranges=d.kernel_ranges(top_k=top_k))
        except QuantDispatchError as exc:
            return Answer(d, ranges_error=str(exc))

    rows = []
    for fmt in formats:
        splits: dict[str, tuple[list, str | None]] = {}
        for op in ops:
            if args.tp is not None and _layer(args, op) is not None:
                splits[op] = _splits(args, fmt, op)
            for dt in dtypes:
                layer = _layer(args, op)
                if layer is None:
                    rows.append(Row(fmt, op, dt, ask(fmt, op, dt)))
                    continue
                n, k, experts, top_k = layer
                row = Row(fmt, op, dt, ask(fmt, op, dt, n, k, experts, top_k), (n, k))
                row.experts, row.top_k = experts, top_k
                parts, row.shard_error = splits.get(op, ([], None))
                row.shards = [
                    Shard(par, ranks, sn, sk, ask(fmt, op, dt, sn, sk, experts, top_k))
                    for par, ranks, sn, sk in parts
                ]
                rows.append(row)
    return rows


def _layer(args, op: str) -> tuple[int, int, int | None, int | None] | None:
    """(N, K, experts, top_k) of the layer --shape (linear) / --moe (MoE: N = I, K = H) gives."""
    if op == "linear" and args.shape:
        return args.shape[0], args.shape[1], None, None
    if op == "moe" and args.moe:
        e, top_k, h, i = args.moe
        return i, h, e, top_k
    return None


def _splits(
    args, fmt: str, op: str
) -> tuple[list[tuple[str, tuple[int, ...], int, int]], str | None]:
    """Each distinct shard of the layer over --tp ranks (column then row parallel; MoE: each
    rank's I), or why the layer does not split for this format."""
    from quantdispatch.checkpoints import linear_shard_shapes, moe_shard_sizes

    out = []
    try:
        if op == "linear":
            n, k = args.shape
            for parallel in ("column", "row"):
                shapes = linear_shard_shapes(n, k, fmt, tp_size=args.tp, parallel=parallel)
                out += [(parallel, ranks, sn, sk) for (sn, sk), ranks in _distinct(shapes)]
        else:
            _e, _top_k, h, i = args.moe
            sizes = moe_shard_sizes(i, fmt, args.tp)
            out += [("intermediate", ranks, si, h) for si, ranks in _distinct(sizes)]
    except QuantDispatchError as exc:
        return [], str(exc)
    return out, None


def _distinct(values: list) -> list[tuple[Any, tuple[int, ...]]]:
    """Each distinct value with the ranks that hold it, in rank order of first appearance."""
    ranks: dict[Any, list[int]] = {}
    for rank, v in enumerate(values):
        ranks.setdefault(v, []).append(rank)
    return [(v, tuple(r)) for v, r in ranks.items()]


# ---------------------------------------------------------------------------------------------
# JSON


def to_json(rows: list[Row], profile, settings, policy) -> dict[str, Any]:
    from quantdispatch import __version__
    from quantdispatch.backends import marlin_providers

    out: dict[str, Any] = {
        "quantdispatch": __version__,
        "device": profile.model_dump(mode="json", exclude={"providers"}),
        "providers": [p.model_dump(mode="json") for p in profile.providers],
        "marlin_providers": [
            {
                "name": s.name,
                "version": s.version,
                "installed": s.installed,
                "usable": s.usable,
                "contract": s.contract.key if s.contract else None,
                "reason": s.reason,
                "source": s.source,
            }
            for s in marlin_providers.statuses()
        ],
        "settings": {
            **settings.describe(),
            "policy_files": list(policy.sources),
            **_fp8(settings, policy),
        },
        "decisions": [_decision_json(r) for r in rows],
    }
    moe = next((r for r in rows if r.op == "moe" and r.answer.ranges), None)
    if moe is not None:
        out["moe_layer"] = _moe_layer_json(moe)
    return out


def _fp8(settings, policy) -> dict[str, Any]:
    """The FP8 compute mode in effect (the settings', else the policy file's) and its source."""
    from quantdispatch.backends.triton.options import fp8_compute_of

    mode, by = fp8_compute_of(settings, policy)
    return {"fp8_compute": mode, "fp8_compute_by": by}


def _decision_json(row: Row) -> dict[str, Any]:
    a = row.answer
    if a.decision is None:
        return {
            "format": row.fmt,
            "op": row.op,
            "act_dtype": row.dt,
            "backend": None,
            "reason": None,
            "error": a.error,
            "trace": [],
        }
    out = a.decision.to_dict()
    if row.shape is None:
        return out
    out["kernel_ranges"] = _ranges_json(a, row)
    if not row.experts:
        out["fp8_resident_bytes"] = a.decision.option_facts().get("fp8_resident_bytes")
    if row.shards or row.shard_error:
        out["shards"] = [
            {
                "parallel": s.parallel,
                "ranks": list(s.ranks),
                "n": s.n,
                "k": s.k,
                "backend": s.answer.decision.backend if s.answer.decision else None,
                "error": s.answer.error,
                "kernel_ranges": _ranges_json(s.answer, row),
            }
            for s in row.shards
        ]
        out["shard_error"] = row.shard_error
    return out


def _ranges_json(a: Answer, row: Row) -> list[dict[str, Any]] | dict[str, str]:
    if a.ranges_error:
        return {"error": a.ranges_error}
    out = []
    for r in a.ranges:
        d = r.to_dict()
        if row.experts and row.top_k:
            d["tokens_per_expert"] = _tokens_per_expert(r, row)
        out.append(d)
    return out


def _tokens_per_expert(r, row: Row) -> list[float | None]:
    share = row.top_k / row.experts
    return [r.first_m * share, None if r.last_m is None else r.last_m * share]


def _moe_layer_json(row: Row) -> dict[str, Any]:
    """The first MoE decision's kernel ranges for --moe, in the shape earlier versions gave."""
    d = row.answer.decision
    i, h = row.shape
    return {
        "experts": row.experts,
        "top_k": row.top_k,
        "hidden": h,
        "intermediate": i,
        "format": row.fmt,
        "act_dtype": row.dt,
        "backend": d.backend,
        "note": d.kernel_summary(),
        "ranges": [
            {
                "m_min": r.first_m,
                "m_max": r.last_m,
                "tokens_per_expert": _tokens_per_expert(r, row),
                "kernel": r.detail or r.family,
                "family": r.family,
            }
            for r in row.answer.ranges
        ],
    }

"""``quantdispatch doctor --matrix``: the backend chosen for every preset x format x op, one
row per preset within 120 columns. Activation dtypes share a cell where they agree
(``bf16/fp16`` cells otherwise); a ``*`` marks a choice that runs only once its first-use
self-check passes on that GPU (QUANTDISPATCH_SELF_CHECK=off refuses it there)."""

from __future__ import annotations

import json

from quantdispatch import __version__
from quantdispatch.cli.common import EXIT_DECISION, EXIT_OK
from quantdispatch.errors import ConfigurationError, QuantDispatchError

__all__ = ["MARK", "run_matrix"]

MARK = "*"
WIDTH = 120
LEGEND = (
    f"{MARK}: runs only once its first-use self-check passes on that GPU "
    "(QUANTDISPATCH_SELF_CHECK=off refuses it)",
    "a/b: the bf16 / fp16 choices where they differ; ERROR: no backend can run it",
)


def _choice(select, fmt, op, dt, scheme, profile, settings, policy) -> tuple[str, bool]:
    """(backend or "ERROR", whether it runs only behind the self-check)."""
    try:
        d = select(fmt, op, dt, scheme, device=profile, settings=settings, policy=policy)
    except ConfigurationError:
        raise
    except QuantDispatchError:
        return "ERROR", False
    return d.backend, d.unverified() is not None


def _cell(choices: list[tuple[str, bool]]) -> str:
    names = [name + (MARK if gated else "") for name, gated in choices]
    return names[0] if len(set(names)) == 1 else "/".join(names)


def run_matrix(formats, ops, dtypes, scheme, settings, policy, *, as_json: bool) -> int:
    from quantdispatch.api import select
    from quantdispatch.device import PRESETS, preset_profile

    table: dict[str, dict[str, tuple[str, bool]]] = {}
    for key in PRESETS:
        profile = preset_profile(key)
        table[key] = {
            f"{f}/{o}/{d}": _choice(select, f, o, d, scheme, profile, settings, policy)
            for f in formats
            for o in ops
            for d in dtypes
        }
    failed = any(name == "ERROR" for row in table.values() for name, _ in row.values())
    if as_json:
        print(
            json.dumps(
                {
                    "quantdispatch": __version__,
                    "matrix": {k: {c: n for c, (n, _) in r.items()} for k, r in table.items()},
                    "self_check_gated": {
                        k: sorted(c for c, (_, gated) in r.items() if gated)
                        for k, r in table.items()
                    },
                },
                indent=2,
            )
        )
        return EXIT_DECISION if failed else EXIT_OK
    columns = [(f, o) for f in formats for o in ops]
    cells = {
        key: [_cell([row[f"{f}/{o}/{d}"] for d in dtypes]) for f, o in columns]
        for key, row in table.items()
    }
    names = [f"{f} {o}" for f, o in columns]
    widths = [
        max(len(names[i]), *(len(c[i]) for c in cells.values())) for i in range(len(columns))
    ]
    first = max(len(k) for k in PRESETS)
    gap = 2 if first + 7 + sum(w + 2 for w in widths) <= WIDTH else 1

    def line(lead: str, sm: str, row: list[str]) -> str:
        padded = (c.ljust(w) for c, w in zip(row, widths, strict=True))
        return f"{lead:<{first}} {sm:<4}  {(' ' * gap).join(padded)}".rstrip()

    print(line("preset", "SM", names))
    for key, row in cells.items():
        p = PRESETS[key]
        print(line(key, f"{p.capability[0]}.{p.capability[1]}" if p.capability else "-", row))
    print("\n".join(("", *LEGEND)))
    return EXIT_DECISION if failed else EXIT_OK

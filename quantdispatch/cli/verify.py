"""``quantdispatch verify``: prints the checks of :mod:`quantdispatch.verify` as a table or
JSON and turns a failed check into exit code 1."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from quantdispatch.cli.common import EXIT_DECISION, EXIT_OK

__all__ = ["run_verify"]


def run_verify(formats: Sequence[str] | None, *, as_json: bool) -> int:
    from quantdispatch.verify import verify

    results = verify(formats)
    if as_json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(f"{'format':<7}{'act':<6}{'backend':<11}{'M':>4}{'N':>6}{'K':>6}  rel.err   bound   ")
        for r in results:
            status = "ok" if r.ok else "FAIL"
            print(
                f"{r.format:<7}{r.act_dtype:<6}{r.backend:<11}{r.m:>4}{r.n:>6}{r.k:>6}  "
                f"{r.rel_err:.1e}  {r.bound:.0e}  {status} {r.note}"
            )
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"quantdispatch: error: {len(failed)} check(s) failed", file=sys.stderr)
        return EXIT_DECISION
    return EXIT_OK

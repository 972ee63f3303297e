"""``quantdispatch verify``: prints the checks of :mod:`quantdispatch.verify` as a table or
JSON and turns a failed check into exit code 1. FP8 compute (lossy) gets its own section with
its own bounds, when its setting is on or with ``--fp8-compute``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from quantdispatch.cli.common import EXIT_DECISION, EXIT_OK

__all__ = ["fp8_compute_modes", "run_verify"]


def fp8_compute_modes(flag: bool) -> tuple[str, ...]:
    """The FP8 compute modes to check: both with ``--fp8-compute``, else the one in effect
    (the environment's, else the policy file's), none when it is off."""
    from quantdispatch.api import current_settings
    from quantdispatch.backends.triton.options import fp8_compute_of
    from quantdispatch.policy import load_policy
    from quantdispatch.verify import FP8_MODES

    if flag:
        return FP8_MODES
    settings = current_settings()
    mode, _ = fp8_compute_of(settings, load_policy(settings.policy))
    return () if mode == "off" else (mode,)


def run_verify(formats: Sequence[str] | None, *, as_json: bool, fp8: bool = False) -> int:
    from quantdispatch.verify import verify, verify_fp8

    results = verify(formats)
    modes = fp8_compute_modes(fp8)
    fp8_results, skipped = verify_fp8(formats, modes) if modes else ([], [])
    if as_json:
        print(json.dumps([asdict(r) for r in results + fp8_results], indent=2))
        for why in skipped:
            print(f"quantdispatch: fp8 compute not checked: {why}", file=sys.stderr)
    else:
        print(f"{'format':<7}{'act':<6}{'backend':<11}{'M':>4}{'N':>6}{'K':>6}  rel.err   bound   ")
        for r in results:
            status = "ok" if r.ok else "FAIL"
            print(
                f"{r.format:<7}{r.act_dtype:<6}{r.backend:<11}{r.m:>4}{r.n:>6}{r.k:>6}  "
                f"{r.rel_err:.1e}  {r.bound:.0e}  {status} {r.note}"
            )
        if modes:
            print(_fp8_text(fp8_results, skipped))
    failed = [r for r in results + fp8_results if not r.ok]
    if failed:
        print(f"quantdispatch: error: {len(failed)} check(s) failed", file=sys.stderr)
        return EXIT_DECISION
    return EXIT_OK


def _fp8_text(results: list, skipped: list[str]) -> str:
    from quantdispatch.checking import FP8_BOUND_RATIO, FP8_REL_BOUND
    from quantdispatch.verify import FP8_SECTION

    lines = [
        "",
        f"{FP8_SECTION}: the triton backend's FP8 compute vs float64 W4A16; rel.err <= "
        f"{FP8_REL_BOUND:g} and every output within its proven bound (ratio <= "
        f"{FP8_BOUND_RATIO:g})",
    ]
    if results:
        lines.append(f"{'format':<7}{'act':<6}{'M':>5}{'N':>6}{'K':>6}  rel.err  bound  ratio")
    for r in results:
        status = "ok" if r.ok else "FAIL"
        lines.append(
            f"{r.format:<7}{r.act_dtype:<6}{r.m:>5}{r.n:>6}{r.k:>6}  {r.rel_err:.1e}  "
            f"{r.bound:.0e}  {r.bound_ratio:.3f}  {status} {r.note}"
        )
    lines += [f"not checked here: {why}" for why in skipped]
    return "\n".join(lines)

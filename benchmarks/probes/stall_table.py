"""Summarize an Nsight Compute source-page export (``benchmarks/probes/profile_stalls.sh`` writes
``stall-*-sass.csv``): where the warps of the hottest loop wait, per SASS instruction.

    python benchmarks/probes/stall_table.py stall-gemm-gate_up-128-sass.csv[.gz] [--top 25] [--all]

Prints the stall samples by reason over the whole kernel, then the instructions with the most
samples (address, samples, top reasons, SASS), so a claim like "the decode waits on the
weight loads" is read off the profile, not guessed.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
from pathlib import Path


def load(path: Path) -> list[dict[str, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    return [dict(zip(header, r, strict=True)) for r in rows[start + 1 :] if len(r) == len(header)]


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--all", action="store_true", help="every instruction with samples, in order")
    args = ap.parse_args()
    rows = load(args.csv)
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = collections.Counter()
    for r in rows:
        for k in reasons:
            total[k] += number(r[k])
    samples = sum(total.values()) or 1.0
    print(f"{args.csv.name}: {len(rows)} instructions, {samples:.0f} samples")
    print("  " + "  ".join(f"{k[6:]} {100 * v / samples:.1f}%" for k, v in total.most_common(10)))
    hot = [r for r in rows if number(r["Warp Stall Sampling (All Samples)"]) > 0]
    if not args.all:
        hot = sorted(hot, key=lambda r: -number(r["Warp Stall Sampling (All Samples)"]))
        hot = hot[: args.top]
    for r in hot:
        n = number(r["Warp Stall Sampling (All Samples)"])
        top = sorted(((number(r[k]), k[6:]) for k in reasons), reverse=True)[:3]
        why = " ".join(f"{k}:{v:.0f}" for v, k in top if v)
        print(f"  {r['Address']:>6} {100 * n / samples:5.1f}%  {why:<40} {r['Source'][:70]}")


if __name__ == "__main__":
    main()

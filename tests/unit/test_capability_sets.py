"""Compute capabilities are tested against the named sets of ``quantdispatch.capability``
(``cc in SM90_PLUS``), never compared as bare tuples: ``capability >= (10, 0)`` sends the sm120
family to sm100 kernels, and a set says which GPUs it means. Only the set home and the probes
(device/) read the numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quantdispatch.capability import (
    ANY_DEVICE,
    FP8_MMA,
    SM9X,
    SM80_PLUS,
    SM89_PLUS,
    SM90,
    SM90_PLUS,
    SM100_FAMILY,
    SM120_FAMILY,
)

PACKAGE = Path(__file__).resolve().parents[2] / "quantdispatch"
#: Where capability numbers may be compared: the set home and the device probes.
ALLOWED = ("capability.py", "device/")

_NAME = r"(?:capability|cap|cc|major)"
_OP = r"(?:<=|>=|<|>|==|!=)"
#: ``capability >= (9, 0)``, ``tuple(cap) == (9, 0)``, ``cc[0] != 9``, ``props.major >= 9``
#: and the same written the other way round.
BARE = re.compile(
    rf"\b{_NAME}\b\)?(?:\[\d\])?\s*{_OP}\s*\(?\s*\d"
    rf"|\(\s*\d+\s*,\s*\d+\s*\)\s*{_OP}\s*(?:tuple\()?[\w.]*\b{_NAME}\b"
)


def _bare_comparisons() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if BARE.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    return found


def test_no_bare_capability_comparisons():
    found = _bare_comparisons()
    assert not found, "use a set from quantdispatch.capability:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "if capability >= (9, 0):",
        "hopper = props.capability < (8, 9)",
        "if tuple(capability) == (9, 0) and x:",
        "if cap[0] != 9:",
        "ok = (8, 0) <= capability",
        "new = props.major >= 9",
    ],
)
def test_the_check_sees_bare_comparisons(line):
    assert BARE.search(line)


@pytest.mark.parametrize("line", ["if cuda >= (12, 9):", "if capability in SM90_PLUS:"])
def test_the_check_passes_other_comparisons(line):
    assert not BARE.search(line)


def test_sets():
    assert (9, 0) in SM90 and (9, 0) in SM9X and (9, 0) in SM90_PLUS and (9, 0) in FP8_MMA
    assert [12, 0] in SM89_PLUS and (12, 0) in SM120_FAMILY and (12, 0) not in SM100_FAMILY
    assert (8, 6) in SM80_PLUS and (8, 6) not in SM89_PLUS and (7, 5) not in SM80_PLUS
    assert None not in SM80_PLUS and None in ANY_DEVICE and (7, 0) in ANY_DEVICE
    assert "bogus" not in SM9X and (9,) not in SM9X
    assert SM90_PLUS.describe() == "SM 9.0+ (9.0+)"
    assert SM9X.describe() == "SM 9.x (9.x)"

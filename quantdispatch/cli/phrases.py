"""Text that fits the doctor's concise view: a reason or summary reduced to whole phrases
within a width (its first clause, without its asides, up to a ": " or ", "), or wrapped at
words onto lines of its own; never cut mid-phrase with "..."."""

from __future__ import annotations

import re
import textwrap

from quantdispatch.errors import clauses

__all__ = ["REASON_WIDTH", "WIDTH", "gist", "prefixed", "shorten"]

WIDTH = 100  # concise lines stay within this many columns
REASON_WIDTH = 80


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


def _phrase_ends(text: str) -> list[int]:
    """Where each leading run of whole phrases ends: before ": " and ", " outside brackets."""
    ends, depth = [], 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0 and text.startswith((": ", ", "), i):
            ends.append(i)
    return ends


def gist(text: str, width: int, *, phrases: bool = True) -> str | None:
    """The first clause of ``text`` in at most ``width`` columns: whole, else without its
    asides, else (``phrases``) its leading phrases up to a ": " or ", " that fit; None when
    none of these fits."""
    first = clauses(text)[0].strip()
    if len(first) <= width:
        return first
    bare = _drop_brackets(first) or first
    if len(bare) <= width:
        return bare
    fitting = [end for end in _phrase_ends(bare) if end <= width] if phrases else []
    return bare[: fitting[-1]] if fitting else None


def shorten(text: str, width: int = REASON_WIDTH) -> str:
    """:func:`gist` on one line; where nothing fits, the first clause without its asides."""
    got = gist(text, width)
    return got if got is not None else _drop_brackets(clauses(text)[0]) or text


def prefixed(prefix: str, text: str, *, whole: bool = False) -> list[str]:
    """``prefix`` + the gist of ``text`` (``whole``: all of it) in lines of at most WIDTH
    columns, continuation lines indented under the text; words are never cut."""
    width = WIDTH - len(prefix)
    body = text if whole else gist(text, width)
    if body is not None and len(body) <= width:
        return [prefix + body]
    if body is None:
        body = _drop_brackets(clauses(text)[0]) or text
    wrapped = textwrap.wrap(body, width, break_long_words=False, break_on_hyphens=False)
    return [prefix + wrapped[0], *(" " * len(prefix) + w for w in wrapped[1:])]

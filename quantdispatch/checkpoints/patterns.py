"""Module-name patterns from configs, matched in bounded time.

Configs name modules three ways: exact names, ``fnmatch`` wildcards (ModelOpt ``*lm_head``) and
``re:`` regular expressions (compressed-tensors, matched from the start of the name like
``re.match``). A regex from a downloaded config can backtrack for minutes on one name
(``re:(a|aa)+$``), so every pattern is compiled once with the ``regex`` package and each match
runs under a time bound: a pattern that exceeds it is an error naming the pattern, where it came
from and the name, never a hang. Each (pattern, name) answer is cached, so a pattern is tried
once per module name.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import regex

from quantdispatch.errors import QuantDispatchError, format_error

__all__ = [
    "MATCH_SECONDS",
    "MAX_PATTERN_CHARS",
    "ModulePattern",
    "any_match",
    "compile_patterns",
]

#: Time bound of one match. Real patterns match a module name in microseconds.
MATCH_SECONDS = 0.25
#: Longest pattern accepted (module names are far shorter).
MAX_PATTERN_CHARS = 1024


@dataclass(frozen=True)
class ModulePattern:
    """One compiled pattern; ``where`` names its source (file and key) for error messages."""

    text: str
    where: str = field(compare=False)
    error: type[QuantDispatchError] = field(compare=False, repr=False)
    compiled: regex.Pattern = field(compare=False, repr=False)
    is_regex: bool = False
    suffix: bool = False
    """Plain names also match a dotted suffix (``lm_head`` matches ``model.lm_head``)."""

    def matches(self, name: str) -> bool:
        return _match(self, name)


@functools.lru_cache(maxsize=1 << 16)
def _match(pattern: ModulePattern, name: str) -> bool:
    if not pattern.is_regex and (
        name == pattern.text or (pattern.suffix and name.endswith("." + pattern.text))
    ):
        return True
    try:
        return pattern.compiled.match(name, timeout=MATCH_SECONDS) is not None
    except TimeoutError:
        raise pattern.error(
            format_error(
                f"pattern {pattern.text!r} ({pattern.where}) took more than {MATCH_SECONDS} s "
                f"on the module name {name!r}",
                "module patterns must match in bounded time; nested repetition such as "
                "(a|aa)+ backtracks exponentially",
                "rewrite the pattern without nested repetition (e.g. re:.*lm_head, or list the "
                "module names)",
            )
        ) from None


def compile_patterns(
    texts: Iterable[object],
    where: str,
    error: type[QuantDispatchError],
    *,
    suffix: bool = False,
) -> tuple[ModulePattern, ...]:
    """Compile exact names, wildcards and ``re:`` regexes; a malformed one raises ``error``
    naming ``where``. ``suffix``: plain names also match as a dotted suffix."""
    out = []
    for text in texts:
        if not isinstance(text, str) or not text:
            raise error(
                format_error(
                    f"{where}: pattern {text!r} is not a non-empty string",
                    "module patterns are names, wildcards (*) or re: regular expressions",
                    "fix the entry",
                )
            )
        if len(text) > MAX_PATTERN_CHARS:
            raise error(
                format_error(
                    f"{where}: a pattern of {len(text)} characters ({text[:40]!r}...)",
                    f"module patterns have at most {MAX_PATTERN_CHARS} characters",
                    "shorten it",
                )
            )
        is_regex = text.startswith("re:")
        source = text[3:] if is_regex else fnmatch.translate(text)
        try:
            compiled = regex.compile(source)
        except (regex.error, ValueError, OverflowError, RecursionError, MemoryError) as exc:
            raise error(
                format_error(
                    f"{where}: pattern {text!r} is not a valid regular expression ({exc})",
                    "re: patterns are Python regular expressions matched from the start of the "
                    "module name",
                    "fix the pattern",
                )
            ) from None
        out.append(ModulePattern(text, where, error, compiled, is_regex=is_regex, suffix=suffix))
    return tuple(out)


def any_match(patterns: Iterable[ModulePattern], name: str) -> ModulePattern | None:
    """The first pattern that matches ``name``, or None."""
    for p in patterns:
        if p.matches(name):
            return p
    return None

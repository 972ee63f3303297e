"""The README and docs/ hold what a new user relies on: the two set-up commands (the test one is
the command CI runs, byte for byte), a README that stays short, and relative links that lead
somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
CI_MARKER = "# README test command"
MAX_README_BYTES = 10 * 1024

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section (up to the next ``## `` heading)."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _ci_command() -> str:
    """The command line .ci/run runs: the first line after its README marker comment that is
    not a comment."""
    lines = CI_RUN.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(CI_MARKER):
            rest = [x for x in lines[i + 1 :] if x.strip() and not x.startswith("#")]
            assert rest, ".ci/run has no command after its README marker comment"
            return rest[0]
    raise AssertionError(f".ci/run has no line starting with {CI_MARKER!r}")


def _setup_commands() -> list[str]:
    blocks = FENCE.findall(_section(README.read_text(), "Set up"))
    commands = []
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        assert len(lines) == 1, f"a set-up block holds one command line, got {lines}"
        commands.append(lines[0])
    return commands


def test_setup_has_exactly_two_commands_doctor_and_ci():
    commands = _setup_commands()
    assert len(commands) == 2, commands
    doctor = [c for c in commands if c.rstrip().endswith("quantdispatch doctor")]
    assert len(doctor) == 1, f"one set-up command runs `quantdispatch doctor`: {commands}"
    others = [c for c in commands if c not in doctor]
    assert others == [_ci_command()], "the README's test command and .ci/run's must be identical"


def test_ci_runs_the_readme_test_command_in_a_fresh_venv_per_python():
    """The command is the body of ``readme_test_command``, which ``in_fresh_venv`` runs in a
    new virtual environment; the script ends by calling that for the default Python and 3.12."""
    text = CI_RUN.read_text()
    body = re.search(r"^readme_test_command\(\) \{\n(.*?)^\}", text, re.S | re.M)
    assert body, ".ci/run defines no readme_test_command function"
    commands = [x for x in body.group(1).splitlines() if x.strip() and not x.startswith("#")]
    assert commands == [_ci_command()]
    fresh = re.search(r"^in_fresh_venv\(\) \{\n(.*?)^\}", text, re.S | re.M)
    assert fresh and "-m venv" in fresh.group(1) and "readme_test_command" in fresh.group(1)
    calls = [x for x in text.splitlines() if x.strip()][-2:]
    assert calls == ["in_fresh_venv python3", 'in_fresh_venv "$PY312"'], calls


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size < MAX_README_BYTES, f"README.md is {size} bytes; keep it under {MAX_README_BYTES}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(0)[1:-1], heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _relative_links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return [
        target
        for target in LINK.findall(text)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:, ...
    ]


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_that_exist(doc: Path):
    broken = []
    for target in _relative_links(doc):
        where, _, anchor = target.partition("#")
        dest = (doc.parent / where).resolve() if where else doc
        if not dest.exists():
            shown = dest.relative_to(ROOT) if ROOT in dest.parents else dest
            broken.append(f"{target} (no {shown})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: {broken}"


def test_docs_exist_and_link_checks_see_links():
    assert (ROOT / "docs" / "performance.md").is_file()
    assert (ROOT / "LICENSE").is_file()
    assert any(_relative_links(README)), "the link check found no relative link in README.md"

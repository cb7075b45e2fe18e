"""The design Notes the code cites are defined exactly once, and nothing cites a file outside the
repository.

A Note is defined where its marker stands alone on a line (in a docstring, or after ``#``) with
its text below; everywhere else (code, tests, benchmarks, docs, the README) a marker cites it. A
marker broken over two lines (a wrapped comment) is read as one. ``docs/notes.md`` is the index of
every Note and where it is defined, generated from the same scan:

    python -m tests.unit.test_notes > docs/notes.md
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = ("src", "tests", "benchmarks", "recipes")
MARK = re.compile(r"\[Note:(\s[^\]]*?)\]", re.S)
CONTINUATION = re.compile(r"\n\s*(#\s*)?")  # a marker wrapped onto the next comment or docstring line


def _name(raw: str) -> str:
    return " ".join(CONTINUATION.sub(" ", raw).split())


def scan() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(definitions, citations): Note name -> ``path:line`` of each."""
    defined: dict[str, list[str]] = defaultdict(list)
    cited: dict[str, list[str]] = defaultdict(list)
    files = [p for root in CODE for p in (REPO / root).rglob("*.py") if p != Path(__file__).resolve()]
    files += [*(REPO / "docs").rglob("*.md"), REPO / "README.md"]
    for path in sorted(files):
        text = path.read_text(encoding="utf-8")
        for match in MARK.finditer(text):
            start = text.rfind("\n", 0, match.start()) + 1
            end = text.find("\n", match.end())
            end = len(text) if end < 0 else end
            alone = (path.suffix == ".py" and re.fullmatch(r'\s*(#\s*|"""|r""")?', text[start:match.start()]) is not None
                     and text[match.end():end].strip() == "")
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}"
            (defined if alone else cited)[_name(match.group(1))].append(where)
    return defined, cited


def test_every_cited_note_is_defined_exactly_once() -> None:
    defined, cited = scan()
    dangling = {name: places[:3] for name, places in cited.items() if name not in defined}
    assert not dangling, f"cited, defined nowhere: {dangling}"
    twice = {name: places for name, places in defined.items() if len(places) > 1}
    assert not twice, f"defined more than once: {twice}"


def test_no_citation_of_files_outside_the_repository() -> None:
    found = [f"{p.relative_to(REPO)}:{n}" for root in CODE for p in (REPO / root).rglob("*.py")
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "research/" in line
             and p.name != "test_notes.py"]
    assert not found, f"research/ is not in the repository: {found}"


def index() -> str:
    defined, _ = scan()
    lines = ["# Notes", "", "The design notes the code cites by name, and where each is defined "
             "(generated: `python -m tests.unit.test_notes > docs/notes.md`; `tests/unit/test_notes.py` checks "
             "that it is current and that every citation has one definition).", "",
             "| Note | defined in |", "|---|---|"]
    for name in sorted(defined, key=str.lower):
        lines.append(f"| {name.replace('|', '/')} | `{defined[name][0].rsplit(':', 1)[0]}` |")
    return "\n".join(lines) + "\n"


def test_the_index_is_current() -> None:
    assert (REPO / "docs" / "notes.md").read_text(encoding="utf-8") == index(), \
        "docs/notes.md is stale: python -m tests.unit.test_notes > docs/notes.md"


if __name__ == "__main__":
    sys.stdout.write(index())

"""Pointers into the design notes resolve: every `notes/<name>.md` that the code, the tests, the READMEs or
the notes themselves name exists, and every section they quote (`notes/<name>.md, "Title"`) is a heading of
that note or the bold lead-in of one of its paragraphs. The notes get rewritten; a pointer that no longer
lands is a reader sent nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTE = re.compile(r"notes/(\w+)\.md")
QUOTED = re.compile(r"notes/(\w+)\.md`?,\s*[\"“]([^\"”]+)[\"”]")


def _sources() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    for folder, pattern in (
        ("src", "**/*.py"),
        ("tests", "**/*.py"),
        ("benchmarks", "*.py"),
        ("benchmarks", "*.sh"),
        ("notes", "*.md"),
        ("tools", "*.py"),
        ("examples", "*.py"),
    ):
        found += sorted((ROOT / folder).glob(pattern))
    return found


def _flat(text: str) -> str:
    """Lines joined with one space, comment markers dropped: a quoted title may wrap across lines."""
    return re.sub(r"\s*\n\s*(#\s*)?", " ", text)


def _anchors(note: Path) -> list[str]:
    text = note.read_text()
    heads = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return heads + re.findall(r"\*\*([^*]+)\*\*", text)


def test_every_named_note_exists_and_every_quoted_section_is_in_it():
    missing, unresolved, quoted = set(), [], 0
    for source in _sources():
        text = _flat(source.read_text())
        missing |= {(source.name, n) for n in NOTE.findall(text) if not (ROOT / "notes" / f"{n}.md").is_file()}
        for name, title in QUOTED.findall(text):
            quoted += 1
            note = ROOT / "notes" / f"{name}.md"
            if note.is_file() and not any(a.startswith(title) or title in a for a in _anchors(note)):
                unresolved.append((source.name, name, title))
    assert quoted > 0, "no quoted section found: the pattern no longer matches how sections are cited"
    assert not missing, f"notes named but absent: {sorted(missing)}"
    assert not unresolved, f"quoted sections absent from their note: {unresolved}"

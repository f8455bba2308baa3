"""A griffe extension for the API reference. ra-lens docstrings show their examples as doctests in
free text ("Examples (`model`: a tiny model):" then `>>>` lines), which Markdown would read as
nested block quotes. Each run of doctest lines (a `>>>` line, its `...` continuations and its output,
up to a blank line) is fenced as a `pycon` code block before the docstring is parsed, so the
examples render as code with their expected output. Docstrings themselves stay plain doctests:
`pytest --doctest-modules` runs them as they are. Index-style brackets in prose ("[layer][head]")
are escaped so that they are not read as Markdown reference links.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_FENCE = re.compile(r"^\s*(```|~~~)")


def fence_doctests(text: str) -> str:
    """Wrap each block of doctest lines in a ```pycon fence (indentation kept); lines inside an
    existing fence are left alone (tests/docs/test_site.py checks an example)."""
    out: list[str] = []
    lines = [_literal_brackets(line) for line in text.split("\n")]
    i, in_fence = 0, False
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
        if in_fence or not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


def _literal_brackets(line: str) -> str:
    """Index-style brackets in prose ("[layer][head] lists") are text, not Markdown reference
    links: escape "][" outside code spans (doctest lines are left as they are)."""
    if line.lstrip().startswith((">>>", "...")) or "][" not in line:
        return line
    parts = line.split("`")
    return "`".join(p.replace("][", "]\\[") if i % 2 == 0 else p for i, p in enumerate(parts))


_ARGS = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
_GROUPED = re.compile(r"^(\s+)([A-Za-z_]\w*(?:,\s*[A-Za-z_]\w*)+):\s(.*)$")


def split_grouped_args(text: str) -> str:
    """In an Args section, "clean, corrupted: description" becomes one entry per parameter (the
    first keeps the description, the others point to it), as the Google style griffe parses
    expects; without this each such line is a warning and fails the strict build."""
    out: list[str] = []
    section_indent: int | None = None
    pending: tuple[int, str, list[str]] | None = None  # (entry indent, first name, other names)

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            indent, first, others = pending
            out.extend(f"{' ' * indent}{name}: as `{first}`." for name in others)
            pending = None

    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip())
        if pending is not None and line.strip() and indent <= pending[0]:
            flush()
        header = _ARGS.match(line)
        if header:
            section_indent = len(header.group(1))
        elif section_indent is not None and line.strip() and indent <= section_indent:
            section_indent = None
        grouped = _GROUPED.match(line) if section_indent is not None else None
        if grouped:
            first, *others = [n.strip() for n in grouped.group(2).split(",")]
            out.append(f"{grouped.group(1)}{first}: {grouped.group(3)}")
            pending = (len(grouped.group(1)), first, others)
            continue
        out.append(line)
    flush()
    return "\n".join(out)


class FenceDoctests(griffe.Extension):
    """Fence the doctest blocks of every docstring griffe loads, and split grouped Args entries."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(split_grouped_args(obj.docstring.value))

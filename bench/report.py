"""BENCHMARKS.md a section at a time: a section measured alone replaces only its own."""

from __future__ import annotations

import re
from pathlib import Path


def _heading_pattern(heading: str) -> re.Pattern[str]:
    """The section under ``heading``, matched by its number ("## 7.") when it has one.

    Numbered headings carry the run's counts, which change from run to run.
    """
    numbered = re.match(r"## [0-9A-Za-z]+\. ", heading)
    start = re.escape(numbered.group(0)) + r"[^\n]*" if numbered else re.escape(heading)
    return re.compile(rf"^{start}\n.*?(?=^## |^!\[chart\]|\Z)", re.M | re.S)


def write_section(
    out: Path, lines: list[str], note: str | None = None, *, first: bool = False
) -> None:
    """Put the section ``lines`` (its heading first) into ``out``, before the charts.

    An earlier section of the same heading is replaced; a new one goes before the
    charts, or before every other section when ``first``. ``note`` goes under the heading.
    """
    text = out.read_text() if out.exists() else "# Benchmarks\n\n"
    body = [*lines[:1], "", note, *lines[1:]] if note else lines
    section = "\n".join(body).rstrip("\n") + "\n\n"
    pattern = _heading_pattern(lines[0])
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    elif first and (other := re.search(r"^## ", text, re.M)):
        text = text[: other.start()] + section + text[other.start() :]
    elif "![chart]" in text:
        text = text.replace("![chart]", section + "![chart]", 1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    out.write_text(text)

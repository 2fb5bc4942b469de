"""A griffe extension for the house docstring style: Google sections without a blank line
between them.

tfx writes `Args:`, `Returns:` and `Raises:` one after another (see DESIGN.md). griffe's Google
parser only opens a section after a blank line, and otherwise keeps the title and its lines as
plain text, silently. This extension adds that blank line before a section title that follows
a non-blank line, outside code fences, so every section is parsed (and checked) as one.
"""

from __future__ import annotations

import re

import griffe

SECTION = re.compile(r"\s*(Args|Arguments|Returns|Raises|Yields|Attributes|Examples|Warns):\s*")


def separate_sections(text: str) -> str:
    """`text` with a blank line before each section title that directly follows a line."""
    lines, in_fence = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and SECTION.fullmatch(line) and lines and lines[-1].strip():
            lines.append("")
        lines.append(line)
    return "\n".join(lines)


class SeparateSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = separate_sections(obj.docstring.value)

"""The docstring parser of the API reference: MyST, after turning Google-style sections into lists.

The package's docstrings are Markdown-ish plain text: single backticks for code, unicode math,
and Google-style sections (`Args:`, `Returns:`, `Raises:`, ...) whose entries are indented under
the heading. Markdown would run such a section into one paragraph, so each section becomes a
bold heading and a list (`- name: text`, continuation lines folded into their entry). Everything
else is passed to MyST unchanged. autodoc2 names this module in `autodoc2_docstring_parser_regexes`
(docutils looks up `Parser` in it).
"""

from __future__ import annotations

import re

from myst_parser.parsers.sphinx_ import MystParser

SECTIONS = (
    "Args",
    "Arguments",
    "Attributes",
    "Fields",
    "Keyword Args",
    "Parameters",
    "Raises",
    "Returns",
    "Yields",
)
_HEADING = re.compile(r"^(?P<name>" + "|".join(SECTIONS) + r"):\s*$")
_ENTRY = re.compile(r"^(?P<name>[\w*.,\[\] ()|`'\"-]{1,40}?):(?:\s+(?P<text>.*))?$")


def _entry(line: str):
    """The `name: text` match of an entry line, or None. A name must close its backticks: in
    "`o: [B, T, H, Dv]` in ..." (a Returns line) the colon is inside the code, not after a
    name, and splitting there would swap code and text."""
    match = _ENTRY.match(line)
    return match if match is not None and match["name"].count("`") % 2 == 0 else None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def google_sections_to_markdown(text: str) -> str:
    """Rewrite each Google-style section of `text` as a bold heading and a Markdown list."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    fence = False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        match = None if fence else _HEADING.match(line.rstrip())
        if match is None:
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        body: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        out += ["", f"**{match['name']}:**", ""]
        out += _section_items(body)
        out.append("")
    return "\n".join(out)


def _section_items(body: list[str]) -> list[str]:
    """The entries of a section's indented body, as Markdown list items."""
    content = [line for line in body if line.strip()]
    if not content:
        return []
    entry_indent = min(_indent(line) for line in content)
    items: list[list[str]] = []
    for line in body:
        if not line.strip():
            if items:
                items[-1].append("")
            continue
        stripped = line.strip()
        if _indent(line) == entry_indent and (not items or _entry(stripped)):
            items.append([stripped])
        elif items:
            items[-1].append(stripped)
    result = []
    for item in items:
        while item and not item[-1]:
            item.pop()
        head, *rest = item
        entry = _entry(head)
        if entry and entry["text"] is not None and " " not in entry["name"].strip("`"):
            head = f"`{entry['name'].strip('`')}`: {entry['text']}"
        result.append(f"- {head}")
        result += [f"  {line}" if line else "" for line in rest]
    return result


class Parser(MystParser):
    """MyST, with the Google-style sections of a docstring turned into lists first."""

    def parse(self, inputstring: str, document) -> None:
        super().parse(google_sections_to_markdown(inputstring), document)

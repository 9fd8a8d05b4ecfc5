"""The mixer options table of docs/guides/options.md, generated from the registered mixers'
`Config` dataclasses (`layers.options`).

The page holds the table between two markers::

    <!-- table: mixer.options -->
    ...
    <!-- /table -->

`fill(text)` rewrites that block from the registry; the docs build (`docs/conf.py`) fills the
page as Sphinx reads it, so the site lists every registered mixer's options, a new mixer's
included, with nothing to edit. `python docs/options_table.py` rewrites the committed page.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

from linear_attention.fields import field_spec
from linear_attention.models.options import option_classes

PAGE = Path(__file__).resolve().parent / "guides" / "options.md"
BLOCK = re.compile(r"(<!-- table: mixer\.options -->\n)(.*?)(<!-- /table -->)", re.DOTALL)


def _type(cls, name: str) -> str:
    hint = typing.get_type_hints(cls)[name]
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rows() -> list[tuple[str, str, str, str]]:
    """One row per option: its name, type, the mixers that take it (with a default of their
    own in brackets where it differs from the first one's), and its help line."""
    out = []
    for name, classes in sorted(option_classes().items()):
        fields = [next(f for f in dataclasses.fields(c) if f.name == name) for c in classes]
        first = fields[0].default
        takers = [
            c.MIXER + ("" if f.default == first else f" ({f.default!r})")
            for c, f in zip(classes, fields, strict=True)
        ]
        help_ = field_spec(fields[0]).help
        out.append((name, _type(classes[0], name), f"{first!r}: {', '.join(takers)}", help_))
    return out


def table() -> str:
    lines = ["| option | type | default: mixers (their own default) | what it sets |"]
    lines.append("|---|---|---|---|")
    for name, kind, takers, help_ in rows():
        lines.append(f"| `{name}` | `{_cell(kind)}` | {_cell(takers)} | {_cell(help_)} |")
    return "\n".join(lines) + "\n"


def fill(text: str) -> str:
    """`text` with its marked options table regenerated."""
    return BLOCK.sub(lambda m: m[1] + table() + m[3], text)


if __name__ == "__main__":
    PAGE.write_text(fill(PAGE.read_text()))
    sys.exit(0)

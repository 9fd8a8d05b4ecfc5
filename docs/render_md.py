"""The API reference's renderer: autodoc2's MyST renderer, with a dataclass field's default shown
as its value.

autodoc2 reads the source without running it, so a field declared through a helper
(`method: str = METHOD.field(choices=...)`, `spec_field(64, ...)`, `dataclasses.field(...)`)
shows that call as its value (and a field without a default, None). Here the class is imported
and the field's default (or its `default_factory()`, or "(required)") is shown instead; every
other item renders as autodoc2 renders it.
`docs/conf.py` names this class in `autodoc2_render_plugin`.
"""

from __future__ import annotations

import dataclasses
import importlib

from autodoc2.render.myst_ import MystRenderer


def field_value(full_name: str) -> str | None:
    """What the dataclass field `full_name` (``pkg.mod.Class.field``) defaults to, as shown:
    the default's repr (or its `default_factory()`'s), ``(required)`` without one; None when
    `full_name` is no dataclass field."""
    owner_path, _, name = full_name.rpartition(".")
    module_path, _, owner_name = owner_path.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module_path), owner_name)
    except (ImportError, AttributeError, ValueError):
        return None
    if not dataclasses.is_dataclass(owner):
        return None
    field = {f.name: f for f in dataclasses.fields(owner)}.get(name)
    if field is None:
        return None
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "(required)"


class Shown:
    """A value autodoc2 prints as given (``str()``; a ``str`` it would quote as a literal)."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


class Renderer(MystRenderer):
    """MyST, with dataclass fields' real defaults."""

    def render_data(self, item):
        if item["type"] == "attribute":
            shown = field_value(item["full_name"])
            if shown is not None:
                item = {**item, "value": Shown(shown)}
        yield from super().render_data(item)

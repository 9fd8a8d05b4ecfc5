"""The field checker: one place that says what a configuration value may be.

Every config section (`training.config`), `ModelConfig` and every mixer's options
(`layers.options`) are frozen dataclasses whose fields are checked here, so a value is refused
in one of three messages, whoever owns it, or a rule between fields in a fourth:

    <name> must be <requirement>, got <value>[ (<type>)]      wrong type or out of range
    unknown <name> <value>[ for <owner>]; allowed: a, b, c     a string outside its choices
    <path> is not a field: <owner> does not use option ...      a field the dataclass lacks
    config.<name> <message>                                     a rule between fields broken

A field's requirement is its annotation (bool, int, float, str, a tuple of ints, each possibly
``| None``) and the `Spec` in its metadata (`spec_field`): a minimum, a range, choices, or a
converter for a rule of its own. NumPy scalars are accepted and stored as Python values; bools
are never numbers and numbers never bools. The rules that tie several fields together stay
with the dataclass that owns them (its `__post_init__`), each in one place.

This module imports nothing of the package (every floor above uses it).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

_INTS = (int, np.integer)
_BOOLS = (bool, np.bool_)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a field may hold beyond its type: numbers `minimum` (integers) or the interval
    from `low` to `high` (`low_open`: excluding `low`), `choices` (strings), or `convert`, a
    function `(name, value) -> value` raising ValueError for a rule of its own. `help` is the
    line shown by `la-train --help`."""

    help: str = ""
    minimum: int | None = 1  # integers: None is any integer
    low: float | None = None  # floats: None is any finite number
    high: float = math.inf
    low_open: bool = False
    choices: tuple | None = None
    convert: Callable[[str, Any], Any] | None = None


# The `Spec` of a number that must be > 0 (``spec_field(1.0, "...", **POSITIVE)``).
POSITIVE = dict(low=0.0, low_open=True)


def spec_field(default=dataclasses.MISSING, help: str = "", **spec) -> Any:
    """A dataclass field with its `Spec` (``dataclasses.field(default, metadata=...)``)."""
    return dataclasses.field(default=default, metadata={"spec": Spec(help=help, **spec)})


def field_spec(field: dataclasses.Field) -> Spec:
    return field.metadata.get("spec", Spec())


def fail(name: str, requirement: str, value, *, show_type: bool = False):
    """Raise the checker's ValueError: ``<name> must be <requirement>, got <value>``."""
    kind = f" ({type(value).__name__})" if show_type else ""
    raise ValueError(f"{name} must be {requirement}, got {value!r}{kind}")


def broken(name: str, message: str):
    """Raise the checker's ValueError for a rule between fields: ``config.<name> <message>``
    (the rule stays with the dataclass that owns it)."""
    raise ValueError(f"config.{name} {message}")


def check_int(name: str, value, minimum: int | None = 1) -> int:
    """``value`` as a Python int ``>= minimum`` (None: any integer)."""
    requirement = "an integer" if minimum is None else f"an integer >= {minimum}"
    if not isinstance(value, _INTS) or isinstance(value, _BOOLS):
        fail(name, requirement, value, show_type=True)
    if minimum is not None and value < minimum:
        fail(name, requirement, value)
    return int(value)


def _interval(low, high, low_open) -> str:
    if low is None:
        return "a finite number"
    if low == 0 and low_open and high == math.inf:
        return "a finite number > 0"
    return f"in {'(' if low_open else '['}{low}, {high}]"


def check_float(name: str, value, low: float | None = 0.0, high=math.inf, *, low_open=True):
    """``value`` as a finite Python float in the interval (by default > 0; ``low=None``: any
    finite number)."""
    requirement = _interval(low, high, low_open)
    if not isinstance(value, int | float | np.integer | np.floating) or isinstance(value, _BOOLS):
        fail(name, requirement, value, show_type=True)
    value = float(value)
    inside = low is None or ((value > low if low_open else value >= low) and value <= high)
    if not (math.isfinite(value) and inside):
        fail(name, requirement, value)
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, _BOOLS):
        fail(name, "a bool", value, show_type=True)
    return bool(value)


def check_str(name: str, value) -> str:
    if not isinstance(value, str):
        fail(name, "a string", value, show_type=True)
    return value


def closest(value, choices) -> str | None:
    """The one of ``choices`` closest to a misspelled string ``value`` (`difflib`), or None."""
    if not isinstance(value, str):
        return None
    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
    return close[0] if close else None


def did_you_mean(value, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` (`closest`), else ``""``: the one
    suggestion of every refused name (mixers, presets, tasks, choices of a field)."""
    match = closest(value, choices)
    return f" (did you mean {match!r}?)" if match is not None else ""


def check_choice(name: str, value, choices, owner: str = ""):
    """``value`` if it is one of ``choices``; ValueError naming it, the closest choice and the
    allowed values."""
    if value not in choices:
        where = f" for {owner}" if owner else ""
        allowed = ", ".join(map(str, choices))
        hint = did_you_mean(value, choices)
        raise ValueError(f"unknown {name} {value!r}{where}{hint}; allowed: {allowed}")
    return value


def check_int_tuple(name: str, value) -> tuple:
    ok = isinstance(value, list | tuple) and all(
        isinstance(v, _INTS) and not isinstance(v, _BOOLS) for v in value
    )
    if not ok:
        fail(name, "a tuple of integers", value, show_type=True)
    return tuple(int(v) for v in value)


def kinds(hint) -> tuple:
    """The types an annotation allows: ``int | None`` -> ``(int, NoneType)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def check_value(name: str, value, hint, spec: Spec = Spec(), owner: str = ""):
    """``value`` checked against the annotation ``hint`` and ``spec``; the stored value."""
    allowed = kinds(hint)
    if value is None:
        if type(None) in allowed:
            return None
        if str in allowed:
            fail(name, "a string", value)
    if spec.convert is not None:
        return spec.convert(name, value)
    kind = next(k for k in allowed if k is not type(None))
    if typing.get_origin(kind) is tuple:
        return check_int_tuple(name, value)
    if kind is bool:
        return check_bool(name, value)
    if kind is int:
        return check_int(name, value, spec.minimum)
    if kind is float:
        return check_float(name, value, spec.low, spec.high, low_open=spec.low_open)
    value = check_str(name, value)
    if spec.choices is not None:
        check_choice(name, value, spec.choices, owner)
    return value


# (annotations are strings under `from __future__ import annotations`: evaluated once per class)
_type_hints = functools.cache(typing.get_type_hints)


def check_fields(obj, prefix: str = "", owner: str = "", skip=()) -> None:
    """Check every field of the frozen dataclass ``obj`` against its annotation and `Spec`,
    storing the converted values; a message names the field as ``prefix + name``."""
    hints = _type_hints(type(obj))
    for field in dataclasses.fields(obj):
        if field.name in skip:
            continue
        value = check_value(
            prefix + field.name,
            getattr(obj, field.name),
            hints[field.name],
            field_spec(field),
            owner,
        )
        object.__setattr__(obj, field.name, value)


def unknown_field(path: str, name: str, value, owner: str, known) -> ValueError:
    """The error for a field ``name`` (at ``path``) that ``owner`` does not have."""
    return ValueError(
        f"{path} is not a field: {owner} does not use option {name}={value!r} "
        f"(known fields: {', '.join(known) or 'none'})"
    )


def build(cls, values: Mapping, *, prefix: str = "", owner: str = "", shown=None):
    """``cls(**values)`` for a frozen dataclass ``cls`` whose `__post_init__` checks its fields:
    a name ``cls`` lacks raises `unknown_field` (listing ``shown``, default every field) and a
    missing required field ``<prefix><name> is required``, rather than a TypeError."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name, value in values.items():
        if name not in fields:
            raise unknown_field(prefix + name, name, value, owner, shown or list(fields))
    for name, field in fields.items():
        no_default = field.default is dataclasses.MISSING
        if name not in values and no_default and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"{prefix}{name} is required")
    return cls(**values)

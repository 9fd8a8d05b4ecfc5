"""The flat spelling of mixer options, accepted for a release with a `DeprecationWarning`.

Mixer options were fields of `ModelConfig` until they moved into `ModelConfig.options`
(`models.options`): ``ModelConfig(state_dim=16)``, ``model_section(chunk_size=32)``,
``--config.model.method=scan``, a sweep axis ``model.window`` and a run's config.json with
``model.<option>`` keys. Each still works: `move_options` moves such keywords into `options`
and `new_path` rewrites a dotted path, with one warning line that gives the new spelling. An
old config.json's unset (null) options are dropped without one: they say nothing to respell.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from linear_attention.models.options import option_classes, pairs

# Every spelling warning says this (the command lines show such warnings: `cli_args`).
SPELLING = "is now spelled"
_PREFIX = "model."


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{old} {SPELLING} {new} (mixer options moved into model.options; the old spelling "
        "goes in a later release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def is_moved(name: str) -> bool:
    """Whether `name` was a `ModelConfig` field that is now an `options` key."""
    return name in option_classes()


def move_options(
    values: Mapping, where: str = "model", stacklevel: int = 4, *, strict: bool = False
) -> dict:
    """`ModelConfig` keywords `values` with the old flat mixer options moved into `options`,
    warning once when any was set. An old one set beside a different new one: the old wins
    (``dataclasses.replace(config, chunk_size=16)`` passes both), or with `strict` (a config
    file's section, where the new one may be a command-line override) a ValueError."""
    moved = [k for k in values if is_moved(k)]
    if not moved:
        return dict(values)
    rest = {k: v for k, v in values.items() if k not in moved}
    given = {k: values[k] for k in moved if values[k] is not None}
    options = dict(pairs(rest.get("options") or {}))
    if given:
        old = ", ".join(f"{where}.{k}" for k in given)
        warn(old, ", ".join(f"{where}.options.{k}" for k in given), stacklevel)
    if strict:
        _check_both(given, options, where)
    rest["options"] = {**options, **given}
    return rest


def _check_both(given: Mapping, options: Mapping, where: str) -> None:
    for name, value in given.items():
        if options.get(name) is not None and options[name] != value:
            raise ValueError(
                f"{where}.{name}={value!r} (the old spelling) and {where}.options.{name}="
                f"{options[name]!r} are both set; keep {where}.options.{name} only"
            )


def new_path(path: str) -> str | None:
    """A dotted config path in the new spelling (``model.window`` -> ``model.options.window``),
    or None when it is not an old one."""
    if path.startswith(_PREFIX) and is_moved(path[len(_PREFIX) :]):
        return f"{_PREFIX}options.{path[len(_PREFIX) :]}"
    return None


def old_path(path: str) -> str | None:
    """The old spelling of a new mixer option path (`new_path` backwards), or None."""
    head = f"{_PREFIX}options."
    if path.startswith(head) and is_moved(path[len(head) :]):
        return _PREFIX + path[len(head) :]
    return None


def respelled(path: str, stacklevel: int = 3) -> str:
    """`path` in the new spelling, warning when it was an old one."""
    new = new_path(path)
    if new is None:
        return path
    warn(path, new, stacklevel + 1)
    return new


def read(config, name: str):
    """``config.<name>`` of an old flat option: its `options` value (None: unset), warned."""
    warn(f"ModelConfig.{name}", f"ModelConfig.options[{name!r}]", stacklevel=4)
    return config.options.get(name)

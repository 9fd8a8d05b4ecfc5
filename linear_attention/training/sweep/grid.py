"""A sweep's grid: its axes, every point of their product (a config each), ``--only``
selections, the order points are trained in, and loading a sweep config file.

A sweep config (``get_config(arg)``) has ``base`` (a config of ``configs/mqar.py`` or
``configs/lm.py``), ``grid`` (axis name -> ``ConfigDict(field, choices, labels)``; ``field`` is
a dotted path such as ``model.d_model`` or a tuple of paths set together, each choice a value or
a tuple of values), ``tune`` (the axis whose best choice is kept per setting), optionally
``replicate`` (an axis of repeated runs, the seed) and ``order`` (the axes from outermost to
innermost in the order points are trained, each in the order of its choices), and, for MQAR,
``plot`` (the axes for x, lines and panels).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import os
import re
from pathlib import Path

import ml_collections

from linear_attention.models.legacy import respelled
from linear_attention.training.config import experiment_config


@dataclasses.dataclass(frozen=True)
class Axis:
    name: str
    fields: tuple[str, ...]
    choices: tuple[tuple, ...]  # one tuple of values (one per field) per choice
    labels: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Point:
    name: str
    labels: dict  # axis name -> label
    values: dict  # field path -> value
    config: ml_collections.ConfigDict


def format_label(value) -> str:
    """A choice as a file-name word: ``64``, ``0.01``, a tuple as ``64x8``."""
    if isinstance(value, tuple | list):
        return "x".join(format_label(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def format_value(value) -> str:
    """A field value for the CSV: a hybrid's mixer tuple as ``gated+softmax``."""
    if isinstance(value, tuple | list):
        return "+".join(format_value(v) for v in value)
    return format_label(value)


def _get(config, path: str):
    node = config
    for part in path.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise ValueError(f"grid field {path!r} is not in the base config (no {part!r})")
        node = node[part]
    return node


def _set(config, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node[part]
    try:
        node[leaf] = value
    except TypeError:  # a hybrid's mixer tuple replaces a name; None a placeholder
        # (only then: ignore_type walks the whole subtree, every string's characters included,
        # which made expansion most of a large grid's validation time; a value of the field's
        # type is stored the same either way)
        with node.ignore_type():
            node[leaf] = value


def grid_axis(field, choices, labels=None) -> ml_collections.ConfigDict:
    """One axis of a sweep config's ``grid``: a config field (or a tuple of fields set together)
    and its choices, with optional labels for the run names (`parse_axes` checks it)."""
    return ml_collections.ConfigDict(dict(field=field, choices=tuple(choices), labels=labels))


def parse_axes(sweep) -> list[Axis]:
    """The grid's axes (sorted by name), checked against ``sweep.base``."""
    if "base" not in sweep or "grid" not in sweep:
        raise ValueError(f"a sweep config needs `base` and `grid`; got fields {list(sweep)}")
    axes = []
    for name in sorted(sweep.grid):
        spec = sweep.grid[name]
        if not isinstance(spec, ml_collections.ConfigDict) or "field" not in spec:
            raise ValueError(f"grid.{name} must be a ConfigDict(field=..., choices=...)")
        fields = (spec.field,) if isinstance(spec.field, str) else tuple(spec.field)
        fields = tuple(respelled(field) for field in fields)  # (an old `model.window`, warned)
        for field in fields:
            _get(sweep.base, field)
        if not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise ValueError(f"grid axis name {name!r} must be letters, digits and _")
        choices = tuple(spec.choices)
        if not choices:
            raise ValueError(f"grid.{name}.choices is empty")
        as_tuples = []
        for choice in choices:
            values = choice if len(fields) > 1 else (choice,)
            if len(fields) > 1 and (
                not isinstance(choice, tuple | list) or len(choice) != len(fields)
            ):
                raise ValueError(
                    f"grid.{name}: choice {choice!r} must hold {len(fields)} values for {fields}"
                )
            as_tuples.append(tuple(values))
        labels = spec.get("labels") or tuple(format_label(c) for c in choices)
        labels = tuple(str(label) for label in labels)
        if len(labels) != len(choices):
            raise ValueError(
                f"grid.{name}: {len(labels)} labels for {len(choices)} choices; give one each"
            )
        bad = [label for label in labels if not re.fullmatch(r"[A-Za-z0-9_.+x-]+", label)]
        if bad or len(set(labels)) != len(labels):
            raise ValueError(f"grid.{name}: labels must be distinct file-name words, got {labels}")
        axes.append(Axis(name, fields, tuple(as_tuples), labels))
    tune = sweep.get("tune")
    if tune is not None and tune not in [a.name for a in axes]:
        raise ValueError(f"tune={tune!r} is not a grid axis; axes: {[a.name for a in axes]}")
    return axes


def parse_only(only: list[str], axes: list[Axis]) -> dict[str, set[str]]:
    """``["mixer=softmax,linear", ...]`` -> {axis: labels}; unknown names raise."""
    by_name = {a.name: a for a in axes}
    selected = {}
    for item in only:
        name, sep, labels = item.partition("=")
        if not sep or name not in by_name:
            raise ValueError(f"--only {item!r}: want AXIS=LABEL[,LABEL...]; axes: {list(by_name)}")
        wanted = set(labels.split(","))
        unknown = wanted - set(by_name[name].labels)
        if unknown:
            raise ValueError(
                f"--only {item!r}: unknown {name} labels {sorted(unknown)}; "
                f"known: {list(by_name[name].labels)}"
            )
        selected.setdefault(name, set()).update(wanted)
    return selected


def expand(sweep, only: list[str] = ()) -> tuple[list[Axis], list[Point]]:
    """Every point of the grid (the product of the axes), in a deterministic order."""
    axes = parse_axes(sweep)
    selected = parse_only(list(only), axes)
    points = []
    for combo in itertools.product(*(range(len(a.choices)) for a in axes)):
        labels = {a.name: a.labels[i] for a, i in zip(axes, combo, strict=True)}
        if any(labels[name] not in wanted for name, wanted in selected.items()):
            continue
        config = copy.deepcopy(sweep.base)  # keeps FieldReferences (vocab_size) linked
        values = {}
        for axis, i in zip(axes, combo, strict=True):
            for field, value in zip(axis.fields, axis.choices[i], strict=True):
                _set(config, field, value)
                values[field] = value
        name = "_".join(f"{a.name}-{labels[a.name]}" for a in axes)
        points.append(Point(name, labels, values, config))
    return axes, points


def load_sweep(spec: str):
    """``path[:preset]`` -> the sweep ConfigDict of ``get_config(preset)``."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ValueError(f"--config {spec!r}: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"sweep_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def prepare(sweep, only=()) -> tuple[list[Axis], list[Point]]:
    """The selected points, every one validated (`experiment_config`) before any is trained."""
    axes, points = expand(sweep, only)
    if not points:
        raise ValueError("no grid point selected")
    for point in points:
        experiment_config(point.config)
    return axes, points


def run_order(sweep, axes: list[Axis], points: list[Point]) -> list[Point]:
    """The order points are trained in: ``sweep.order`` (axis names, outermost first, each
    axis in the order of its choices) when given, else a setting's runs (every learning rate
    and seed) one after another, so that an interrupted sweep leaves whole settings."""
    by_name = {a.name: a for a in axes}
    order = list(sweep.get("order") or ())
    unknown = sorted(set(order) - set(by_name))
    if unknown:
        raise ValueError(f"order names unknown axes {unknown}; axes: {list(by_name)}")
    if order:
        return sorted(
            points, key=lambda p: tuple(by_name[a].labels.index(p.labels[a]) for a in order)
        )
    cell = [a.name for a in axes if a.name not in (sweep.get("tune"), sweep.get("replicate"))]
    first = {}
    for p in points:
        first.setdefault(tuple(p.labels[k] for k in cell), len(first))
    return sorted(points, key=lambda p: first[tuple(p.labels[k] for k in cell)])


def axis_named(axes: list[Axis], name: str) -> Axis:
    return next(a for a in axes if a.name == name)


def panel_title(axis: Axis, label: str) -> str:
    """``seq_len=64, num_kv_pairs=8``: the fields an axis label stands for."""
    values = axis.choices[axis.labels.index(label)]
    pairs = zip(axis.fields, values, strict=True)
    return ", ".join(f"{field.split('.')[-1]}={format_label(v)}" for field, v in pairs)

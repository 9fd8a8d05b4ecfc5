"""A sweep's results: one row per point (from the run folders, or read back from a
results.csv), the best ``tune`` choice per setting averaged over the ``replicate`` runs as
Zoology does, and the CSV files (written whole or not at all)."""

from __future__ import annotations

import csv
import functools
import json
import math
import os
from pathlib import Path

import numpy as np

from linear_attention.models.legacy import old_path
from linear_attention.training.config import experiment_config
from linear_attention.training.data_kinds import DATA_KINDS
from linear_attention.training.sweep.grid import Axis, Point, format_value
from linear_attention.training.sweep.points import state_bytes

# The metric each kind of run is judged by, and whether larger is better (MAD's accuracy is
# class-macro, state tracking's the mean over the evaluation lengths).
METRICS = {kind: entry.config.METRIC for kind, entry in DATA_KINDS.items()}


SUMMARY_KEYS = (
    "eval/accuracy",
    "eval/loss",
    "eval/bits_per_byte",
    "train/loss",
    "train/accuracy",
    "tokens_per_sec",
    "param_count",
    "train_time_sec",
    "compile_time_sec",
    "wall_time_sec",
    "step",
    "stopped_early",
    "resumed_from_step",
)

# The corpus record of a text run's summary (``summary["corpus"]``) carried into results rows.
CORPUS_KEYS = ("python", "path", "bytes", "sha256", "tokenizer")

# The machine record of a run's summary (``summary["machine"]``) carried into results rows: a
# rerun on another processor can differ in rounding, and these say whether the machine changed.
MACHINE_KEYS = ("cpu_model", "cpu_id", "cpu_flags", "device_kind", "jax_version")


def collect(axes: list[Axis], points: list[Point], runs_dir: Path) -> list[dict]:
    """One row per point: axis labels, field values, status, state bytes and final metrics."""
    rows = []
    for point in points:
        cfg = experiment_config(point.config)
        run_dir = runs_dir / point.name
        row = {"point": point.name, **point.labels}
        row.update({field: format_value(v) for field, v in point.values.items()})
        row["state_bytes"] = state_bytes(cfg)
        if (run_dir / "summary.json").exists():
            summary = json.loads((run_dir / "summary.json").read_text())
            row["status"] = "ok"
            # (and every other eval/ metric: state tracking's accuracy per length)
            row.update(
                {k: v for k, v in summary.items() if k in SUMMARY_KEYS or k.startswith("eval/")}
            )
            # what an LM run's corpus was (its figures depend on it: the built-in corpus is
            # the running Python's standard library)
            corpus = summary.get("corpus") or {}
            row.update({f"corpus/{k}": corpus[k] for k in CORPUS_KEYS if k in corpus})
            machine = summary.get("machine") or {}
            row.update({f"machine/{k}": machine[k] for k in MACHINE_KEYS if k in machine})
            if (run_dir / "decode.json").exists():
                decode = json.loads((run_dir / "decode.json").read_text())
                row["decode_tokens_per_sec"] = decode["decode_tokens_per_sec"]
        elif (run_dir / "failed.json").exists():
            row["status"] = "diverged"
        else:
            row["status"] = "pending"
        rows.append(row)
    return rows


def _number(text: str):
    """A results.csv cell back to the value `collect` wrote: int, float, bool or None."""
    if text in ("", "None"):
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return float(text)


def _base_value(base, field: str):
    return functools.reduce(lambda node, part: node[part], field.split("."), base)


def _check_fields(path: Path, old: dict, point: Point, row: dict, base) -> None:
    """A saved row must have the grid point's field values (the file is of this grid)."""
    for field in point.values:
        # (a file written before mixer options moved has `model.window`, not its new spelling)
        saved = field if field in old else (old_path(field) or field)
        # A field the file lacks is one the grid gained later: its runs had the base's value.
        if saved not in old and row[field] == format_value(_base_value(base, field)):
            continue
        if old.get(saved) != row[field]:
            raise ValueError(
                f"{path}: point {point.name} has {field} = {old.get(saved)!r} but the grid "
                f"has {row[field]!r}; the file is of another grid"
            )


def results_paths(paths) -> list[Path]:
    """One results.csv path (str or path-like), or several, as a list of paths."""
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def check_results_header(path, columns) -> None:
    """A results.csv a sweep wrote has ``point``, ``status`` and ``state_bytes`` columns."""
    missing = [c for c in ("point", "status", "state_bytes") if c not in (columns or ())]
    if missing:
        raise ValueError(f"{path}: not a sweep's results.csv (no {', '.join(missing)} column)")


def rows_from_csv(axes: list[Axis], points: list[Point], paths, base) -> list[dict]:
    """The rows of `collect`, read back from the results.csv files earlier sweeps of this grid
    wrote (e.g. ``docs/results/mqar_sweep_cpu.csv``; one path or several: each point's row is
    the first finished one, in the order given, else its first row), for tables and figures
    without the run directories. A point no file has is pending; a row whose field values
    differ from its point's raises (the file is of another grid). A field column a file lacks
    (the grid gained it later) matches points whose value is the one its runs had: ``base``'s
    (the sweep's base config)."""
    paths = results_paths(paths)
    by_name = {point.name: point for point in points}
    grid_rows = {}
    for point in points:
        row = {"point": point.name, **point.labels}
        row.update({field: format_value(v) for field, v in point.values.items()})
        grid_rows[point.name] = row
    saved: dict[str, dict] = {}
    for path in paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            check_results_header(path, reader.fieldnames)
            for old in reader:
                name = old["point"]
                if name not in by_name:
                    continue  # outside this selection of the grid (--only)
                _check_fields(path, old, by_name[name], grid_rows[name], base)
                first = saved.get(name)
                if first is None or (first["status"] != "ok" and old["status"] == "ok"):
                    saved[name] = old
    rows = []
    for point in points:
        row, old = grid_rows[point.name], saved.get(point.name)
        if old is None:
            row["state_bytes"] = state_bytes(experiment_config(point.config))
            row["status"] = "pending"
            rows.append(row)
            continue
        row["state_bytes"] = int(old["state_bytes"])
        row["status"] = old["status"]
        extra = [k for k in old if k.startswith("eval/") and k not in SUMMARY_KEYS]
        for key in (*SUMMARY_KEYS, *extra, "decode_tokens_per_sec"):
            value = _number(old.get(key, ""))
            if value is not None:
                row[key] = value
        # (text, kept as written: a version such as 0.4.38 is not a number)
        row.update({k: v for k, v in old.items() if k.startswith("machine/") and v})
        rows.append(row)
    return rows


def metric_value(row: dict, kind: str) -> float:
    key, _ = METRICS[kind]
    value = row.get(key)
    return float(value) if row["status"] == "ok" and value is not None else math.nan


def best_rows(
    rows: list[dict],
    axes: list[Axis],
    tune: str | None,
    kind: str,
    replicate: str | None = None,
    *,
    partial: bool = False,
) -> list[dict]:
    """One row per setting (every axis but ``tune`` and ``replicate``): the ``tune`` choice
    (learning rate) whose metric averaged over the ``replicate`` runs (seeds) is best, as
    Zoology. A choice with a diverged run is not eligible; a setting with none eligible keeps
    one diverged row; settings with a pending run are left out. The row is the choice's first
    run with the metric replaced by the mean and ``<metric> min`` / ``max`` (the spread over
    the replicates), ``<metric> runs`` (each value), ``seeds`` (how many) and ``tuned over``
    (``finished/all`` choices of ``tune``) added. ``partial``: a setting with pending runs is
    tuned over its finished choices (all of their replicates done) instead of left out."""
    key, larger = METRICS[kind]
    keys = [a.name for a in axes if a.name not in (tune, replicate)]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    best = []
    for group in groups.values():
        if any(r["status"] == "pending" for r in group) and not partial:
            continue
        by_choice: dict[str | None, list[dict]] = {}
        for row in group:
            by_choice.setdefault(row[tune] if tune else None, []).append(row)
        finished = {
            c: runs
            for c, runs in by_choice.items()
            if not any(r["status"] == "pending" for r in runs)
        }
        if not finished:
            continue
        tuned_over = f"{len(finished)}/{len(by_choice)}"
        group = [r for runs in finished.values() for r in runs]
        candidates = []
        for runs in finished.values():
            values = [metric_value(r, kind) for r in runs]
            if all(math.isfinite(v) for v in values):
                candidates.append((float(np.mean(values)), runs, values))
        if not candidates:
            failed = [r for r in group if r["status"] != "ok"]
            cell = dict(failed[0] if failed else group[0])
            cell.update({key: math.nan, "seeds": 0, "tuned over": tuned_over})
            best.append(cell)
            continue
        sign = -1.0 if larger else 1.0
        mean, runs, values = min(candidates, key=lambda c: sign * c[0])
        cell = dict(runs[0])
        cell.update(
            {
                key: mean,
                f"{key} min": min(values),
                f"{key} max": max(values),
                f"{key} runs": "/".join(f"{v:.4f}" for v in values),
                "seeds": len(values),
                "tuned over": tuned_over,
            }
        )
        best.append(cell)
    return best


def write_csv(path: Path, rows: list[dict]) -> None:
    """Written to a temporary file and renamed: a reader never sees half a table."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)

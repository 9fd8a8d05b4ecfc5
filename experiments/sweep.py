"""A grid of training runs with the best learning rate kept per setting, as Zoology does.

    python experiments/sweep.py --config configs/sweeps/mqar.py:cpu --workdir runs/mqar-sweep
    python experiments/sweep.py --config configs/sweeps/lm.py:cpu --workdir runs/lm-sweep
    ... --dry-run                        # print the grid (parameters, state bytes), train nothing
    ... --only mixer=softmax,linear      # train a subset (repeatable; labels of that axis)
    ... --report-only                    # tables and plots from the finished points only
    ... --report-only --only lr=0.01     # ... of a part of the grid (tuned over those lrs)
    ... --report-only --partial          # ... tuned over each setting's finished lrs
    ... --report-only --results-csv docs/results/mqar_sweep_cpu.csv
                                         # ... of the runs in that file (no run folders)
    ... --jobs 2                         # two worker processes, one XLA thread each

Tables and plots always cover the whole grid; a setting with a run still pending is left out.

A sweep config (``get_config(arg)``) has ``base`` (a config of ``configs/mqar.py`` or
``configs/lm.py``), ``grid`` (axis name -> ``ConfigDict(field, choices, labels)``; ``field`` is
a dotted path such as ``model.d_model`` or a tuple of paths set together, each choice a value or
a tuple of values), ``tune`` (the axis whose best choice is kept per setting, the learning rate),
optionally ``replicate`` (an axis of repeated runs, the seed: ``tune`` then picks the choice with
the best mean over them, and the tables and plots show the mean and the min–max over them) and
``order`` (the axes from outermost to innermost in the order points are trained, each in the
order of its choices), and, for MQAR, ``plot`` (the axes for x, lines and panels). Every point
of the product is a run of `linear_attention.training.train` in ``workdir/runs/<point>/``: a
point whose
``summary.json`` exists is skipped (its ``config.json`` must match the grid's), one without
resumes from its latest checkpoint, one that diverged (``failed.json``) is recorded as such.

With ``--jobs N`` the unfinished points are trained by N worker processes (``sweep.py
--worker``, one XLA thread each: these small models leave a second intra-op thread idle), a
setting's seeds on one worker in a row (they share its compiled step); only this process writes
the results files. A run that stops early (``train.stop_at``) counts as finished. Ctrl-C (or
SIGTERM) stops the sweep after every run in progress has saved a checkpoint (the workers get
the signal from this process, once), exits with 130, and the same command resumes.

Outputs in the workdir: ``results.csv`` (every run, with its seed, steps run and whether it
stopped early), ``best.csv`` and ``results.md`` (the best learning rate per setting) and plots.
MQAR: ``accuracy_vs_d_model.png`` (one line per mixer, one panel per (seq_len, kv pairs),
Zoology Fig. 2; error bars: the min–max over seeds) and ``accuracy_vs_state_bytes.png`` (one
point per best-lr setting against `state_size_bytes`, log x: the Based recall–memory plot).
The state of a softmax model is its KV cache at ``data.seq_len`` (not ``model.max_length``),
the context the task needs. LM: validation bits per byte, training tokens/s (``summary.json``)
and decoding tokens/s, measured after training on a freshly built model of the same config (the
weights do not change the work per token): ``step_fn`` over a whole ``seq_len`` context from an
empty state at ``decode_batch_size`` sequences, after one compiling step; written to
``decode.json``. ``loss_curves.png`` plots every best-lr run's training loss (in bits per byte)
and its validation points from ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import csv
import dataclasses
import functools
import importlib.util
import itertools
import json
import math
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from linear_attention.models import LanguageModel, state_size_bytes, step_fn  # noqa: E402
from linear_attention.training import NonFiniteLossError, experiment_config, train  # noqa: E402
from linear_attention.training.config import config_difference  # noqa: E402
from linear_attention.training.metrics import Reporter, read_jsonl, write_json  # noqa: E402

# The metric each kind of run is judged by, and whether larger is better.
METRICS = {"mqar": ("eval/accuracy", True), "text": ("eval/bits_per_byte", False)}
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
# Worker processes (--jobs N) run XLA on one thread each: these models are too small for
# XLA's intra-op threads to keep two cores busy (EXPERIMENTS.md, the MQAR study).
WORKER_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
_RESULT = "@@sweep-result "


# --------------------------------------------------------------------------- the grid
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


def _label(value) -> str:
    if isinstance(value, tuple | list):
        return "x".join(_label(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _value(value) -> str:
    """A field value for the CSV: a hybrid's mixer tuple as ``gated+softmax``."""
    if isinstance(value, tuple | list):
        return "+".join(_value(v) for v in value)
    return _label(value)


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
    with node.ignore_type():  # a hybrid's mixer tuple replaces a name; None a placeholder
        node[leaf] = value


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
        labels = spec.get("labels") or tuple(_label(c) for c in choices)
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


# --------------------------------------------------------------------------- running
def _check_finished(run_dir: Path, cfg) -> None:
    saved = json.loads((run_dir / "config.json").read_text())
    config_dict = json.loads(json.dumps(cfg.to_dict()))
    diff = config_difference(saved, config_dict, cfg)
    if diff:
        raise ValueError(
            f"{run_dir} finished with config.{diff[0]} = {diff[1]!r} but the grid now has "
            f"{diff[2]!r}; use another --workdir (or delete that run) to run the new grid"
        )


def model_config_at(cfg, context: int):
    """The run's `ModelConfig` with ``max_length`` = the context (sizes the softmax cache)."""
    return dataclasses.replace(cfg.model, max_length=context)


@functools.cache
def _state_bytes(model_cfg) -> int:
    return state_size_bytes(model_cfg)


def measure_decode(cfg, batch_size: int) -> dict:
    """Decoding throughput of a fresh model of ``cfg.model``: ``step`` over a whole
    ``data.seq_len`` context from an empty state, after one compiling step."""
    model_cfg = model_config_at(cfg, cfg.data.seq_len)
    model = LanguageModel(model_cfg, rngs=nnx.Rngs(cfg.seed))
    step = step_fn(model)
    tokens_B = jnp.full((batch_size,), 32, jnp.int32)
    num_tokens = cfg.data.seq_len
    jax.block_until_ready(step(tokens_B, model.init_state(batch_size, num_tokens)))  # compile
    state = model.init_state(batch_size, num_tokens)
    start = time.perf_counter()
    for _ in range(num_tokens):
        logits_BV, state = step(tokens_B, state)
    jax.block_until_ready(logits_BV)
    seconds = time.perf_counter() - start
    return {
        "decode_tokens_per_sec": batch_size * num_tokens / seconds,
        "decode_ms_per_step": 1e3 * seconds / num_tokens,
        "decode_batch_size": batch_size,
        "decode_context": num_tokens,
        "decode_weights": "fresh model of the same config",
    }


def is_finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists() or (run_dir / "failed.json").exists()


def run_point(config, run_dir: Path, *, decode_batch_size: int, log=print) -> str:
    """Train (or skip / resume) one point's config; returns its status: done, skipped or
    diverged."""
    cfg = experiment_config(config)
    summary_path, failed_path = run_dir / "summary.json", run_dir / "failed.json"
    if summary_path.exists() or failed_path.exists():
        _check_finished(run_dir, cfg)
        status = "skipped"
        log("  skipped (finished)")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(run_dir / "train.log", "a") as stream:
            reporter = Reporter(cfg.train.num_steps, stream=stream, tty=False)
            try:
                train(cfg, str(run_dir), reporter=reporter)
                status = "done"
            except NonFiniteLossError as e:
                write_json(str(failed_path), {"error": str(e)})
                status = "diverged"
        log(f"  {status} in {time.perf_counter() - start:.0f} s")
    if cfg.data.kind == "text" and summary_path.exists() and not (run_dir / "decode.json").exists():
        write_json(str(run_dir / "decode.json"), measure_decode(cfg, decode_batch_size))
    return status


def _worker_main() -> int:
    """``sweep.py --worker``: run the points sent on stdin (one pickled, base64 line each:
    config, run directory, decode batch size) and answer each with a result line."""
    try:
        for line in sys.stdin:
            cfg, run_dir, decode_batch_size = pickle.loads(base64.b64decode(line))
            start = time.perf_counter()
            try:
                status = run_point(
                    cfg, Path(run_dir), decode_batch_size=decode_batch_size, log=quiet
                )
                result = {"status": status}
            except KeyboardInterrupt as e:  # the parent forwarded SIGINT (Interrupted: saved)
                result = {"interrupted": str(e) or "before training started"}
            except Exception as e:  # reported to the parent, which stops the sweep
                result = {"error": f"{type(e).__name__}: {e}"}
            result["seconds"] = time.perf_counter() - start
            print(_RESULT + json.dumps(result), flush=True)
            if "interrupted" in result:
                return 130
    except KeyboardInterrupt:  # between points: nothing to save
        return 130
    return 0


def quiet(*_):
    pass


class SweepInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the sweep; the runs in progress saved checkpoints."""


def run_parallel(
    points: list[Point], runs_dir: Path, *, jobs: int, decode_batch_size: int, log, replicate=None
):
    """Train ``points`` in ``jobs`` worker processes (one XLA thread each); every worker
    writes only its points' run directories, this process writes every results file. The
    ``replicate`` runs (seeds) of a setting go to one worker, one after the other: they share
    its compiled step (a seed changes no shape or constant), which saves a compilation each."""
    groups: dict[tuple, list[tuple[int, Point]]] = {}
    for i, point in enumerate(points):
        key = tuple(sorted((k, v) for k, v in point.labels.items() if k != replicate))
        groups.setdefault(key, []).append((i, point))
    todo = queue.Queue()
    for group in groups.values():
        todo.put(group)
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {WORKER_XLA_FLAGS}".strip()
    errors, interrupted = [], []

    def drive(worker):
        while not errors and not interrupted:
            try:
                group = todo.get_nowait()
            except queue.Empty:
                return
            for i, point in group:
                if not run_one(worker, i, point):
                    return

    def run_one(worker, i, point) -> bool:
        job = (experiment_config(point.config), str(runs_dir / point.name), decode_batch_size)
        worker.stdin.write(base64.b64encode(pickle.dumps(job)).decode() + "\n")
        worker.stdin.flush()
        for line in worker.stdout:
            if line.startswith(_RESULT):
                result = json.loads(line[len(_RESULT) :])
                break
        else:
            code = worker.wait()
            if interrupted:  # stopped by the forwarded signal before it could report
                result = {"interrupted": f"worker exited (code {code})"}
            else:
                result = {"error": f"worker exited (code {code})", "seconds": 0.0}
        if "interrupted" in result:
            interrupted.append(f"{point.name}: {result['interrupted']}")
            return False
        if "error" in result:
            errors.append(f"{point.name}: {result['error']}")
            return False
        log(
            f"[{i + 1}/{len(points)}] {point.name}: {result['status']} in {result['seconds']:.0f} s"
        )
        return True

    command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    # Workers in their own session: a Ctrl-C at the terminal reaches this process only, which
    # forwards it once (a second signal to a worker means "stop now, without a checkpoint").
    workers = [
        subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for _ in range(min(jobs, len(points)))
    ]
    threads = [threading.Thread(target=drive, args=(w,)) for w in workers]

    received = []  # signals caught and not yet forwarded

    def on_signal(signum, _frame):
        # Only set flags (no I/O in a handler, issue 23); the loop below forwards.
        received.append(signum)
        interrupted.append(signal.Signals(signum).name)  # no new points from here on

    def forward_received():
        while received:
            signum = received.pop(0)
            for worker in workers:
                if worker.poll() is None:
                    worker.send_signal(signum)

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # a timed join lets the signal handler run
                thread.join(0.1)
                forward_received()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for worker in workers:
            worker.stdin.close()
            worker.wait()
    if errors:
        raise RuntimeError("sweep worker failed: " + "; ".join(errors))
    if interrupted:
        runs = [i for i in interrupted if ": " in i]
        raise SweepInterrupted("; ".join(runs) or "before any run reported")


# --------------------------------------------------------------------------- results
def collect(axes: list[Axis], points: list[Point], runs_dir: Path) -> list[dict]:
    """One row per point: axis labels, field values, status, state bytes and final metrics."""
    rows = []
    for point in points:
        cfg = experiment_config(point.config)
        run_dir = runs_dir / point.name
        row = {"point": point.name, **point.labels}
        row.update({field: _value(v) for field, v in point.values.items()})
        row["state_bytes"] = _state_bytes(model_config_at(cfg, cfg.data.seq_len))
        if (run_dir / "summary.json").exists():
            summary = json.loads((run_dir / "summary.json").read_text())
            row["status"] = "ok"
            row.update({k: summary[k] for k in SUMMARY_KEYS if k in summary})
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


def rows_from_csv(axes: list[Axis], points: list[Point], path: Path) -> list[dict]:
    """The rows of `collect`, read back from a results.csv an earlier sweep of this grid wrote
    (e.g. ``docs/results/mqar_sweep_cpu.csv``), for tables and figures without the run
    directories. A point the file lacks is pending; one whose field values differ from the
    grid's raises (the file is of another grid)."""
    with open(path, newline="") as f:
        saved = {row["point"]: row for row in csv.DictReader(f)}
    rows = []
    for point in points:
        row = {"point": point.name, **point.labels}
        row.update({field: _value(v) for field, v in point.values.items()})
        old = saved.get(point.name)
        if old is None:
            cfg = experiment_config(point.config)
            row["state_bytes"] = _state_bytes(model_config_at(cfg, cfg.data.seq_len))
            row["status"] = "pending"
            rows.append(row)
            continue
        for field in point.values:
            if old.get(field) != row[field]:
                raise ValueError(
                    f"{path}: point {point.name} has {field} = {old.get(field)!r} but the grid "
                    f"has {row[field]!r}; the file is of another grid"
                )
        row["state_bytes"] = int(old["state_bytes"])
        row["status"] = old["status"]
        for key in (*SUMMARY_KEYS, "decode_tokens_per_sec"):
            value = _number(old.get(key, ""))
            if value is not None:
                row[key] = value
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


def _fmt(value, digits=3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def _axis_of(axes, name) -> Axis:
    return next(a for a in axes if a.name == name)


def _panel_title(axis: Axis, label: str) -> str:
    values = axis.choices[axis.labels.index(label)]
    pairs = zip(axis.fields, values, strict=True)
    return ", ".join(f"{field.split('.')[-1]}={_label(v)}" for field, v in pairs)


def _with_spread(row: dict, kind: str) -> str:
    """The mean, and the min–max over seeds when there are several: ``0.912 (0.871–0.953)``."""
    key, _ = METRICS[kind]
    text = _fmt(metric_value(row, kind))
    if row.get("seeds", 1) > 1:
        text += f" ({_fmt(row[key + ' min'])}–{_fmt(row[key + ' max'])})"
    return text


def mqar_report(best: list[dict], axes: list[Axis], sweep) -> str:
    plot = sweep.plot
    replicate = sweep.get("replicate")
    spread = " mean (min–max) over seeds," if replicate else ""
    x_axis, line_axis, panel_axis = (_axis_of(axes, plot[k]) for k in ("x", "line", "panel"))
    parts = []
    for panel in panel_axis.labels:
        cells = {
            (r[line_axis.name], r[x_axis.name]): r for r in best if r[panel_axis.name] == panel
        }
        if not cells:
            continue
        xs = [x for x in x_axis.labels if any(k[1] == x for k in cells)]
        body = []
        for line in line_axis.labels:
            if any(k[0] == line for k in cells):
                body.append(
                    [line]
                    + [
                        _with_spread(cells[line, x], "mqar") if (line, x) in cells else ""
                        for x in xs
                    ]
                )
        header = [f"{line_axis.name} \\ {x_axis.name}"] + xs
        parts.append(
            f"**{_panel_title(panel_axis, panel)}** (eval accuracy,{spread} best lr)\n\n"
            + _table(header, body)
        )
    others = [a.name for a in axes if a.name not in (sweep.get("tune"), replicate)]
    header = [*others, "state bytes", "params", sweep.get("tune") or "-", "accuracy", "status"]
    if replicate:
        header[-1:-1] = ["per seed"]
    if sweep.get("tune"):
        header[-1:-1] = [f"{sweep.get('tune')}s run"]
    body = [
        [
            *(r[k] for k in others),
            str(r["state_bytes"]),
            str(r.get("param_count", "")),
            str(r.get(sweep.get("tune"), "")),
            _with_spread(r, "mqar"),
            *([r.get("eval/accuracy runs", "")] if replicate else []),
            *([r.get("tuned over", "")] if sweep.get("tune") else []),
            r["status"],
        ]
        for r in best
    ]
    parts.append("All settings at their best learning rate:\n\n" + _table(header, body))
    return "\n\n".join(parts) + "\n"


def lm_report(best: list[dict], axes: list[Axis], sweep) -> str:
    tune = sweep.get("tune")
    others = [a.name for a in axes if a.name != tune]
    header = [
        *others,
        "params",
        tune or "-",
        "val bits/byte",
        "train tok/s",
        "decode tok/s",
        "state bytes",
        "status",
    ]
    body = [
        [
            *(r[k] for k in others),
            f"{r.get('param_count', 0):,}",
            str(r.get(tune, "")),
            _fmt(metric_value(r, "text")),
            _fmt(r.get("tokens_per_sec"), 0),
            _fmt(r.get("decode_tokens_per_sec"), 0),
            str(r["state_bytes"]),
            r["status"],
        ]
        for r in best
    ]
    return _table(header, body) + "\n"


# Lines are nudged sideways on the log x axis so that settings at the same x (same width, or the
# same state size) and their error bars stay apart: line i of n by a factor
# NUDGE ** ((i - (n - 1) / 2) / ((n - 1) / 2)), so the outermost lines sit NUDGE off their true x
# (2.5%: far enough to separate markers, near enough that a point stays at its value).
NUDGE = 1.025
# state-axis ticks: 1, 1.5, 2, 3, 5 and 7 times a power of ten bytes, shown in kB
_STATE_TICKS = [m * 10**e for e in range(2, 12) for m in (1, 1.5, 2, 3, 5, 7)]


def nudge_factors(lines) -> dict:
    """The factor each line's x is multiplied by (see `NUDGE`): 1 for a single line."""
    half = (len(lines) - 1) / 2
    return {line: NUDGE ** ((i - half) / half) if half else 1.0 for i, line in enumerate(lines)}


def plot_mqar(best: list[dict], axes: list[Axis], sweep, out: Path) -> None:
    """``accuracy_vs_d_model.png`` and ``accuracy_vs_state_bytes.png``: per line (mixer) the
    mean over seeds at the best learning rate, bars the min–max over the seeds; the figure says
    how many seeds and how far the points are nudged (`NUDGE`)."""
    plot = sweep.plot
    x_axis, line_axis, panel_axis = (_axis_of(axes, plot[k]) for k in ("x", "line", "panel"))
    panels = [p for p in panel_axis.labels if any(r[panel_axis.name] == p for r in best)]
    if not panels:  # nothing finished yet
        return
    # the ten default colours, then black and greys; a marker each (up to 15 lines apart)
    palette = [f"C{i}" for i in range(10)] + ["black", "0.45", "0.65", "0.3", "0.55"]
    colors = {line: palette[i % len(palette)] for i, line in enumerate(line_axis.labels)}
    markers = {line: "os^Dv<>pXP*hd8H"[i % 15] for i, line in enumerate(line_axis.labels)}
    nudge = nudge_factors(line_axis.labels)
    x_value = dict(zip(x_axis.labels, (c[0] for c in x_axis.choices), strict=True))
    seeds = sorted({int(r.get("seeds", 1)) for r in best if r.get("seeds")})
    if seeds and seeds[-1] > 1:
        n = "/".join(str(s) for s in seeds)
        what = f"mean over {n} seeds at the best learning rate; bars: min–max over the {n} seeds"
    else:
        what = "one run per setting, at the best learning rate"
    shift = f"points nudged sideways by at most ±{100 * (NUDGE - 1):.1f}% of x to stay apart"

    for filename, xkey, xlabel in (
        ("accuracy_vs_d_model.png", x_axis.name, x_axis.fields[0].split(".")[-1]),
        (
            "accuracy_vs_state_bytes.png",
            "state_bytes",
            "decoding state per sequence (kB, log scale; softmax: its KV cache at seq_len)",
        ),
    ):
        fig, axs = plt.subplots(
            1,
            len(panels),
            figsize=(7.0 * len(panels) + 2.4, 5.6),
            squeeze=False,
            sharey=True,
        )
        all_x = []
        for ax, panel in zip(axs[0], panels, strict=True):
            for line in line_axis.labels:
                rows = [
                    r for r in best if r[panel_axis.name] == panel and r[line_axis.name] == line
                ]
                pts = sorted(
                    (
                        float(x_value[r[xkey]]) if xkey == x_axis.name else float(r[xkey]),
                        metric_value(r, "mqar"),
                        float(r.get("eval/accuracy min", math.nan)),
                        float(r.get("eval/accuracy max", math.nan)),
                    )
                    for r in rows
                )
                if pts:
                    xs, ys, lows, highs = (np.array(v) for v in zip(*pts, strict=True))
                    all_x.extend(xs)
                    # error bars: the min–max over seeds (none where a setting has one run)
                    yerr = np.nan_to_num(np.stack([ys - lows, highs - ys]), nan=0.0)
                    ax.errorbar(
                        xs * nudge[line],
                        ys,
                        yerr=yerr,
                        fmt=markers[line] + "-",
                        color=colors[line],
                        label=line,
                        ms=6,
                        capsize=3,
                        lw=1.3,
                        elinewidth=1.0,
                    )
            ax.set_xscale("log", base=2 if xkey == x_axis.name else 10)
            ax.minorticks_off()
            if xkey == x_axis.name:
                ticks = sorted({float(v) for v in x_value.values()})
                ax.set_xticks(ticks, [_label(int(t) if t.is_integer() else t) for t in ticks])
                ax.set_xlim(ticks[0] / 1.12, ticks[-1] * 1.12)
            else:
                lo, hi = min(all_x) / 1.12, max(all_x) * 1.12
                ticks = [t for t in _STATE_TICKS if lo <= t <= hi]
                ax.set_xticks(ticks, [f"{t / 1e3:g}" for t in ticks])
                ax.set_xlim(lo, hi)
            ax.tick_params(labelsize=10)
            if "data.num_kv_pairs" in panel_axis.fields:  # chance: one of the values in context
                values = panel_axis.choices[panel_axis.labels.index(panel)]
                pairs = values[panel_axis.fields.index("data.num_kv_pairs")]
                ax.axhline(1 / pairs, color="0.5", ls=":", lw=1, label="chance (1/pairs)")
            ax.set_title(_panel_title(panel_axis, panel), fontsize=10)
            ax.set_xlabel(f"{xlabel}\n({shift})", fontsize=10)
            ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
        axs[0][0].set_ylabel("MQAR accuracy", fontsize=11)
        axs[0][-1].legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        fig.suptitle(what, fontsize=11)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
        plt.close(fig)


def plot_loss_curves(best: list[dict], axes: list[Axis], sweep, runs_dir: Path, out: Path):
    tune = sweep.get("tune")
    others = [a.name for a in axes if a.name != tune]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, row in enumerate(r for r in best if r["status"] == "ok"):
        records = read_jsonl(str(runs_dir / row["point"] / "metrics.jsonl"))
        label = " ".join(str(row[k]) for k in others)
        train_pts = [
            (r["step"], r["train/loss"] / math.log(2)) for r in records if "train/loss" in r
        ]
        eval_pts = [
            (r["step"], r["eval/bits_per_byte"]) for r in records if "eval/bits_per_byte" in r
        ]
        if train_pts:
            ax.plot(*zip(*train_pts, strict=True), color=f"C{i}", lw=1.2, label=label)
        if eval_pts:
            ax.plot(*zip(*eval_pts, strict=True), "o", color=f"C{i}", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte (line: train, dots: validation)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)


def report(
    sweep,
    axes: list[Axis],
    points: list[Point],
    workdir: Path,
    *,
    partial: bool = False,
    results_csv: Path | None = None,
) -> dict:
    """Write results.csv, results.md and the plots from what is finished (``results_csv``:
    from that file's rows instead of the run directories); returns the rows."""
    kind = sweep.base.data.kind
    runs_dir = workdir / "runs"
    if results_csv is None:
        rows = collect(axes, points, runs_dir)
    else:
        rows = rows_from_csv(axes, points, Path(results_csv))
    write_csv(workdir / "results.csv", rows)
    best = best_rows(rows, axes, sweep.get("tune"), kind, sweep.get("replicate"), partial=partial)
    if best:
        write_csv(workdir / "best.csv", best)
    if kind == "mqar":
        text = mqar_report(best, axes, sweep)
        plot_mqar(best, axes, sweep, workdir)
    else:
        text = lm_report(best, axes, sweep)
        plot_loss_curves(best, axes, sweep, runs_dir, workdir)
    (workdir / "results.md").write_text(text)
    return {"rows": rows, "best": best, "markdown": text}


# --------------------------------------------------------------------------- entry points
def dry_run(axes, points, log=print) -> None:
    cache = {}
    log(f"{len(points)} points; axes: " + ", ".join(f"{a.name} {list(a.labels)}" for a in axes))
    for point in points:
        cfg = experiment_config(point.config)
        key = (cfg.model, cfg.data.seq_len)
        if key not in cache:
            # the model as trained (learned positions: max_length rows); the state at the
            # training context (softmax: a KV cache of seq_len tokens), as in results.csv
            abstract = nnx.eval_shape(lambda m=cfg.model: LanguageModel(m, rngs=nnx.Rngs(0)))
            params = sum(
                int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))
            )
            cache[key] = (params, _state_bytes(model_config_at(cfg, cfg.data.seq_len)))
        params, state = cache[key]
        log(
            f"  {point.name}: {params:,} params, state {state:,} B, "
            f"{cfg.train.num_steps} steps x {cfg.tokens_per_step} tokens"
        )


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


def check_results_csv(sweep, results_csv, report_only: bool) -> None:
    """``results_csv`` redraws the tables and figures of finished MQAR runs (ValueError else)."""
    if results_csv is None:
        return
    if not report_only:
        raise ValueError("results_csv redraws finished results: use it with report_only")
    if sweep.base.data.kind != "mqar":
        raise ValueError(
            "results_csv redraws MQAR sweeps only (the LM loss curves read every run's "
            f"metrics.jsonl); this sweep's data.kind is {sweep.base.data.kind!r}"
        )
    if not Path(results_csv).is_file():
        raise ValueError(f"results_csv {str(results_csv)!r} is not a file")


def run(
    sweep,
    workdir,
    *,
    only=(),
    dry=False,
    report_only=False,
    jobs=1,
    partial=False,
    results_csv=None,
    log=print,
) -> dict | None:
    """Run (or resume) every selected point, then write the results; see the module doc.
    ``jobs`` > 1 trains the unfinished points in that many worker processes; ``partial``
    tunes a setting with pending runs over its finished learning rates (`best_rows`);
    ``results_csv`` (with ``report_only``) takes the finished runs from that results.csv."""
    workdir = Path(workdir)
    check_results_csv(sweep, results_csv, report_only)
    axes, points = prepare(sweep, only)
    if dry:
        dry_run(axes, points, log)
        return None
    workdir.mkdir(parents=True, exist_ok=True)
    decode_batch_size = int(sweep.get("decode_batch_size", 1))
    if not report_only:
        runs_dir = workdir / "runs"
        ordered = run_order(sweep, axes, points)
        todo = [p for p in ordered if not is_finished(runs_dir / p.name)]
        parallel = jobs > 1 and len(todo) > 1
        for i, point in enumerate(ordered):
            if parallel and point in todo:
                continue  # trained by the workers below
            log(f"[{i + 1}/{len(points)}] {point.name}")
            run_point(
                point.config, runs_dir / point.name, decode_batch_size=decode_batch_size, log=log
            )
        if parallel:
            log(f"{len(todo)} points in {min(jobs, len(todo))} worker processes")
            run_parallel(
                todo,
                runs_dir,
                jobs=jobs,
                decode_batch_size=decode_batch_size,
                log=log,
                replicate=sweep.get("replicate"),
            )
    # The tables cover the whole grid: points run earlier (or by another --only) count too;
    # --report-only with --only: that part of the grid (e.g. the learning rates finished).
    results = report(
        sweep,
        *expand(sweep, only if report_only else ()),
        workdir,
        partial=partial,
        results_csv=results_csv,
    )
    log(results["markdown"])
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="sweep config file, path[:preset]")
    parser.add_argument("--workdir", required=True, help="sweep folder (resumed if it exists)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="AXIS=LABEL[,LABEL]",
        help="run only these labels of an axis (repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the grid and stop")
    parser.add_argument(
        "--partial",
        action="store_true",
        help="tables: tune a setting with pending runs over its finished learning rates",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="worker processes training points in parallel (one XLA thread each)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="write tables and plots from finished points; train nothing",
    )
    parser.add_argument(
        "--results-csv",
        default=None,
        metavar="FILE",
        help="with --report-only (MQAR): the finished runs from this results.csv of an earlier "
        "sweep of the grid instead of the workdir's runs (docs/results/mqar_sweep_cpu.csv)",
    )
    args = parser.parse_args(argv)
    if args.results_csv is not None and not args.report_only:
        parser.error("--results-csv needs --report-only (it redraws finished results)")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    try:  # a bad config, grid or --only stops here, before anything is trained
        sweep = load_sweep(args.config)
        prepare(sweep, args.only)
        check_results_csv(sweep, args.results_csv, args.report_only)
    except ValueError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    try:
        run(
            sweep,
            args.workdir,
            only=args.only,
            dry=args.dry_run,
            report_only=args.report_only,
            jobs=args.jobs,
            partial=args.partial,
            results_csv=args.results_csv,
        )
    except KeyboardInterrupt as e:  # Interrupted (one run), SweepInterrupted (workers), Ctrl-C
        detail = f" ({e})" if str(e) else ""
        print(
            f"sweep: interrupted{detail}; rerun the same command to resume in {args.workdir}",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(_worker_main())
    sys.exit(main())

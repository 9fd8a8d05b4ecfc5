"""Tables and figures of the synthetic-task sweeps (``data.kind`` ``mad`` or
``state_tracking``): one row per mixer, one column per task, each cell the best learning
rate's mean ``eval/accuracy`` over the seeds with the min–max (MAD: class-macro accuracy;
state tracking: the mean over the evaluation lengths).

- MAD: ``mad_heatmap.png``, the mixer × task table as a heat map (DeltaNet paper Table 1).
- State tracking: a second table and ``accuracy_vs_length.png`` with each evaluation length's
  accuracy (``eval/length_{L}/accuracy``) at the best learning rate, the mean over its seeds
  (one panel per task, one line per mixer, bars: min–max over seeds).

The sweep config's ``plot`` names the axes: ``x`` (the task axis) and ``line`` (the mixer).
Any other axis with more than one label (the budget curve's ``budget``) splits the lines: a
row or line per mixer and label, ``gated_deltanet_neg, budget 4x`` (`line_labels`), so no two
settings share a cell.
With ``score = "mad"`` the task axis holds MAD's settings (labels ``<task>`` and
``<task>.<change>``) and the report adds MAD's score (`mad_scores`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from linear_attention.training.sweep.figures import line_colors  # noqa: E402
from linear_attention.training.sweep.grid import Axis, axis_named  # noqa: E402

LENGTH_KEY = re.compile(r"^eval/length_(\d+)/accuracy$")


def _cell(row: dict) -> str:
    mean = row.get("eval/accuracy", math.nan)
    if not isinstance(mean, (int, float)) or not math.isfinite(mean):
        return row.get("status", "")
    text = f"{mean:.3f}"
    if row.get("seeds", 1) > 1:
        text += f" ({row['eval/accuracy min']:.3f}–{row['eval/accuracy max']:.3f})"
    return text


def _table(header, body) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in body)])


def line_labels(axes: list[Axis], sweep) -> tuple[list[str], Callable[[dict], str]]:
    """The table rows (figure lines) in grid order, and the function giving a row's label:
    the ``line`` axis's label, followed by the label of each other axis that varies (not
    ``x``, ``tune`` or ``replicate``, more than one label): ``gated_deltanet_neg, budget 4x``."""
    line = axis_named(axes, sweep.plot.line)
    fixed = (sweep.plot.x, sweep.plot.line, sweep.get("tune"), sweep.get("replicate"))
    extra = [a for a in axes if a.name not in fixed and len(a.labels) > 1]

    def label(row: dict) -> str:
        return ", ".join([row[line.name], *(f"{a.name} {row[a.name]}" for a in extra)])

    combos = [{}]
    for axis in (line, *extra):
        combos = [{**c, axis.name: v} for c in combos for v in axis.labels]
    return [label(c) for c in combos], label


def length_curves(rows: list[dict], best: list[dict], axes: list[Axis], sweep) -> dict:
    """``{(task, line): {L: (mean, min, max)}}``: each evaluation length's accuracy over the
    seeds of the best learning rate (the rows of `best`'s tuned choice); ``line`` as
    `line_labels` names it."""
    tune, replicate = sweep.get("tune"), sweep.get("replicate")
    keys = [a.name for a in axes if a.name not in (tune, replicate)]
    x = sweep.plot.x
    _, label = line_labels(axes, sweep)
    curves = {}
    for cell in best:
        runs = [
            r
            for r in rows
            if r["status"] == "ok"
            and all(r[k] == cell[k] for k in keys)
            and (tune is None or r[tune] == cell[tune])
        ]
        by_length: dict[int, list[float]] = {}
        for r in runs:
            for key, value in r.items():
                m = LENGTH_KEY.match(key)
                if m and value is not None and value == value:
                    by_length.setdefault(int(m.group(1)), []).append(float(value))
        curves[cell[x], label(cell)] = {
            n: (float(np.mean(v)), min(v), max(v)) for n, v in sorted(by_length.items())
        }
    return curves


def synthetic_report(
    rows: list[dict], best: list[dict], axes: list[Axis], sweep, *, by_length: bool = False
) -> str:
    """Markdown: the mixer × task table (and with ``by_length``, for state tracking, accuracy per
    evaluation length)."""
    x_axis, line_axis = axis_named(axes, sweep.plot.x), axis_named(axes, sweep.plot.line)
    lines, label = line_labels(axes, sweep)
    cells = {(label(r), r[x_axis.name]): r for r in best}
    tasks = [t for t in x_axis.labels if any(k[1] == t for k in cells)]
    spread = " mean (min–max) over seeds," if sweep.get("replicate") else ""
    body = [
        [m, *(_cell(cells[m, t]) if (m, t) in cells else "" for t in tasks)]
        for m in lines
        if any(k[0] == m for k in cells)
    ]
    tune = sweep.get("tune")
    lrs = [
        [m, *(str(cells[m, t].get(tune, "")) if (m, t) in cells else "" for t in tasks)]
        for m in lines
        if any(k[0] == m for k in cells)
    ]
    parts = [
        f"eval/accuracy,{spread} at the best {tune}:\n\n"
        + _table([f"{line_axis.name} \\ {x_axis.name}", *tasks], body),
        f"The best {tune} per cell:\n\n"
        + _table([f"{line_axis.name} \\ {x_axis.name}", *tasks], lrs),
    ]
    if sweep.get("score") == "mad":
        parts.append(mad_score_table(best, x_axis, line_axis, lines, label))
    if by_length:
        curves = length_curves(rows, best, axes, sweep)
        lengths = sorted({n for c in curves.values() for n in c})
        body = [
            [t, m, *(f"{curves[t, m][n][0]:.3f}" if n in curves[t, m] else "" for n in lengths)]
            for (t, m) in curves
        ]
        parts.append(
            "Accuracy per evaluation length (mean over seeds, best lr):\n\n"
            + _table([x_axis.name, line_axis.name, *(f"L={n}" for n in lengths)], body)
        )
    return "\n\n".join(parts) + "\n"


def mad_scores(best: list[dict], x_axis: Axis, line_axis: Axis, label=None) -> dict:
    """``{(mixer, task): (score, settings)}``, MAD's score (mad-lab's ``analysis.py``,
    ``compute_model_mad_scores``): the mean over a task's settings (the x axis's labels
    ``<task>`` and ``<task>.<change>``) of each setting's ``eval/accuracy`` at its best tuned
    choice, with how many settings are finished. ``label``: a row's line (`line_labels`);
    by default its ``line_axis`` label."""
    label = label or (lambda row: row[line_axis.name])
    by_cell: dict[tuple[str, str], list[float]] = {}
    for row in best:
        value = row.get("eval/accuracy")
        if isinstance(value, (int, float)) and math.isfinite(value):
            task = row[x_axis.name].partition(".")[0]
            by_cell.setdefault((label(row), task), []).append(float(value))
    return {cell: (float(np.mean(v)), len(v)) for cell, v in by_cell.items()}


def mad_score_table(best: list[dict], x_axis: Axis, line_axis: Axis, lines=None, label=None) -> str:
    """Markdown: MAD's score per mixer and task (settings finished of those in the grid),
    and the mean across tasks where every task has a score (``lines``, ``label``: as
    `line_labels` gives them; by default the ``line_axis`` labels)."""
    scores = mad_scores(best, x_axis, line_axis, label)
    counts: dict[str, int] = {}
    for label in x_axis.labels:
        task = label.partition(".")[0]
        counts[task] = counts.get(task, 0) + 1
    tasks = list(counts)
    body = []
    for m in lines or line_axis.labels:
        if not any((m, t) in scores for t in tasks):
            continue
        cells = [
            f"{scores[m, t][0]:.3f} ({scores[m, t][1]}/{counts[t]})" if (m, t) in scores else ""
            for t in tasks
        ]
        full = all((m, t) in scores and scores[m, t][1] == counts[t] for t in tasks)
        mean = f"{np.mean([scores[m, t][0] for t in tasks]):.3f}" if full else ""
        body.append([m, *cells, mean])
    return (
        "MAD score (mean over each task's settings of the best run; settings finished / in "
        "the grid), and the mean across tasks once every setting is finished:\n\n"
        + _table([f"{line_axis.name} \\ task", *tasks, "mean"], body)
    )


def heatmap_title(best: list[dict], tune: str | None) -> str:
    """The heat map's title names how its cells were tuned: a grid run at one learning rate
    (``--only lr=...``) is not "the best lr", and a partial one is tuned over fewer rates."""
    counts = sorted({int(r["tuned over"].split("/")[0]) for r in best if r.get("tuned over")})
    if not tune or not counts:
        how = "mean over seeds"
    elif counts == [1]:
        how = f"mean over seeds at {tune} " + ", ".join(sorted({str(r[tune]) for r in best}))
    else:
        span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
        how = f"mean over seeds, best {tune} of {span}"
    return f"MAD: class-macro accuracy ({how})"


def plot_mad_heatmap(best: list[dict], axes: list[Axis], sweep, out: Path) -> None:
    x_axis = axis_named(axes, sweep.plot.x)
    lines, label = line_labels(axes, sweep)
    cells = {(label(r), r[x_axis.name]): r.get("eval/accuracy") for r in best}
    mixers = [m for m in lines if any(k[0] == m for k in cells)]
    tasks = [t for t in x_axis.labels if any(k[1] == t for k in cells)]
    if not cells:
        return
    grid = np.full((len(mixers), len(tasks)), np.nan)
    for i, m in enumerate(mixers):
        for j, t in enumerate(tasks):
            value = cells.get((m, t))
            if isinstance(value, (int, float)):
                grid[i, j] = value
    fig, ax = plt.subplots(figsize=(1.3 * len(tasks) + 2.5, 0.45 * len(mixers) + 1.8))
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for i in range(len(mixers)):
        for j in range(len(tasks)):
            if math.isfinite(grid[i, j]):
                color = "black" if grid[i, j] > 0.6 else "white"
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8, c=color)
    ax.set_xticks(range(len(tasks)), [t.replace("_", "\n") for t in tasks], fontsize=8)
    ax.set_yticks(range(len(mixers)), mixers, fontsize=8)
    ax.set_title(heatmap_title(best, sweep.get("tune")), fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(out / "mad_heatmap.png", dpi=110)
    plt.close(fig)


def plot_accuracy_vs_length(
    rows: list[dict], best: list[dict], axes: list[Axis], sweep, out: Path
) -> None:
    curves = length_curves(rows, best, axes, sweep)
    x_axis = axis_named(axes, sweep.plot.x)
    lines, _ = line_labels(axes, sweep)
    tasks = [t for t in x_axis.labels if any(k[0] == t for k in curves)]
    if not tasks:
        return
    palette = line_colors(len(lines))
    fig, axs = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks) + 1.6, 3.6), squeeze=False)
    for ax, task in zip(axs[0], tasks, strict=True):
        for i, mixer in enumerate(lines):
            curve = curves.get((task, mixer))
            if not curve:
                continue
            xs = np.array(list(curve))
            mean, low, high = (np.array(v) for v in zip(*curve.values(), strict=True))
            ax.errorbar(
                xs,
                mean,
                yerr=np.stack([mean - low, high - mean]),
                fmt="os^Dv<>pXP*hd8H"[i % 15] + "-",
                color=palette[i],
                label=mixer,
                ms=4,
                capsize=3,
                lw=1.2,
            )
        ax.set_xscale("log", base=2)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("evaluation length (training: up to data.seq_len)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axs[0][0].set_ylabel("accuracy (mean over seeds, bars min–max)")
    axs[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_length.png", dpi=110)
    plt.close(fig)

"""A sweep's figures. MQAR: ``accuracy_vs_d_model.png`` (one line per mixer, one panel per
(seq_len, kv pairs), Zoology Fig. 2) and ``accuracy_vs_state_bytes.png`` (one point per
best-lr setting against `state_size_bytes`, log x: the Based recall-memory plot), both with the
mean over seeds and min-max bars. LM: ``loss_curves.png``, every best-lr run's training loss
(bits per byte) and validation points from its ``metrics.jsonl``."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from linear_attention.data.configs import MQARDataConfig  # noqa: E402
from linear_attention.training.metrics import read_jsonl  # noqa: E402
from linear_attention.training.sweep.grid import (  # noqa: E402
    Axis,
    axis_named,
    format_label,
    panel_title,
)
from linear_attention.training.sweep.results import metric_value  # noqa: E402

# Lines are nudged sideways on the log x axis so that settings at the same x (same width, or the
# same state size) and their error bars stay apart: line i of n by a factor
# NUDGE ** ((i - (n - 1) / 2) / ((n - 1) / 2)), so the outermost lines sit NUDGE off their true x
# (2.5%: far enough to separate markers, near enough that a point stays at its value).
NUDGE = 1.025


# state-axis ticks: 1, 1.5, 2, 3, 5 and 7 times a power of ten bytes, shown in kB
_STATE_TICKS = [m * 10**e for e in range(2, 12) for m in (1, 1.5, 2, 3, 5, 7)]


def line_colors(n: int) -> list:
    """One colour per line: matplotlib's ten, or tab20's pairs past ten, so that a grid that
    lists each mixer beside its variant (``deltanet``, ``deltanet_neg``) draws the two in one
    hue, dark and light, instead of five greys."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    return [plt.cm.tab20(i % 20) for i in range(n)]


def nudge_factors(lines) -> dict:
    """The factor each line's x is multiplied by (see `NUDGE`): 1 for a single line."""
    half = (len(lines) - 1) / 2
    return {line: NUDGE ** ((i - half) / half) if half else 1.0 for i, line in enumerate(lines)}


def plot_mqar(best: list[dict], axes: list[Axis], sweep, out: Path) -> None:
    """``accuracy_vs_d_model.png`` and ``accuracy_vs_state_bytes.png``: per line (mixer) the
    mean over seeds at the best learning rate, bars the min–max over the seeds; the figure says
    how many seeds and how far the points are nudged (`NUDGE`)."""
    plot = sweep.plot
    x_axis, line_axis, panel_axis = (axis_named(axes, plot[k]) for k in ("x", "line", "panel"))
    panels = [p for p in panel_axis.labels if any(r[panel_axis.name] == p for r in best)]
    if not panels:  # nothing finished yet
        return
    # a colour and a marker each (15 markers before they repeat)
    palette = line_colors(len(line_axis.labels))
    nudge = nudge_factors(line_axis.labels)
    styles = {
        line: dict(color=palette[i], marker="os^Dv<>pXP*hd8H"[i % 15], nudge=nudge[line])
        for i, line in enumerate(line_axis.labels)
    }
    x_value = dict(zip(x_axis.labels, (c[0] for c in x_axis.choices), strict=True))
    shift = f"points nudged sideways by at most ±{100 * (NUDGE - 1):.1f}% of x to stay apart"
    for filename, xkey, xlabel in (
        ("accuracy_vs_d_model.png", x_axis.name, x_axis.fields[0].split(".")[-1]),
        (
            "accuracy_vs_state_bytes.png",
            "state_bytes",
            "decoding state per sequence (kB, log scale; softmax: its KV cache at seq_len)",
        ),
    ):
        by_width = xkey == x_axis.name
        if by_width:
            x_of = lambda r, k=xkey: float(x_value[r[k]])  # noqa: E731
        else:
            x_of = lambda r, k=xkey: float(r[k])  # noqa: E731
        fig, axs = plt.subplots(
            1,
            len(panels),
            figsize=(7.0 * len(panels) + 2.4, 5.6),
            squeeze=False,
            sharey=True,
        )
        all_x = []  # (the state axis of a panel spans the points of this and earlier panels)
        for ax, panel in zip(axs[0], panels, strict=True):
            for line in line_axis.labels:
                rows = [
                    r for r in best if r[panel_axis.name] == panel and r[line_axis.name] == line
                ]
                all_x.extend(_mqar_line(ax, rows, x_of, line, **styles[line]))
            _mqar_x_axis(ax, by_width, x_value, all_x)
            _chance_line(ax, panel_axis, panel)
            ax.set_title(panel_title(panel_axis, panel), fontsize=10)
            ax.set_xlabel(f"{xlabel}\n({shift})", fontsize=10)
            ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
        axs[0][0].set_ylabel("MQAR accuracy", fontsize=11)
        axs[0][-1].legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        fig.suptitle(_seeds_caption(best), fontsize=11)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
        plt.close(fig)


def _seeds_caption(best: list[dict]) -> str:
    """What a point of an MQAR figure is: a mean over how many seeds, or one run."""
    seeds = sorted({int(r.get("seeds", 1)) for r in best if r.get("seeds")})
    if seeds and seeds[-1] > 1:
        n = "/".join(str(s) for s in seeds)
        return f"mean over {n} seeds at the best learning rate; bars: min–max over the {n} seeds"
    return "one run per setting, at the best learning rate"


def _mqar_line(ax, rows: list[dict], x_of, line: str, *, color, marker, nudge) -> list[float]:
    """Draw ``line``'s points (``rows``, at ``x_of(row)``) with min–max bars; their x values."""
    pts = sorted(
        (
            x_of(r),
            metric_value(r, MQARDataConfig.KIND),
            float(r.get("eval/accuracy min", math.nan)),
            float(r.get("eval/accuracy max", math.nan)),
        )
        for r in rows
    )
    if not pts:
        return []
    xs, ys, lows, highs = (np.array(v) for v in zip(*pts, strict=True))
    # error bars: the min–max over seeds (none where a setting has one run)
    yerr = np.nan_to_num(np.stack([ys - lows, highs - ys]), nan=0.0)
    ax.errorbar(
        xs * nudge,
        ys,
        yerr=yerr,
        fmt=marker + "-",
        color=color,
        label=line,
        ms=6,
        capsize=3,
        lw=1.3,
        elinewidth=1.0,
    )
    return list(xs)


def _mqar_x_axis(ax, by_width: bool, x_value: dict, all_x: list[float]) -> None:
    """A log x axis: the grid's widths (base 2), or state bytes in kB (base 10) over
    ``all_x``."""
    ax.set_xscale("log", base=2 if by_width else 10)
    ax.minorticks_off()
    if by_width:
        ticks = sorted({float(v) for v in x_value.values()})
        ax.set_xticks(ticks, [format_label(int(t) if t.is_integer() else t) for t in ticks])
        ax.set_xlim(ticks[0] / 1.12, ticks[-1] * 1.12)
    else:
        lo, hi = min(all_x) / 1.12, max(all_x) * 1.12
        ticks = [t for t in _STATE_TICKS if lo <= t <= hi]
        ax.set_xticks(ticks, [f"{t / 1e3:g}" for t in ticks])
        ax.set_xlim(lo, hi)
    ax.tick_params(labelsize=10)


def _chance_line(ax, panel_axis: Axis, panel) -> None:
    """Chance, one of the values in context, where the panel fixes the number of pairs."""
    if "data.num_kv_pairs" in panel_axis.fields:
        values = panel_axis.choices[panel_axis.labels.index(panel)]
        pairs = values[panel_axis.fields.index("data.num_kv_pairs")]
        ax.axhline(1 / pairs, color="0.5", ls=":", lw=1, label="chance (1/pairs)")


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

"""The Markdown tables of a sweep: MQAR (a table per panel, lines against x, and every setting
at its best learning rate) and LM (bits per byte, throughput, state)."""

from __future__ import annotations

import math

from linear_attention.data.configs import MQARDataConfig, TextDataConfig
from linear_attention.training.sweep.grid import Axis, axis_named, panel_title
from linear_attention.training.sweep.results import METRICS, metric_value


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
    x_axis, line_axis, panel_axis = (axis_named(axes, plot[k]) for k in ("x", "line", "panel"))
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
                        _with_spread(cells[line, x], MQARDataConfig.KIND)
                        if (line, x) in cells
                        else ""
                        for x in xs
                    ]
                )
        header = [f"{line_axis.name} \\ {x_axis.name}"] + xs
        parts.append(
            f"**{panel_title(panel_axis, panel)}** (eval accuracy,{spread} best lr)\n\n"
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
            _with_spread(r, MQARDataConfig.KIND),
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
            _fmt(metric_value(r, TextDataConfig.KIND)),
            _fmt(r.get("tokens_per_sec"), 0),
            _fmt(r.get("decode_tokens_per_sec"), 0),
            str(r["state_bytes"]),
            r["status"],
        ]
        for r in best
    ]
    return _table(header, body) + "\n"

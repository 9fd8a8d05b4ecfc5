"""Running a sweep: every selected point trained (or skipped / resumed), serially or in worker
processes, then the results files, tables and figures written from what is finished."""

from __future__ import annotations

import csv
from pathlib import Path

from linear_attention.training.data_kinds import data_kind
from linear_attention.training.sweep.figures import plot_loss_curves, plot_mqar
from linear_attention.training.sweep.grid import Axis, Point, expand, prepare, run_order
from linear_attention.training.sweep.points import dry_run, is_finished, run_point
from linear_attention.training.sweep.results import (
    best_rows,
    check_results_header,
    collect,
    results_paths,
    rows_from_csv,
    write_csv,
)
from linear_attention.training.sweep.synthetic import (
    plot_accuracy_vs_length,
    plot_mad_heatmap,
    synthetic_report,
)
from linear_attention.training.sweep.tables import lm_report, mqar_report
from linear_attention.training.sweep.workers import SweepProgress, run_parallel

# What a sweep reports, by what its data kind asks for (`DataConfig.SWEEP_REPORT`).
SWEEP_REPORTS = ("recall", "tasks", "lengths", "language")


def report_style(sweep) -> str:
    """The report a sweep's data kind asks for (one of `SWEEP_REPORTS`)."""
    return data_kind(sweep.base.data.kind).config.SWEEP_REPORT


def report(
    sweep,
    axes: list[Axis],
    points: list[Point],
    workdir: Path,
    *,
    partial: bool = False,
    results_csv=None,
) -> dict:
    """Write results.csv, results.md and the plots from what is finished (``results_csv``:
    from the rows of that file, or of those files, instead of the run directories); returns
    the rows."""
    style = report_style(sweep)
    kind = sweep.base.data.kind
    runs_dir = workdir / "runs"
    if results_csv is None:
        rows = collect(axes, points, runs_dir)
    else:
        rows = rows_from_csv(axes, points, results_csv, sweep.base)
    write_csv(workdir / "results.csv", rows)
    best = best_rows(rows, axes, sweep.get("tune"), kind, sweep.get("replicate"), partial=partial)
    if best:
        write_csv(workdir / "best.csv", best)
    match style:
        case "recall":
            text = mqar_report(best, axes, sweep)
            plot_mqar(best, axes, sweep, workdir)
        case "tasks":
            text = synthetic_report(rows, best, axes, sweep)
            plot_mad_heatmap(best, axes, sweep, workdir)
        case "lengths":
            text = synthetic_report(rows, best, axes, sweep, by_length=True)
            plot_accuracy_vs_length(rows, best, axes, sweep, workdir)
        case "language":
            text = lm_report(best, axes, sweep)
            plot_loss_curves(best, axes, sweep, runs_dir, workdir)
        case _:
            raise ValueError(
                f"data kind {kind!r} asks for the sweep report {style!r}; known: "
                + ", ".join(SWEEP_REPORTS)
            )
    (workdir / "results.md").write_text(text)
    return {"rows": rows, "best": best, "markdown": text}


def check_results_csv(sweep, results_csv, report_only: bool) -> None:
    """``results_csv`` (a path or several) redraws the tables and figures of finished runs
    (not LM: ValueError)."""
    if results_csv is None:
        return
    if not report_only:
        raise ValueError("results_csv redraws finished results: use it with report_only")
    if report_style(sweep) == "language":
        raise ValueError(
            "results_csv redraws MQAR, MAD and state-tracking sweeps only (the LM loss curves "
            f"read every run's metrics.jsonl); this sweep's data.kind is {sweep.base.data.kind!r}"
        )
    for path in results_paths(results_csv):
        if not path.is_file():
            raise ValueError(f"results_csv {str(path)!r} is not a file")
        with open(path, newline="") as f:
            check_results_header(path, csv.DictReader(f).fieldnames)


def _train(sweep, axes, points, runs_dir: Path, jobs: int, decode_batch_size: int, log):
    """Train every unfinished point of ``points``, serially or in ``jobs`` workers."""
    ordered = run_order(sweep, axes, points)
    todo = [p for p in ordered if not is_finished(runs_dir / p.name)]
    parallel = jobs > 1 and len(todo) > 1
    progress = None if parallel else SweepProgress(len(todo))
    for i, point in enumerate(ordered):
        if parallel and point in todo:
            continue  # trained by the workers below
        log(f"[{i + 1}/{len(points)}] {point.name}")
        run_point(point.config, runs_dir / point.name, decode_batch_size=decode_batch_size, log=log)
        if progress is not None and point in todo:
            log(progress.done())
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
    ``results_csv`` (with ``report_only``) takes the finished runs from that results.csv, or
    from those (each point's first finished row, in order)."""
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
        try:
            _train(sweep, axes, points, runs_dir, jobs, decode_batch_size, log)
        except KeyboardInterrupt:
            # The runs finished before the signal are on disk: results.csv lists them now
            # (the tables wait for a rerun or --report-only; drawing them would delay the exit).
            write_csv(workdir / "results.csv", collect(*expand(sweep), runs_dir))
            raise
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

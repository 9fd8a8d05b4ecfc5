"""A grid of training runs with the best learning rate kept per setting, as Zoology does.

    python experiments/sweep.py --config configs/sweeps/mqar.py:cpu --workdir runs/mqar-sweep
    python experiments/sweep.py --config configs/sweeps/lm.py:cpu --workdir runs/lm-sweep
    ... --dry-run                        # print the grid (parameters, state bytes), train nothing
    ... --only mixer=softmax,linear      # train a subset (repeatable; labels of that axis)
    ... --report-only                    # tables and plots from the finished points only
    ... --report-only --only lr=0.01     # ... of a part of the grid (tuned over those lrs)
    ... --report-only --partial          # ... tuned over each setting's finished lrs
    ... --report-only --results-csv docs/results/mqar_sweep_cpu.csv
                                         # ... of the runs in that file (no run folders;
                                         # repeatable: first finished row per point wins)
    ... --jobs 2                         # two worker processes, one XLA thread each

(``python -m linear_attention.training.sweep`` is the same command.) Tables and plots always
cover the whole grid; a setting with a run still pending is left out. Ctrl-C (or SIGTERM) stops
the sweep after every run in progress has saved a checkpoint, writes results.csv (the runs
finished so far) and exits with 130; the same command resumes. A bad config, grid or
``--only`` exits with 2 before anything is trained.
"""

from __future__ import annotations

import argparse
import sys

from linear_attention.training.cli_args import check_backend, show_spelling_warnings
from linear_attention.training.sweep.grid import load_sweep, prepare
from linear_attention.training.sweep.runner import check_results_csv, run


def _parser() -> argparse.ArgumentParser:
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
        action="append",
        default=None,
        metavar="FILE",
        help="with --report-only: the finished runs from this results.csv of an earlier sweep "
        "of the grid instead of the workdir's runs (docs/results/mqar_sweep_cpu.csv); given "
        "more than once, each point's first finished row, in the order given",
    )
    return parser


def main(argv=None) -> int:
    if argv is None:  # (the program itself, not a caller that manages warnings)
        show_spelling_warnings()
    parser = _parser()
    args = parser.parse_args(argv)
    if args.results_csv is not None and not args.report_only:
        parser.error("--results-csv needs --report-only (it redraws finished results)")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    try:  # a bad config, grid or --only stops here, before anything is trained
        sweep = load_sweep(args.config)
        _, points = prepare(sweep, args.only)
        check_results_csv(sweep, args.results_csv, args.report_only)
        if not (args.dry_run or args.report_only):  # the runs' kernels must run here
            for point in points:
                check_backend(point.config)
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

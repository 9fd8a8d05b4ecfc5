"""The sweep engine: a grid of training runs with the best learning rate kept per setting, as
Zoology does (``experiments/sweep.py`` / ``python -m linear_attention.training.sweep``).

A sweep config (``get_config(arg)``) has ``base`` (a config of ``configs/mqar.py`` or
``configs/lm.py``), ``grid`` (axis name -> ``ConfigDict(field, choices, labels)``; ``field`` is
a dotted path such as ``model.d_model`` or a tuple of paths set together, each choice a value or
a tuple of values), ``tune`` (the axis whose best choice is kept per setting, the learning rate),
optionally ``replicate`` (an axis of repeated runs, the seed: ``tune`` then picks the choice with
the best mean over them, and the tables and plots show the mean and the min–max over them) and
``order`` (the axes from outermost to innermost in the order points are trained, each in the
order of its choices), and, for MQAR, ``plot`` (the axes for x, lines and panels). Every point
of the product is a run of `linear_attention.training.train` in ``workdir/runs/<point>/``: a
point whose ``summary.json`` exists is skipped (its ``config.json`` must match the grid's), one
without resumes from its latest checkpoint, one that diverged (``failed.json``) is recorded as
such.

With ``--jobs N`` the unfinished points are trained by N worker processes (``python -m
linear_attention.training.sweep --worker``, one XLA thread each: these small models leave a
second intra-op thread idle), a setting's seeds on one worker in a row (they share its compiled
step) unless another worker would sit idle; only this process writes the results files. A run
that stops early (``train.stop_at``) counts as finished. Ctrl-C (or SIGTERM) stops the sweep
after every run in progress has saved a checkpoint (the workers get the signal from this
process, once), writes ``results.csv`` with the runs finished so far, exits with 130, and the
same command resumes.

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
and its validation points from ``metrics.jsonl``. MAD and state tracking (`synthetic`): a
mixer × task table of the best learning rate's mean accuracy (min–max over seeds), and
``mad_heatmap.png`` or ``accuracy_vs_length.png`` (each evaluation length's accuracy);
``results.csv`` keeps every ``eval/`` metric of each run (state tracking: per length).

One file per job: `grid` (axes, points, ``--only``, order, loading a sweep config), `points`
(one run: train, skip, resume, decode speed, state bytes, dry run), `workers` (worker
processes and signal forwarding), `results` (rows, best learning rate, CSV), `tables`
(Markdown), `figures` (PNG), `synthetic` (the MAD / state-tracking tables and figures),
`runner` (`run`, `report`) and `cli` (`main`).
"""

from linear_attention.training.sweep.cli import main
from linear_attention.training.sweep.figures import (
    NUDGE,
    nudge_factors,
    plot_loss_curves,
    plot_mqar,
)
from linear_attention.training.sweep.grid import (
    Axis,
    Point,
    expand,
    grid_axis,
    load_sweep,
    parse_axes,
    parse_only,
    prepare,
    run_order,
)
from linear_attention.training.sweep.points import (
    dry_run,
    is_finished,
    measure_decode,
    model_config_at,
    run_point,
    state_bytes,
)
from linear_attention.training.sweep.results import (
    METRICS,
    SUMMARY_KEYS,
    best_rows,
    collect,
    metric_value,
    rows_from_csv,
    write_csv,
)
from linear_attention.training.sweep.runner import check_results_csv, report, run
from linear_attention.training.sweep.tables import lm_report, mqar_report
from linear_attention.training.sweep.workers import PointQueue, SweepInterrupted, run_parallel

__all__ = [
    "METRICS",
    "NUDGE",
    "SUMMARY_KEYS",
    "Axis",
    "Point",
    "PointQueue",
    "SweepInterrupted",
    "best_rows",
    "check_results_csv",
    "collect",
    "dry_run",
    "expand",
    "grid_axis",
    "is_finished",
    "lm_report",
    "load_sweep",
    "main",
    "measure_decode",
    "metric_value",
    "model_config_at",
    "mqar_report",
    "nudge_factors",
    "parse_axes",
    "parse_only",
    "plot_loss_curves",
    "plot_mqar",
    "prepare",
    "report",
    "rows_from_csv",
    "run",
    "run_order",
    "run_parallel",
    "run_point",
    "state_bytes",
    "write_csv",
]

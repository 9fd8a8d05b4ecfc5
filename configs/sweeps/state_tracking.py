"""State-tracking study (Grazzi et al. 2025 Table 3; DeltaProduct): every mixer on parity,
modular arithmetic and the group word problems, with the MQAR study's protocol: several
learning rates and seeds, the learning rate with the best mean ``eval/accuracy`` (the mean
over the evaluation lengths 40–256) kept per (task, mixer), reported as mean and min–max over
the seeds; ``results.csv`` keeps every run's ``eval/length_{L}/accuracy``.

Command (writes results.csv, best.csv, results.md and accuracy_vs_length.png; resumable, a
rerun skips finished points):

    python experiments/sweep.py --config configs/sweeps/state_tracking.py:parity \
        --workdir runs/state-tracking --jobs 2

Presets (``configs/sweeps/state_tracking.py:<arg>``):
  ``parity``, ``mod_arith``, ``s3``, ``s5``, ``s5_swaps``, ``a5``: one task each × every
      mixer of ``MIXERS`` × learning rates (1e-3, 3e-3, 1e-2) × seeds (0, 1) = 138 runs each of
      ``configs/state_tracking.py:<task>`` (2 layers, d_model 64, 500 steps, train lengths 3–40,
      one evaluation at 40, 64, 128 and 256): 1/160 of Grazzi et al.'s parity sequences, 1/3,200
      of their modular-arithmetic ones, ≈ 1/1,840 of DeltaProduct's tokens. Results files:
      ``docs/results/state_tracking_<task>_sweep_cpu.csv`` for parity and mod_arith,
      ``state_tracking_<task>_cpu.csv`` for the groups.
  ``cpu``: parity and mod_arith at 1000 steps (stopped at mean accuracy >= 0.99, evaluated
      every 250 steps), 276 runs; ``groups``: s3, s5, s5_swaps, a5 at that budget, 552 runs.
      Neither was run in full.
  ``s3_one_layer``: DeltaProduct's S3 question in one layer: gated_deltaproduct with 1 and 2
      Householder steps, β ∈ (0, 2), × the 3 rates × 2 seeds = 12 runs of 2000 steps (200
      warmup, evaluated every 500; ``docs/results/state_tracking_s3_one_layer_cpu.csv``).
  ``budget``: the budget curve: S3 and A5 at 1×, 4× and 16× the preset's 500 steps (500,
      2000, 8000; warmup 10 %, evaluated at the end) for gated_deltaproduct with 2 Householder
      steps and gated_deltanet, both β ∈ (0, 2), at lr 3e-3 (the A5 slice's best rate for every
      mixer) × seeds (0, 1): 24 runs of ``configs/state_tracking.py:<task>`` (2 layers,
      d_model 64). It says whether the slices' floor is the budget. Command: ``python
      experiments/sweep.py --config configs/sweeps/state_tracking.py:budget --workdir
      runs/st-budget --jobs 2`` (``--dry-run``: the grid with each run's size); 1/1,840, 1/460
      and 1/115 of DeltaProduct's tokens (``docs/results/state_tracking_budget_cpu.json``).
  ``smoke``: parity, 2 mixers (gated_deltanet with β ∈ (0, 1) and (0, 2)) × 2 rates × 2
      seeds at the smoke size, for the test; seconds.

Grazzi et al.'s own protocol is ``configs/state_tracking.py:parity_paper`` (2 layers, d_model
128, 20,000 steps of batch 256) and ``:mod_arith_paper`` (3 layers, d_model 128, 100,000 steps
of batch 1,024).

  ``parity_paper``: that parity run (their one rate, 1e-3; 5.12M sequences) for gated_deltanet
      and deltanet, each with β ∈ (0, 2) and β ∈ (0, 1), × `PAPER_SEEDS`: 12 runs, the β pairs'
      seed 0 first. ``--only seed=0`` runs one seed per β range.
  ``parity_fork_1layer``: the same run at 1 layer and d_model 16 (a fork's single-layer file,
      not the authors' protocol: ``configs/state_tracking.py:paper_preset``) for
      `PAPER_MIXERS` (gated_deltanet and deltanet with both β ranges, lstm, gated, softmax) ×
      `PAPER_SEEDS`: 21 runs; the delta rules and gated by their step-by-step scan.

Command: ``python experiments/sweep.py --config configs/sweeps/state_tracking.py:<preset>
--workdir runs/<preset> --jobs 2``.

Mixers (``MIXERS``): softmax, linear (elu+1), taylor (8 projected dims), retnet, gated, gla,
swa (window 16), Based (taylor + swa layers), rwkv7, mamba (Mamba-1's block), rglru (Griffin's
recurrent block), and the delta family, each with β ∈ (0, 1) and with β ∈ (0, 2) (``*_neg``,
``model.options.allow_neg_eigval``): deltanet, gated_deltanet, gated_deltaproduct with 1 and 2
Householder steps (``_n1``, ``_n2``), kda and comba.

Expected (Grazzi et al. Table 3): only β ∈ (0, 2) solves parity, and it does better on
mod_arith than β ∈ (0, 1); softmax attention does not extrapolate past its training lengths.
What the runs found, every table generated from the results files: docs/studies/state_tracking.md
(the paper's figures beside them).

The run logs this docstring held (times, loads, machines): docs/results/config_docstring_runs.md.
"""

from pathlib import Path

import ml_collections

from linear_attention.data.state_tracking import TASKS, task_vocab_size
from linear_attention.layers.registry import MIXERS as REGISTRY
from linear_attention.training.cli import load_config_file
from linear_attention.training.sweep.grid import grid_axis
from linear_attention.training.sweep.mixers import mixer_axis

# One slice per task (``parity``, ..., ``a5``), named as configs/state_tracking.py's presets.
PRESETS = (
    "budget",
    "cpu",
    "groups",
    *TASKS,
    "parity_paper",
    "parity_fork_1layer",
    "s3_one_layer",
    "smoke",
)
# The budget curve: multiples of the preset's steps, and its two mixers.
BUDGETS = (1, 4, 16)
BUDGET_MIXERS = ("gated_deltaproduct_n2_neg", "gated_deltanet_neg")
# The delta family, each with β ∈ (0, 1) and with β ∈ (0, 2) (``*_neg``); gated_deltaproduct
# with 1 and 2 Householder steps per token (``_n1``, ``_n2``).
DELTA_FAMILY = tuple(
    f"{m}{neg}"
    for m in ("deltanet", "gated_deltanet", "gated_deltaproduct_n1", "gated_deltaproduct_n2", "kda")
    for neg in ("", "_neg")
)
MIXERS = ("softmax", "linear", "taylor", "retnet", "gated", "gla", "swa", "based", *DELTA_FAMILY)
# rwkv7 (issue 20) joins the grid once it is in the registry; until then the grid still builds.
MIXERS += ("rwkv7",) if "rwkv7" in REGISTRY else ()
# Issue 71's recurrences with their own kernels: Mamba-1's block and Griffin's recurrent block
# (diagonal states: Grazzi et al. predict no parity for a positive diagonal transition).
MIXERS += ("mamba", "rglru")
# Comba (a delta rule over the DPLR kernels) with both β ranges, as the delta family.
MIXERS += ("comba", "comba_neg")
# Grazzi et al.'s parity table (Table 3): β ∈ (0, 2) against β ∈ (0, 1) for both delta rules,
# with the mamba-style scalar-decay gate, the LSTM control and softmax beside them; in the
# order a cut-short sweep should leave them (the measure, the control, the paper's own
# mixer).
PAPER_MIXERS = (
    "gated_deltanet_neg",
    "gated_deltanet",
    "lstm",
    "deltanet_neg",
    "deltanet",
    "gated",
    "softmax",
)
PAPER_SEEDS = (0, 1, 2)
# The authors' parity protocol at its full size: the two delta rules, both β ranges.
AUTHORS_MIXERS = ("gated_deltanet_neg", "gated_deltanet", "deltanet_neg", "deltanet")
# The mixers whose kernels have a step-by-step scan: at d_model 16 (head width 4) and 40
# tokens it is 2-4x faster on the CPU than the chunk form (the same recurrence; the kernels'
# tests hold them equal).
SCAN_MIXERS = ("deltanet", "gated_deltanet", "gated")
MIXER_FIELDS = (
    "model.mixer",
    "model.options.allow_neg_eigval",
    "model.options.feature_dim",
    "model.options.window",
    "model.options.num_householder",
    "model.conv",
)
TASK_FIELDS = ("data.task", "model.vocab_size")


def _mixer_axis(config, names):
    """The mixer axis: taylor layers at 8 projected dims, windows of 16, and the preset's
    short conv for every mixer but rwkv7 (said explicitly: unset, it is each mixer's default,
    off for all but the delta rules)."""
    return mixer_axis(MIXER_FIELDS, names, taylor_dim=8, window=16, conv=config.base.model.conv)


def _base(preset):
    return load_config_file(
        str(Path(__file__).resolve().parents[1] / "state_tracking.py") + f":{preset}"
    )


def _parity_paper(preset, mixers):
    """Grazzi et al.'s parity run (``configs/state_tracking.py:<preset>``: batch 256, 20,000
    steps, lr 1e-3, their only rate) for `mixers` × the seeds `PAPER_SEEDS`, seed by seed."""
    config = ml_collections.ConfigDict()
    config.base = _base(preset)
    config.tune = "lr"
    config.replicate = "seed"
    config.plot = ml_collections.ConfigDict(dict(x="task", line="mixer"))
    grid = config.grid = ml_collections.ConfigDict()
    grid.task = grid_axis(TASK_FIELDS, (("parity", task_vocab_size("parity")),), ("parity",))
    grid.seed = grid_axis("seed", PAPER_SEEDS)
    grid.lr = grid_axis("optimizer.learning_rate", (1e-3,))
    axis = _mixer_axis(config, mixers)
    fields = (*axis.field, "model.options.method")
    scan = config.base.model.d_model <= 16  # the scan is the faster form at head width 4 only
    choices = [
        (*values, "scan" if scan and values[0] in SCAN_MIXERS else None) for values in axis.choices
    ]
    grid.mixer = grid_axis(fields, choices, axis.labels)
    config.order = ("mixer", "seed", "task", "lr") if scan else ("seed", "mixer", "task", "lr")
    return config


def get_config(arg=None):
    if arg not in PRESETS:
        raise ValueError(
            f"unknown preset {arg!r} for configs/sweeps/state_tracking.py; presets: {PRESETS}"
        )
    tasks = {
        "budget": ("s3", "a5"),
        "cpu": ("parity", "mod_arith"),
        "groups": ("s3", "s5", "s5_swaps", "a5"),
        "s3_one_layer": ("s3",),
    }
    if arg == "parity_paper":
        return _parity_paper("parity_paper", AUTHORS_MIXERS)
    if arg == "parity_fork_1layer":
        return _parity_paper("parity_fork_1layer", PAPER_MIXERS)
    tasks = tasks.get(arg, ("parity",) if arg == "smoke" else (arg,))
    config = ml_collections.ConfigDict()
    config.base = _base("smoke" if arg == "smoke" else tasks[0])
    config.tune = "lr"
    config.replicate = "seed"
    # Table: tasks across, one row per mixer; figure: accuracy against evaluation length, one
    # panel per task, one line per mixer.
    config.plot = ml_collections.ConfigDict(dict(x="task", line="mixer"))
    grid = config.grid = ml_collections.ConfigDict()
    grid.task = grid_axis(TASK_FIELDS, tuple((t, task_vocab_size(t)) for t in tasks), tasks)
    grid.seed = grid_axis("seed", (0, 1))
    if arg == "smoke":
        names = ("gated_deltanet", "gated_deltanet_neg")
        grid.mixer = _mixer_axis(config, names)
        grid.lr = grid_axis("optimizer.learning_rate", (1e-3, 3e-3))
        return config
    if arg == "budget":
        grid.mixer = _mixer_axis(config, BUDGET_MIXERS)
        grid.lr = grid_axis("optimizer.learning_rate", (3e-3,))
        steps = tuple(b * config.base.train.num_steps for b in BUDGETS)  # 1×: the preset's
        budget_fields = (
            "train.num_steps",
            "optimizer.warmup_steps",
            "train.eval_every",
            "train.checkpoint_every",
        )
        grid.budget = grid_axis(
            budget_fields,
            tuple((n, n // 10, n, n // 2) for n in steps),
            tuple(f"{b}x" for b in BUDGETS),
        )
        config.order = ("budget", "seed", "task", "mixer")
        return config
    grid.lr = grid_axis("optimizer.learning_rate", (1e-3, 3e-3, 1e-2))
    # A sweep cut short leaves every mixer at the same settings: the first rate and seed first.
    config.order = ("lr", "seed", "task", "mixer")
    if arg in TASKS:
        # The preset's own budget (500 steps, one evaluation at the end): each run is a
        # preset run, so the preset's measured figures are rows of this study.
        grid.mixer = _mixer_axis(config, MIXERS)
        return config
    base = config.base
    if arg == "s3_one_layer":
        # One layer: with n = 1 each token's transition is one reflection (or near identity),
        # and S3's 3-cycles are products of two; a second layer could compose them.
        names = ("gated_deltaproduct_n1_neg", "gated_deltaproduct_n2_neg")
        grid.mixer = _mixer_axis(config, names)
        base.model.num_layers = 1
        base.train.num_steps = 2000
        base.optimizer.warmup_steps = 200
        base.train.eval_every = 500
        base.train.checkpoint_every = 500
        return config
    base.train.num_steps = 1000
    base.train.eval_every = 250
    base.train.checkpoint_every = 250
    base.train.stop_at = 0.99
    grid.mixer = _mixer_axis(config, MIXERS)
    return config

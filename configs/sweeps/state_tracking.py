"""State-tracking study (Grazzi et al. 2025 Table 3; DeltaProduct): every mixer on parity,
modular arithmetic and the group word problems, with the MQAR study's protocol: several
learning rates and seeds, the learning rate with the best mean ``eval/accuracy`` (the mean
over the evaluation lengths 40–256) kept per (task, mixer), reported as mean and min–max over
the seeds; ``results.csv`` keeps every run's ``eval/length_{L}/accuracy``.

Command (writes results.csv, best.csv, results.md and accuracy_vs_length.png; resumable, a
rerun skips finished points):

    python experiments/sweep.py --config configs/sweeps/state_tracking.py:cpu \
        --workdir runs/state-tracking --jobs 2

Presets (``configs/sweeps/state_tracking.py:<arg>``):
  ``cpu``: parity and mod_arith × 18 mixers (below; 19 with rwkv7) × learning rates (1e-3,
      3e-3, 1e-2) × seeds (0, 1): 216 runs of ``configs/state_tracking.py`` (2 layers, d_model
      64; train lengths 3–40, evaluation 40, 64, 128, 256) at 1000 steps, stopped early at an
      evaluation (every 250 steps) with mean accuracy >= 0.99. Not yet run in full: a 500-step
      parity run took 5–11 min at load 9–15 (docs/results/presets_cpu/), so this is days of
      the shared 2-core machine, hours of an idle one.
  ``groups``: s3, s5, s5_swaps, a5 with the same mixers, rates, seeds and budget (456 runs).
  ``parity``, ``mod_arith``, ``s3``, ``s5``, ``s5_swaps``, ``a5``: the slices that fit a
      session, one task each: the task × every mixer of ``MIXERS`` (19 with rwkv7) × 3 rates
      × 2 seeds = 114 runs each at the preset's own budget (500 steps, one evaluation at the
      end), so that each run is a preset run; ``--only`` picks points, a rerun resumes.
      ``parity`` run in full (1.4–5.9 min a run with ``--jobs 2`` at load ~4, rwkv7 3.5–8.7,
      so about 2.5 hours of 2 cores): only β ∈ (0, 2) runs learn it, 9 of 30 against 0 of 84
      others (EXPERIMENTS.md section 7.8). ``mod_arith`` run in full (1.4–12.4 min a run at
      load 1–8, about 3.5 hours with ``--jobs 2``): every run at chance, at every rate, with
      either β range (section 7.7). ``s5_swaps`` run in full (0.9–6.9 min a run): deltanet
      and kda with β ∈ (0, 2) learned it at lr 1e-2 with one seed of two each (0.938 and
      0.929 at length 256, trained to 40) on earlier machines; rerun on two others,
      deltanet's on neither (0.059, 0.059), kda's on one (0.526, 0.973): rounding decides it;
      the other 112 runs stay at the floor, Gated DeltaProduct's included (section 7.9).
      ``s3`` run in full (1.1–5.6 min a run, Gated DeltaProduct n = 2 the slowest; about
      2.5 hours with ``--jobs 2`` at load ~4): every run at the floor at every rate,
      0.197–0.240 against chance 1/6, right only where the short convolution reaches
      (section 7.10). ``s5`` run in full (1.5–6.2 min a run, about
      3 hours with ``--jobs 2`` at load ~4.5): every run at the same floor, 0.0207–0.0221
      against chance 1/120 (section 7.11). ``a5`` run in full (0.8–6.1 min a run, about 2.8
      hours with ``--jobs 2`` at load ~4.5, on two machines): every run at the floor,
      0.0289–0.0388 against chance 1/60, 3e-3 the best rate for every mixer (section 7.12).
  ``s3_one_layer``: DeltaProduct's S3 question, one Householder step per token against two in
      one layer: s3 × gated_deltaproduct n = 1 and n = 2 with β ∈ (0, 2) × the 3 rates × 2
      seeds = 12 runs of one layer at 2000 steps (200 warmup, evaluated every 500); 15–34 min
      a run beside other jobs (load 2.4–10.5; 256 run-minutes in all). Run in full: neither
      n solves S3; 3 of 12 runs (n = 2 twice, n = 1 once) learn the permutation's sign and no
      more (EXPERIMENTS.md section 7.5, ``experiments/group_errors.py``).
  ``smoke``: parity, 2 mixers (gated_deltanet with β ∈ (0, 1) and (0, 2)) × 2 rates × 2
      seeds at the smoke size, for the test; seconds.

Mixers (``MIXERS``): softmax, linear (elu+1), taylor (8 projected dims), retnet, gated, gla,
swa (window 16), Based (taylor + swa layers), and the delta family, each with β ∈ (0, 1) and
with β ∈ (0, 2) (``*_neg``, ``model.allow_neg_eigval``): deltanet, gated_deltanet,
gated_deltaproduct with 1 and 2 Householder steps (``_n1``, ``_n2``) and kda; rwkv7 (issue 20)
joins once it is in the registry (the grid builds without it).

Expected (Grazzi et al. Table 3, scaled accuracy): only β ∈ (0, 2) solves parity (1.000 against
0.000–0.022 for β ∈ (0, 1) and for a Transformer); mod_arith: DeltaNet [−1, 1] 0.971 against
0.314 for [0, 1]; softmax attention does not extrapolate past its training lengths.
"""

from pathlib import Path

import ml_collections

from linear_attention.data.state_tracking import TASKS, task_vocab_size
from linear_attention.layers.registry import MIXERS as REGISTRY
from linear_attention.training.cli import load_config_file
from linear_attention.training.sweep.grid import grid_axis
from linear_attention.training.sweep.mixers import mixer_axis

# One slice per task (``parity``, ..., ``a5``), named as configs/state_tracking.py's presets.
PRESETS = ("cpu", "groups", *TASKS, "s3_one_layer", "smoke")
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
MIXER_FIELDS = (
    "model.mixer",
    "model.allow_neg_eigval",
    "model.feature_dim",
    "model.window",
    "model.num_householder",
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


def get_config(arg=None):
    if arg not in PRESETS:
        raise ValueError(
            f"unknown preset {arg!r} for configs/sweeps/state_tracking.py; presets: {PRESETS}"
        )
    tasks = {
        "cpu": ("parity", "mod_arith"),
        "groups": ("s3", "s5", "s5_swaps", "a5"),
        "s3_one_layer": ("s3",),
    }
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

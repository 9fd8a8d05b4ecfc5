"""MAD study (DeltaNet paper Table 1; Poli et al. 2024): every mixer on MAD's six tasks, with
the MQAR study's protocol: several learning rates and seeds, the learning rate with the best
mean class-macro accuracy kept per (task, mixer), reported as mean and min–max over the seeds.

Command (writes results.csv, best.csv, results.md and mad_heatmap.png; resumable, a rerun
skips finished points):

    python experiments/sweep.py --config configs/sweeps/mad.py:cpu --workdir runs/mad --jobs 2

Presets (``configs/sweeps/mad.py:<arg>``):
  ``cpu``: the six tasks × 13 mixers (below; 14 with rwkv7) × learning rates (1e-3, 3e-3,
      1e-2) × seeds (0, 1): 468 runs of ``configs/mad.py``, each task at its preset's budget
      (the same 1.6M training tokens for every task: 200 steps of batch 64 at length 128, one
      evaluation at the end), so that each run is a preset run. ``order`` runs lr 3e-3 and
      seed 0 first, so a sweep cut short still covers every (task, mixer), and ``--only
      task=in_context_recall`` runs one task. 1/200 of MAD's sequences (1/400 on selective
      copying, 1/50 on compression). Results: docs/studies/mad.md, from
      ``docs/results/mad_cpu.csv``.
  ``table1``: the DeltaNet paper's Table 1 comparison on every task: softmax (its Transformer),
      gla and deltanet × the same rates and seeds (108 runs, ``order`` as ``cpu``;
      ``docs/results/mad_table1_cpu.csv``).
  ``paper``: MAD's protocol (mad-lab's ``benchmark.py``; `configs/mad.py:paper_preset` lists
      its sources and every difference): each of MAD's 66 task settings (every task's baseline
      and its changes, one field at a time: ``configs/mad.py:<task>_paper[.<field>-<value>]``)
      × MAD's lr {1e-4, 5e-4, 1e-3} × weight decay {0, 0.1} (the ``opt`` axis, tuned) × Table
      1's mixers, each as MAD configures its layer (`PAPER_LAYERS`), one seed (MAD's 12345):
      396 runs per mixer, 1,188 in all, 200 epochs each (20,000 steps at 12,800 examples; fewer
      with fewer examples), stopped once test accuracy reaches 0.999. Scored MAD's way
      (``score = "mad"``): each setting at its best of the six optimizer choices, a task's
      score the mean over its settings; results.md adds that table. For a device; not run.
      The one-command launch: ``python experiments/sweep.py --config
      configs/sweeps/mad.py:paper --workdir runs/mad-paper`` (``--only mixer=deltanet`` for
      one mixer, ``--dry-run`` for the grid with each run's size).
  ``paper_smoke``: the ``paper`` grid's shape at the smoke size (two settings of in-context
      recall, two optimizer choices, softmax and deltanet, 4 steps each), for the test.
  ``smoke``: in-context recall at the smoke size, softmax and deltanet × 3 rates × 2 seeds,
      for the test; seconds.

Mixers: softmax, linear (elu+1), taylor (8 projected dims), retnet, gated, gla, deltanet,
gated_deltanet, swa (window 16), Based (taylor + swa layers), kda and gated_deltaproduct with
1 and 2 Householder steps (``_n1``, ``_n2``), each at its default β range, and rwkv7.

Expected ranking (DeltaNet paper Table 1): DeltaNet 100 on in-context recall, noisy recall and
selective copying where GLA scores 80.8 / 81.6 / 88.6; fuzzy recall hard for all (DeltaNet 35.7,
GLA 6.7–6.9). Compare rankings: the budget here is far below MAD's.
"""

from pathlib import Path

import ml_collections

from linear_attention.data.mad import TASKS, mad_changes
from linear_attention.training.cli import load_config_file
from linear_attention.training.sweep.grid import grid_axis
from linear_attention.training.sweep.mixers import mixer_axis

PRESETS = ("cpu", "paper", "paper_smoke", "smoke", "table1")
# MAD's settings, each a preset of configs/mad.py: ``<task>_paper[.<field>-<value>]``.
PAPER_SETTINGS = tuple(
    f"{task}_paper{suffix}"
    for task in TASKS
    for suffix in ("", *(f".{label}" for label, _ in mad_changes(task)))
)
# The DeltaNet paper's Table 1 comparison: its Transformer, GLA and DeltaNet.
TABLE1_MIXERS = ("softmax", "gla", "deltanet")
MIXERS = (
    "softmax",
    "linear",
    "taylor",
    "retnet",
    "gated",
    "gla",
    "deltanet",
    "gated_deltanet",
    "swa",
    "based",
    # The generalized delta rules (issue 20): gated_deltaproduct with 1 and 2 Householder steps.
    "kda",
    "gated_deltaproduct_n1",
    "gated_deltaproduct_n2",
    "rwkv7",
)
# MAD's optimizer grid (mad-lab's make_benchmark_mad_configs): lr × weight decay, with the
# cosine ending at 1e-6 whatever the rate, as MAD's does (min_lr_ratio = 1e-6 / lr).
PAPER_OPT = tuple((lr, wd, 1e-6 / lr) for lr in (1e-4, 5e-4, 1e-3) for wd in (0.0, 0.1))
PAPER_OPT_FIELDS = ("optimizer.learning_rate", "optimizer.weight_decay", "optimizer.min_lr_ratio")
# Each mixer's layer as MAD's configs/layers/*.yml set it: (position, heads). Attention
# (mh-attention.yml): rotary on its 8-dim heads, 16 heads; GLA (mh-gated-linear-attention.yml):
# 8 heads; DeltaNet has no MAD file: mh-linear-attention.yml's 16 heads, no positions.
PAPER_LAYERS = {"softmax": ("rope", 16), "gla": ("none", 8), "deltanet": ("none", 16)}
MIXER_FIELDS = (
    "model.mixer",
    "model.options.feature_dim",
    "model.options.window",
    "model.options.num_householder",
    "model.conv",
)
TASK_FIELDS = (
    "data.task",
    "data.vocab_size",
    "data.seq_len",
    "model.vocab_size",
    "model.max_length",
    "train.num_steps",
    "optimizer.warmup_steps",
    "train.eval_every",
    "train.checkpoint_every",
)


# The fields a MAD setting of the ``paper`` grid sets (its preset's values).
PAPER_TASK_FIELDS = (
    *TASK_FIELDS,
    "data.num_train_examples",
    "data.noise_fraction",
    "data.num_tokens_to_copy",
    "train.log_every",
)


def task_choice(task):
    """The values of `TASK_FIELDS` in the task's preset (``configs/mad.py:<task>``): MAD's
    baseline sizes and the preset's budget (the same number of tokens for every task)."""
    preset = _base(task)
    return tuple(preset[section][name] for section, name in (f.split(".") for f in TASK_FIELDS))


def _paper_axes(grid, settings, mixers):
    """The ``paper`` grid's task axis (each setting's preset values; labels ``<task>`` and
    ``<task>.<field>-<value>``, which `mad_scores` groups by task), its optimizer axis and its
    mixer axis (each mixer's layer as MAD sets it, no short conv)."""
    choices, labels = [], []
    for preset in settings:
        config = _base(preset)
        choices.append(tuple(_get(config, field) for field in PAPER_TASK_FIELDS))
        labels.append(preset.replace("_paper", ""))
    grid.task = grid_axis(PAPER_TASK_FIELDS, choices, tuple(labels))
    grid.opt = grid_axis(
        PAPER_OPT_FIELDS, PAPER_OPT, tuple(f"lr{lr:g}_wd{wd:g}" for lr, wd, _ in PAPER_OPT)
    )
    axis = mixer_axis(MIXER_FIELDS, mixers, taylor_dim=8, window=16, conv=0)
    axis.field = (*axis.field, "model.position", "model.num_heads")
    axis.choices = tuple((*c, *PAPER_LAYERS[m]) for c, m in zip(axis.choices, mixers, strict=True))
    grid.mixer = axis


def _get(config, field):
    section, name = field.split(".")
    return config[section][name]


def _mixer_axis(config, names):
    """The mixer axis: taylor layers at 8 projected dims, windows of 16, and the preset's
    short conv for every mixer but rwkv7 (said explicitly: unset, it is each mixer's default,
    off for all but the delta rules)."""
    return mixer_axis(MIXER_FIELDS, names, taylor_dim=8, window=16, conv=config.base.model.conv)


def _base(preset):
    return load_config_file(str(Path(__file__).resolve().parents[1] / "mad.py") + f":{preset}")


def get_config(arg=None):
    if arg not in PRESETS:
        raise ValueError(f"unknown preset {arg!r} for configs/sweeps/mad.py; presets: {PRESETS}")
    config = ml_collections.ConfigDict()
    config.tune = "lr"
    config.replicate = "seed"
    # Table and heat map: tasks across, one row per mixer.
    config.plot = ml_collections.ConfigDict(dict(x="task", line="mixer"))
    grid = config.grid = ml_collections.ConfigDict()
    grid.seed = grid_axis("seed", (0, 1))
    grid.lr = grid_axis("optimizer.learning_rate", (3e-3, 1e-3, 1e-2))
    if arg in ("paper", "paper_smoke"):
        config.tune = "opt"
        del config.replicate  # one seed, MAD's
        del config.grid.seed, config.grid.lr
        config.score = "mad"
        config.order = ("opt", "task", "mixer")
        config.base = _base("in_context_recall_paper")
        if arg == "paper":
            _paper_axes(grid, PAPER_SETTINGS, TABLE1_MIXERS)
            return config
        # Two settings of one task (the baseline, fewer examples), two optimizer choices,
        # softmax and deltanet, at the smoke size: PAPER_TASK_FIELDS' values for each.
        _paper_axes(grid, PAPER_SETTINGS[:1], ("softmax", "deltanet"))
        smoke = (("in_context_recall", 16, 16, 16, 16, 4, 0, 2, 2), (0.2, 16, 1))
        grid.task = grid_axis(
            PAPER_TASK_FIELDS,
            ((*smoke[0], 64, *smoke[1]), (*smoke[0], 32, *smoke[1])),
            ("in_context_recall", "in_context_recall.num_train_examples-32"),
        )
        grid.opt = grid_axis(PAPER_OPT_FIELDS, PAPER_OPT[:2], grid.opt.labels[:2])
        config.base.model.d_model = 32
        config.base.train.batch_size = 8
        config.base.data.num_test_examples = 20
        return config
    if arg == "smoke":
        config.base = _base("smoke")
        smoke = (("in_context_recall", 16, 16, 16, 16, 4, 2, 2, 2),)
        grid.task = grid_axis(TASK_FIELDS, smoke, ("in_context_recall",))
        grid.mixer = _mixer_axis(config, ("softmax", "deltanet"))
        grid.d_model = grid_axis("model.d_model", (32,))
        return config
    config.base = _base("in_context_recall")
    grid.task = grid_axis(TASK_FIELDS, tuple(task_choice(t) for t in TASKS), TASKS)
    mixers = TABLE1_MIXERS if arg == "table1" else MIXERS
    grid.mixer = _mixer_axis(config, mixers)
    grid.d_model = grid_axis("model.d_model", (64,))
    config.order = ("lr", "seed", "d_model", "task", "mixer")
    return config

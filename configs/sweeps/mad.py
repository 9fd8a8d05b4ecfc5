"""MAD study (DeltaNet paper Table 1; Poli et al. 2024): every mixer on MAD's six tasks, with
the MQAR study's protocol: several learning rates and seeds, the learning rate with the best
mean class-macro accuracy kept per (task, mixer), reported as mean and min–max over the seeds.

Command (writes results.csv, best.csv, results.md and mad_heatmap.png; resumable, a rerun
skips finished points):

    python experiments/sweep.py --config configs/sweeps/mad.py:cpu --workdir runs/mad --jobs 2

Presets (``configs/sweeps/mad.py:<arg>``):
  ``cpu``: the six tasks × 10 mixers (below) × learning rates (1e-3, 3e-3, 1e-2) × seeds
      (0, 1): 360 runs of ``configs/mad.py`` (2 layers with MLPs, d_model 64, 12,800
      training examples) cut to 400 steps of batch 64 (2 epochs), stopped early at an
      evaluation (every 100 steps) with accuracy >= 0.99. Budget estimate, not yet run in full:
      about a minute per run at length 128 on an idle 2-core machine, i.e. a few hours with
      ``--jobs 2``; ``order`` runs lr 3e-3 and seed 0 first, so a sweep cut short still
      covers every (task, mixer).
  ``smoke``: in-context recall at the smoke size, softmax and deltanet × 3 rates × 2 seeds,
      for the test; seconds.

Mixers: softmax, linear (elu+1), taylor (8 projected dims), retnet, gated, gla, deltanet,
gated_deltanet, swa (window 16) and Based (taylor + swa layers). kda, rwkv7 and
gated_deltaproduct are to be added once they are in the registry.

Expected ranking (DeltaNet paper Table 1): DeltaNet 100 on in-context recall, noisy recall and
selective copying where GLA scores 80.8 / 81.6 / 88.6; fuzzy recall hard for all (DeltaNet 35.7,
GLA 6.7–6.9). Compare rankings: the budget here is far below MAD's.
"""

import importlib.util
from pathlib import Path

import ml_collections

from linear_attention.data.mad import MAD_SETTINGS, TASKS, mad_num_tokens

PRESETS = ("cpu", "smoke")
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
)
MIXER_FIELDS = ("model.mixer", "model.feature_dim", "model.window")
TASK_FIELDS = (
    "data.task",
    "data.vocab_size",
    "data.seq_len",
    "model.vocab_size",
    "model.max_length",
)


def mixer_choices(names, *, taylor_dim=8, window=16):
    """(mixer, feature_dim, window) per label: only taylor layers use feature_dim, only swa
    layers the window (the others leave them unset: a mixer refuses an option it does not
    use)."""
    return [
        (
            ("taylor", "swa") if m == "based" else m,
            taylor_dim if m in ("taylor", "based") else None,
            window if m in ("swa", "based") else None,
        )
        for m in names
    ]


def task_choice(task):
    """(task, vocab, seq_len, model vocab, model max_length) at MAD's baseline."""
    vocab_size, seq_len = MAD_SETTINGS[task]
    return (task, vocab_size, seq_len, mad_num_tokens(task, vocab_size, seq_len), seq_len)


def _base(preset):
    path = Path(__file__).resolve().parents[1] / "mad.py"
    spec = importlib.util.spec_from_file_location("configs_mad", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def _axis(field, choices, labels=None):
    return ml_collections.ConfigDict(dict(field=field, choices=tuple(choices), labels=labels))


def get_config(arg=None):
    if arg not in PRESETS:
        raise ValueError(f"unknown preset {arg!r} for configs/sweeps/mad.py; presets: {PRESETS}")
    config = ml_collections.ConfigDict()
    config.tune = "lr"
    config.replicate = "seed"
    # Table and heat map: tasks across, one row per mixer.
    config.plot = ml_collections.ConfigDict(dict(x="task", line="mixer"))
    grid = config.grid = ml_collections.ConfigDict()
    grid.seed = _axis("seed", (0, 1))
    grid.lr = _axis("optimizer.learning_rate", (3e-3, 1e-3, 1e-2))
    if arg == "smoke":
        config.base = _base("smoke")
        smoke = (("in_context_recall", 16, 16, 16, 16),)
        grid.task = _axis(TASK_FIELDS, smoke, ("in_context_recall",))
        grid.mixer = _axis(
            MIXER_FIELDS, mixer_choices(("softmax", "deltanet")), ("softmax", "deltanet")
        )
        grid.d_model = _axis("model.d_model", (32,))
        return config
    config.base = base = _base("in_context_recall")
    base.train.num_steps = 400
    base.optimizer.warmup_steps = 40
    base.train.eval_every = 100
    base.train.checkpoint_every = 200
    base.train.stop_at = 0.99
    grid.task = _axis(TASK_FIELDS, tuple(task_choice(t) for t in TASKS), TASKS)
    grid.mixer = _axis(MIXER_FIELDS, mixer_choices(MIXERS), MIXERS)
    grid.d_model = _axis("model.d_model", (64,))
    config.order = ("lr", "seed", "d_model", "task", "mixer")
    return config

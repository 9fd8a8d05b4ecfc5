"""MQAR recall sweep (Zoology Fig. 2 / the Based recall–memory trade-off), Zoology's protocol:
every (mixer, d_model, task) trained at several learning rates and seeds; the learning rate with
the best mean accuracy over the seeds is kept and reported as mean and min–max over the seeds.

Command (writes results.csv, best.csv, results.md and two plots; resumable):

    python experiments/sweep.py --config configs/sweeps/mqar.py:cpu --workdir runs/mqar-study \
        --jobs 2

Presets (``configs/sweeps/mqar.py:<arg>``), both with these mixers (softmax, linear = elu+1,
taylor, retnet, gated, gla, deltanet, gated_deltanet, kda, gated_deltaproduct, rwkv7 (without
the base's short conv, which it refuses), swa, Based = ``("taylor", "swa")``: a Taylor layer
then a sliding-window layer, linear_scale8 = elu+1 with q and k scaled by 8 before the feature
map, and issue 53's families: fox, fox_bias5 (fox with its forget gate's bias started at 5),
mesanet, path, log_linear_mamba2, log_linear_gated_deltanet; issue 69's families over existing
kernels: rwkv6 and lightning (without the short conv, which they refuse), hgrn2, mlstm, gdn2;
issue 71's mamba (Mamba-1's block), rglru (Griffin's recurrent block) and comba (the delta
rule reading through its own key, on the DPLR kernels): 28 mixers) and 2 seeds:
  (none) / ``default``: the Zoology grid for an accelerator: vocab 8192, d_model 64…512,
      (seq_len, kv pairs) = (64, 4), (128, 8), (256, 16), (512, 64), learning rates
      logspace(-4, -2, 4), 20k steps of batch 256 per run; Taylor and Based with 16 projected
      dims, windows of 64 (at seq_len 64 that window is full softmax attention). 3584 runs.
  ``cpu``: d_model (64, 128) × (seq_len 64, 8 pairs) × learning rates (1e-2, 3e-2, 3e-3) ×
      seeds (0, 1): 336 runs of at most 400 steps of batch 64 (warmup 40, cosine), stopped at
      the first evaluation (every 50 steps, 512 held-out examples) with accuracy >= 0.99;
      Taylor and Based with 8 projected dims (45 features), swa and Based with windows of 16.
      1/200 of the Zoology grid's sequences. ``order`` runs d_model 64 first and lr 1e-2
      first, so a sweep cut short leaves every mixer at the same settings;
      ``--report-only --only lr=0.01`` tables what finished.
  ``forgetting``: the ``cpu`` protocol on Zoology's forgetting MQAR
      (``configs/mqar.py:forgetting``: after the 8 pairs, 4 keys get a new value and a query
      asks for the latest) for softmax, retnet, gla, deltanet, gated_deltanet and kda at
      d_model 128, lr 1e-2, seeds 0 and 1: 12 runs.
  ``smoke``: 8 tiny runs (softmax, linear × 2 learning rates × 2 seeds) for the test; seconds.

What the runs found, with every table generated from their results files: the MQAR study page,
docs/studies/mqar.md (EXPERIMENTS.md indexes the studies).

A grid axis is ``ConfigDict(field=path or tuple of paths, choices=(...), labels=optional)``;
``tune`` names the axis whose best choice is kept per setting (the learning rate, as Zoology),
``replicate`` the axis averaged over (the seed); ``plot`` names the axes of the
accuracy-vs-d_model figure (x, one line per, one panel per).
"""

from pathlib import Path

import ml_collections

from linear_attention.layers.fox import OPEN_LABEL as FOX_OPEN
from linear_attention.layers.registry import MIXERS as REGISTRY
from linear_attention.training.cli import load_config_file
from linear_attention.training.sweep.grid import grid_axis
from linear_attention.training.sweep.mixers import LINEAR_SCALED, mixer_axis

PRESETS = ("default", "cpu", "forgetting", "smoke")
# Every registered mixer joins the grids but these (a new family joins without an edit here):
LEFT_OUT = {
    "favor": "random features, redrawn in training: not in Zoology's grid",
    "hedgehog": "learned feature maps: not in Zoology's grid",
    "swa": "added below, beside Based",
    "lstm": "the sequential control of the state-tracking study",
    "mla": "issue 52's, for released checkpoints",
}
MIXERS = tuple(name for name in REGISTRY if name not in LEFT_OUT)
MIXERS += (FOX_OPEN,)  # fox with its forget gate starting open (`layers/fox.py`)
# Both grids add sliding-window softmax, Based (taylor and swa layers alternating, its taylor
# layers at the preset's projected width) and elu+1 with q and k scaled by 8, the fixed feature
# map at a scale where it learns (`linear_attention.training.sweep.mixers`).
# Forgetting MQAR: softmax, additive states with a decay (retnet: fixed, gla: per channel) and
# the delta rules, which overwrite a key's value in the state.
FORGETTING_MIXERS = ("softmax", "retnet", "gla", "deltanet", "gated_deltanet", "kda")
DEFAULT_MIXERS = (*MIXERS, "swa", "based", LINEAR_SCALED)
MIXER_FIELDS = (
    *(
        "model.mixer",
        "model.options.feature_dim",
        "model.options.window",
        "model.options.feature_scale",
        "model.conv",
    ),
    "model.options.forget_bias",
)


def _conv(base):
    """Every mixer keeps the base's short conv but rwkv7, which refuses one; False is how the
    study's results.csv (docs/results/mqar_sweep_cpu.csv) records that, so the file still reads
    back (`rows_from_csv` compares the values as written)."""
    return dict(conv=base.model.conv, no_conv=False)


def _base(preset):
    return load_config_file(str(Path(__file__).resolve().parents[1] / "mqar.py") + f":{preset}")


def get_config(arg=None):
    arg = arg or "default"
    if arg not in PRESETS:
        raise ValueError(f"unknown preset {arg!r} for configs/sweeps/mqar.py; presets: {PRESETS}")
    config = ml_collections.ConfigDict()
    config.base = _base(arg)
    config.tune = "lr"  # the best learning rate per (mixer, d_model, task) ...
    config.replicate = "seed"  # ... by its mean over the seeds (Zoology's protocol)
    config.plot = ml_collections.ConfigDict(dict(x="d_model", line="mixer", panel="task"))
    grid = config.grid = ml_collections.ConfigDict()
    grid.seed = grid_axis("seed", (0, 1))
    task = ("data.seq_len", "data.num_kv_pairs")

    if arg == "default":
        grid.mixer = mixer_axis(
            MIXER_FIELDS, DEFAULT_MIXERS, taylor_dim=16, window=64, **_conv(config.base)
        )
        # Zoology: d_model 64…512; seq_len and kv pairs grow together; lr = logspace(-4, -2, 4).
        grid.d_model = grid_axis("model.d_model", (64, 128, 256, 512))
        grid.task = grid_axis(task, ((64, 4), (128, 8), (256, 16), (512, 64)))
        grid.lr = grid_axis("optimizer.learning_rate", (1e-4, 4.6e-4, 2.2e-3, 1e-2))
    elif arg in ("cpu", "forgetting"):
        base = config.base
        # 400 steps: softmax at d_model 64 solves (64, 8) by step 250 at lr 3e-2 with both seeds,
        # but at lr 1e-2 only seed 0 does (step 250; seed 1 ends at 0.113, still on the plateau).
        # Runs that reach accuracy 0.99 stop at that evaluation (every 50 steps, 512 examples).
        base.train.num_steps = 400
        base.optimizer.warmup_steps = 40
        base.train.eval_every = 50
        base.train.log_every = 50
        base.train.checkpoint_every = 200
        base.train.stop_at = 0.99
        base.data.num_test_examples = 512
        # Taylor with 8 projected dims (M = 1 + 8 + 36 = 45 features): at d_model 64 its state
        # is 1.4x elu+1's, near Based's "equal state" comparison; 16 (M = 153) would exceed
        # softmax's whole KV cache at seq_len 64.
        # swa and Based's sliding windows see 16 tokens: at seq_len 64 a 64-token window is
        # full softmax attention; 16 holds at most 8 pairs when the queries come (no recall of
        # pairs further back), the point of Based's small windows plus a global linear state.
        grid.mixer = mixer_axis(
            MIXER_FIELDS, DEFAULT_MIXERS, taylor_dim=8, window=16, **_conv(base)
        )
        # d_model 32 learns nothing in 400 steps (every mixer <= 0.08 with 8 pairs at lr 1e-2,
        # seed 0: docs/results/mqar_sweep_cpu_1seed.md); (64, 8) only: the budget.
        grid.d_model = grid_axis("model.d_model", (64, 128))
        grid.task = grid_axis(task, ((64, 8),))
        # Listed in the order they run (``order``): 1e-2 first, the best single rate of the
        # earlier one-rate study; a sweep cut short leaves every mixer at the same rates.
        grid.lr = grid_axis("optimizer.learning_rate", (1e-2, 3e-2, 3e-3))
        config.order = ("d_model", "lr", "mixer", "seed", "task")
        if arg == "forgetting":
            # At d_model 128 and lr 1e-2 every one of these mixers recalls plain MQAR
            # (docs/studies/mqar.md), so what is lost here is what the reassignments cost.
            grid.mixer = mixer_axis(
                MIXER_FIELDS, FORGETTING_MIXERS, taylor_dim=8, window=16, **_conv(base)
            )
            grid.d_model = grid_axis("model.d_model", (128,))
            grid.task = grid_axis(task, ((64, 8),))
            grid.lr = grid_axis("optimizer.learning_rate", (1e-2,))
    else:  # smoke
        grid.mixer = grid_axis(
            ("model.mixer", "model.options.feature_dim"),
            (("softmax", None), ("linear", None)),
            ("softmax", "linear"),
        )
        grid.d_model = grid_axis("model.d_model", (32,))
        grid.task = grid_axis(task, ((32, 4),))
        grid.lr = grid_axis("optimizer.learning_rate", (1e-3, 3e-3))
    return config

"""Byte-level language-model comparison of the mixers at one parameter budget.

Command (writes results.csv, results.md and loss_curves.png):

    python experiments/sweep.py --config configs/sweeps/lm.py:cpu --workdir runs/lm-sweep

Each variant is softmax, linear (elu+1), favor (64 random features), taylor (Based, 16 projected
dims), retnet, gated, gla (a decay per key dimension), a hybrid (gated layers with one softmax
layer), deltanet, gated_deltanet, kda, gated_deltaproduct or rwkv7 (the delta rule and its
generalisations; rwkv7 without the base's short conv, which it refuses: its token shift is its
local context), on the built-in corpus (the standard library's source, documents packed per
file). d_model is adjusted per variant so parameter counts stay within 1% of softmax's (the
nearest widths otherwise: gla +1.03%, kda −1.25%, gated_deltaproduct +1.06% at ``:cpu``,
gated_deltaproduct +1.26% by default; the counts are in results.md; ``--dry-run`` prints them).
The table gives validation bits per byte, training tokens/s and decoding tokens/s (a fresh model
of the same config stepping through a whole ``seq_len`` context, batch 1). The corpus is the
running Python's standard library, so the figures depend on its version. What ``:cpu`` measured,
with its table generated from docs/results/lm_sweep_cpu.csv: docs/studies/lm.md.

Presets (``configs/sweeps/lm.py:<arg>``):
  (none) / ``default``: the accelerator model of ``configs/lm.py`` (8 layers, d_model 512 for
      softmax, sequence 1024) at learning rates 1e-3 and 3e-3.
  ``cpu``: 2 layers, d_model 128 for softmax, sequence 128, batch 32, 400 steps, lr 3e-3.
  ``smoke``: softmax and the hybrid, 2 tiny layers, a few steps, for the test.
"""

from pathlib import Path

import ml_collections

from linear_attention.training.cli import load_config_file
from linear_attention.training.sweep.grid import grid_axis

PRESETS = ("default", "cpu", "smoke")

# (label, mixer, d_model) per preset; the widths match softmax's parameter count within 1%
# (found by scanning d_model in steps of num_heads with `nnx.eval_shape`).
HYBRID_8 = ("gated", "gated", "gated", "softmax", "gated", "gated", "gated", "gated")
VARIANTS = {
    "default": (
        ("softmax", "softmax", 512),
        ("linear", "linear", 512),
        ("favor", "favor", 512),
        ("taylor", "taylor", 536),
        ("retnet", "retnet", 496),
        ("gated", "gated", 496),
        ("gla", "gla", 496),
        ("hybrid", HYBRID_8, 496),
        ("deltanet", "deltanet", 496),
        ("gated_deltanet", "gated_deltanet", 496),
        ("kda", "kda", 504),
        ("gated_deltaproduct", "gated_deltaproduct", 472),  # +1.26%, the nearest width
        ("rwkv7", "rwkv7", 504),  # +0.71%
    ),
    "cpu": (
        ("softmax", "softmax", 128),
        ("linear", "linear", 128),
        ("favor", "favor", 128),
        ("taylor", "taylor", 134),
        ("retnet", "retnet", 124),
        ("gated", "gated", 124),
        ("gla", "gla", 124),  # +1.03% (122: −2.1%)
        ("hybrid", ("gated", "softmax"), 126),
        ("deltanet", "deltanet", 124),
        ("gated_deltanet", "gated_deltanet", 124),
        ("kda", "kda", 120),  # −1.25%, the nearest width
        ("gated_deltaproduct", "gated_deltaproduct", 118),  # +1.06%, the nearest width
        ("rwkv7", "rwkv7", 122),  # −0.60%
    ),
    "smoke": (
        ("softmax", "softmax", 32),
        ("hybrid", ("gated", "softmax"), 32),
    ),
}


def _base(preset):
    return load_config_file(str(Path(__file__).resolve().parents[1] / "lm.py") + f":{preset}")


def get_config(arg=None):
    arg = arg or "default"
    if arg not in PRESETS:
        raise ValueError(f"unknown preset {arg!r} for configs/sweeps/lm.py; presets: {PRESETS}")
    config = ml_collections.ConfigDict()
    config.base = base = _base(arg)
    config.tune = "lr"
    config.decode_batch_size = 1
    base.train.sample_tokens = 0  # the comparison needs no sample (and skips compiling one)
    variants = VARIANTS[arg]
    grid = config.grid = ml_collections.ConfigDict()
    # rwkv7 refuses the base's short conv (its token shift is its local context)
    grid.mixer = grid_axis(
        ("model.mixer", "model.d_model", "model.conv"),
        [(m, d, False if m == "rwkv7" else base.model.conv) for _, m, d in variants],
        tuple(label for label, _, _ in variants),
    )
    if arg == "default":
        grid.lr = grid_axis("optimizer.learning_rate", (1e-3, 3e-3))
    elif arg == "cpu":
        base.train.num_steps = 400
        base.optimizer.warmup_steps = 40
        base.train.eval_every = 100
        base.train.log_every = 25
        base.train.checkpoint_every = 200
        grid.lr = grid_axis("optimizer.learning_rate", (3e-3,))
    else:  # smoke: two layers, so the hybrid has one gated and one softmax layer
        base.model.num_layers = 2
        grid.lr = grid_axis("optimizer.learning_rate", (1e-3,))
    return config

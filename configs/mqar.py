"""Multi-query associative recall (Zoology's MQAR) with a 2-layer model and no MLP.

Command (2 CPU cores, minutes):

    python experiments/train.py --config configs/mqar.py:cpu --workdir runs/mqar_softmax

The recall gap of a fixed-size state, same setting, another mixer:

    python experiments/train.py --config configs/mqar.py:cpu --workdir runs/mqar_linear \
        --config.model.mixer=linear

The runs of the ``cpu`` preset per mixer: docs/results/config_docstring_runs.md; the study over
mixers, widths and learning rates: docs/studies/mqar.md.

Presets (``configs/mqar.py:<arg>``):
  (none) / ``default``: the Zoology setting for an accelerator: vocab 8192, 2 layers, d_model
      128, no MLP, seq_len 256 with 16 pairs, 100k training examples, AdamW (weight decay 0.1)
      with warmup + cosine.
  ``cpu``: vocab 512, seq_len 64, 8 pairs, d_model 64, batch 64: minutes on 2 CPU cores.
  ``smoke``: a tiny run for tests (seconds, learns nothing).
  ``forgetting``: Zoology's forgetting MQAR at the ``cpu`` size: after the 8 pairs, 4 of the
      keys get a new value (``data.num_reassignments``), and a query must return the latest.
      Swept over mixers by ``configs/sweeps/mqar.py:forgetting`` (docs/studies/mqar.md).

The short causal convolution on q/k/v (``model.conv``, kernel 4) is on for every mixer:
linear mixers cannot bind a key to the value after it without it (Zoology's and Based's models
have it), and keeping it on for ``softmax`` too means ``--config.model.mixer=...`` compares
mixers on the same backbone. Labels exist only at query positions; eval/accuracy is over them.
"""

import ml_collections
from ml_collections import config_dict

from linear_attention.fields import did_you_mean
from linear_attention.training.config import (
    mesh_section,
    model_section,
    optimizer_section,
    train_section,
)

PRESETS = ("default", "cpu", "smoke", "forgetting")


def get_config(arg=None):
    arg = arg or "default"
    if arg not in PRESETS:
        raise ValueError(
            f"unknown preset {arg!r}{did_you_mean(arg, PRESETS)} for configs/mqar.py; "
            f"presets: {PRESETS}"
        )
    # One value for data and model: --config.data.vocab_size=N sets both.
    vocab_size = config_dict.FieldReference(8192)

    config = ml_collections.ConfigDict()
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.kind = "mqar"
    config.data.vocab_size = vocab_size
    config.data.seq_len = 256
    config.data.num_kv_pairs = 16
    config.data.power_a = 0.01
    config.data.num_train_examples = 100_000
    config.data.num_test_examples = 3_000
    config.data.random_non_queries = True
    config.data.num_reassignments = 0  # > 0: forgetting MQAR

    config.model = _model_config(vocab_size)

    # Only what differs from the dataclasses' defaults; every field can still be overridden.
    config.optimizer = optimizer_section(
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=1000, b2=0.98
    )
    config.train = train_section(num_steps=20_000, batch_size=256)
    config.mesh = mesh_section()

    if arg in ("cpu", "forgetting"):
        vocab_size.set(512)
        config.data.seq_len = 64
        config.data.num_kv_pairs = 8
        config.data.num_train_examples = 20_000
        config.data.num_test_examples = 1_000
        config.model.d_model = 64
        config.model.num_heads = 2
        config.optimizer.learning_rate = 3e-3
        config.optimizer.warmup_steps = 100
        config.train.num_steps = 2_000
        config.train.batch_size = 64
        config.train.eval_every = 250
        config.train.log_every = 50
        config.train.checkpoint_every = 500
        if arg == "forgetting":
            config.data.num_reassignments = 4
    elif arg == "smoke":
        vocab_size.set(64)
        config.data.seq_len = 32
        config.data.num_kv_pairs = 4
        config.data.num_train_examples = 256
        config.data.num_test_examples = 40
        config.model.d_model = 32
        config.model.num_heads = 2
        config.optimizer.warmup_steps = 2
        config.train.num_steps = 6
        config.train.batch_size = 8
        config.train.eval_every = 3
        config.train.log_every = 1
        config.train.checkpoint_every = 2
    return config


def _model_config(vocab_size):
    # Only what differs from ModelConfig's defaults; every model field (each mixer's options
    # included, `la-train --help` lists them) can still be set with --config.model.FIELD=VALUE.
    return model_section(
        vocab_size=vocab_size,
        d_model=128,
        num_layers=2,
        num_heads=2,
        mixer="softmax",
        conv=4,
        mlp=False,
        max_length=2048,  # >= data.seq_len (learned positions / decoding cache size)
    )

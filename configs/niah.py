"""Training on RULER-style needle prompts (``config.data.kind = "needles"``), for the needle
study (docs/guides/evaluation.md): train at one context length, then read needles at that length
and past it with ``la-eval --needles``.

Command (2 CPU cores):

    la-train --config configs/niah.py:cpu --workdir runs/niah_softmax
    la-eval --workdir runs/niah_softmax --needles niah_single_1 --lengths 512,1024,2048 \
        --depths 0,0.25,0.5,0.75,1 --samples 8 --answer_len 16 --output runs/niah_softmax/n.json

``--config.model.mixer=gated_deltanet`` (or ``kda``, or a hybrid pattern such as
``gated_deltanet,softmax``) trains another mixer on the same backbone.

Presets (``configs/niah.py:<arg>``):
  (none) / ``cpu``: ``niah_single_1`` (one 7-digit number hidden in repeated noise) at 512 byte
      tokens, 2 layers, d_model 128, no positions (the short convolution orders tokens, and the
      model reads past its training length), batch 16, 1,500 steps: minutes on 2 CPU cores.
  ``smoke``: a tiny run for tests (seconds, learns nothing).
"""

import ml_collections

from linear_attention.fields import did_you_mean
from linear_attention.training.config import (
    mesh_section,
    model_section,
    optimizer_section,
    train_section,
)

PRESETS = ("cpu", "smoke")


def get_config(arg=None):
    arg = arg or "cpu"
    if arg not in PRESETS:
        raise ValueError(
            f"unknown preset {arg!r}{did_you_mean(arg, PRESETS)} for configs/niah.py; "
            f"presets: {PRESETS}"
        )
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.data = ml_collections.ConfigDict(
        dict(kind="needles", task="niah_single_1", seq_len=512, answer_len=16,
             tokenizer="bytes", num_test_examples=128)
    )  # fmt: skip
    config.model = model_section(
        vocab_size=256,
        d_model=128,
        num_layers=2,
        num_heads=2,
        mixer="softmax",
        conv=4,
        position="none",
        max_length=4096,  # the decoding cache: the longest context la-eval reads
    )
    config.optimizer = optimizer_section(learning_rate=3e-3, weight_decay=0.1, warmup_steps=100)
    config.train = train_section(
        num_steps=1_500, batch_size=16, eval_every=250, log_every=50, checkpoint_every=500
    )
    config.mesh = mesh_section()
    if arg == "smoke":
        config.data.seq_len = 384
        config.data.num_test_examples = 4
        config.model.d_model = 32
        config.optimizer.warmup_steps = 2
        config.train.num_steps = 4
        config.train.batch_size = 2
        config.train.eval_every = 2
        config.train.log_every = 1
        config.train.checkpoint_every = 2
    return config

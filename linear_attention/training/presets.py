"""The small backbone and budget shared by the synthetic-task presets (``configs/mad.py`` and
``configs/state_tracking.py``): `synthetic_preset` builds a whole config from a task's data
section and its budget, so that each preset file states only those.

Why these sizes: a 2-layer model with MLPs, d_model 64 and 2 heads (softmax by default, the short
conv on, as in the MQAR CPU preset, so that ``--config.model.mixer=...`` compares mixers on one
backbone) is the smallest on which the published separations (the delta rule against gated
linear attention on MAD; β ∈ (0, 2) against (0, 1) on parity) are expected to show, and it keeps
one run within minutes on 2 CPU cores (docs/results/presets_cpu/). The smoke size (d_model 32,
4 steps of batch 8) exists for the tests.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_collections

from linear_attention.layers import SoftmaxMixer
from linear_attention.training.config import (
    mesh_section,
    model_section,
    optimizer_section,
    train_section,
)


def synthetic_preset(
    data: Mapping,
    *,
    vocab_size: int,
    max_length: int,
    learning_rate: float,
    num_steps: int,
    eval_every: int,
    log_every: int,
    checkpoint_every: int,
    warmup_steps: int,
    smoke: bool = False,
) -> ml_collections.ConfigDict:
    """A config with `data` as its data section: a 2-layer softmax model with MLPs and the
    short conv (kernel 4), d_model 64, 2 heads, `vocab_size` and `max_length` as given; AdamW
    (weight decay 0.1, β₂ 0.98) at `learning_rate`, `warmup_steps` of warmup then cosine to 0;
    batch 64 for `num_steps`. ``smoke=True``: d_model 32, 2 warmup steps, 4 steps of batch 8,
    evaluated and checkpointed every 2. Every field stays overridable from the command line."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.data = ml_collections.ConfigDict(dict(data))
    config.model = model_section(
        vocab_size=vocab_size,
        d_model=32 if smoke else 64,
        num_layers=2,
        num_heads=2,
        mixer=SoftmaxMixer.NAME,
        conv=4,
        mlp=True,
        max_length=max_length,
    )
    config.optimizer = optimizer_section(
        learning_rate=learning_rate,
        weight_decay=0.1,
        warmup_steps=2 if smoke else warmup_steps,
        b2=0.98,
    )
    config.train = train_section(
        num_steps=4 if smoke else num_steps,
        batch_size=8 if smoke else 64,
        eval_every=2 if smoke else eval_every,
        log_every=1 if smoke else log_every,
        checkpoint_every=2 if smoke else checkpoint_every,
    )
    config.mesh = mesh_section()
    return config

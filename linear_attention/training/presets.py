"""The small backbone and budget shared by the synthetic-task presets (``configs/mad.py`` and
``configs/state_tracking.py``): `synthetic_preset` resizes a base config (the MQAR CPU preset's
model, optimizer, train and mesh sections) for one task, so that each preset file states only
its data section and its budget.

Why these sizes: a 2-layer model with MLPs, d_model 64 and 2 heads is the smallest backbone on
which the published separations (delta rule against gated linear attention on MAD; β ∈ (0, 2)
against (0, 1) on parity) are expected to show, and it keeps one run within minutes on 2 CPU
cores. The smoke size (d_model 32, 4 steps of batch 8) exists for the tests.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_collections


def synthetic_preset(
    base: ml_collections.ConfigDict,
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
    """A config with `data` as its data section and `base`'s model, optimizer, train and mesh
    sections (shared with `base`, not copied), resized: vocab_size and max_length as given,
    d_model 64, 2 heads, MLPs; AdamW at `learning_rate` with `warmup_steps` of warmup; batch 64
    for `num_steps`. ``smoke=True``: d_model 32, 2 warmup steps, 4 steps of batch 8, evaluated
    and checkpointed every 2."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.data = ml_collections.ConfigDict(dict(data))

    config.model = base.model
    config.model.vocab_size = vocab_size
    config.model.d_model = 32 if smoke else 64
    config.model.num_heads = 2
    config.model.mlp = True
    config.model.max_length = max_length

    config.optimizer = base.optimizer
    config.optimizer.learning_rate = learning_rate
    config.optimizer.warmup_steps = 2 if smoke else warmup_steps

    config.train = base.train
    config.train.num_steps = 4 if smoke else num_steps
    config.train.batch_size = 8 if smoke else 64
    config.train.eval_every = 2 if smoke else eval_every
    config.train.log_every = 1 if smoke else log_every
    config.train.checkpoint_every = 2 if smoke else checkpoint_every
    config.mesh = base.mesh
    return config

"""The optax chain: global-norm clipping, then AdamW on a warmup + decay schedule.

Schedule, for step s (the number of updates already applied) and peak rate η:
``η s / warmup`` during warmup, then from η down to ``η · min_lr_ratio`` at ``num_steps`` by a
half cosine (``cosine``), a straight line (``linear``), or not at all (``constant``).
Weight decay applies to matrices (ndim >= 2) only, not to norms' scales or biases.
"""

from __future__ import annotations

import functools

import jax
import optax

from linear_attention.training.config import OptimizerConfig


def make_schedule(config: OptimizerConfig, num_steps: int) -> optax.Schedule:
    peak, end = config.learning_rate, config.learning_rate * config.min_lr_ratio
    warmup = config.warmup_steps
    decay_steps = max(num_steps - warmup, 1)
    if config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio)
    elif config.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    elif config.schedule == "constant":
        decay = optax.constant_schedule(peak)
    else:
        raise ValueError(f"unknown schedule {config.schedule!r}")
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


# Cached so that equal configs give the *same* transformation object: it is part of the
# optimizer's static graph, and an identical graph lets repeated runs reuse the compiled step.
@functools.lru_cache(maxsize=16)
def make_optimizer(
    config: OptimizerConfig, num_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)`` for ``config`` over ``num_steps`` steps."""
    schedule = make_schedule(config, num_steps)
    parts = []
    if config.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(config.grad_clip))
    parts.append(
        optax.adamw(
            schedule,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=_decay_mask,
        )
    )
    return optax.chain(*parts), schedule

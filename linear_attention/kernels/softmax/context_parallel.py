"""Softmax attention with time split over a mesh axis: context parallelism.

Softmax attention has no recurrent state to hand on, so each shard's queries attend to the
gathered keys and values of every shard (O(T/n · T) logits per device), masked with the global
positions (and segment ids).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softmax_context_parallel(q_BTHD, k_BTHD, v_BTHD, *, axis_name, scale, segment_ids=None):
    """Causal softmax attention with time split over `axis_name`: this shard's queries attend
    to the gathered keys and values of every shard, query s·T + t seeing key j iff j ≤ s·T + t
    (and, with `segment_ids [B, T]`, the same id). Logits and softmax in float32, masked before
    `exp`; the output has dtype `result_type(q, k, v)`."""
    dtype = jnp.result_type(q_BTHD, k_BTHD, v_BTHD)
    T = q_BTHD.shape[1]
    k_BSHD = jax.lax.all_gather(k_BTHD, axis_name, axis=1, tiled=True)
    v_BSHD = jax.lax.all_gather(v_BTHD, axis_name, axis=1, tiled=True)
    q_pos_T = jax.lax.axis_index(axis_name) * T + jnp.arange(T)
    visible_BTS = (jnp.arange(k_BSHD.shape[1])[None, :] <= q_pos_T[:, None])[None]
    if segment_ids is not None:
        ids_BS = jax.lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
        visible_BTS = visible_BTS & (segment_ids[:, :, None] == ids_BS[:, None, :])
    logits_BHTS = jnp.einsum(
        "bthd,bshd->bhts", q_BTHD, k_BSHD, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    logits_BHTS = jnp.where(visible_BTS[:, None], logits_BHTS, -jnp.inf)
    probs_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)  # every query sees itself: no empty row
    o_BTHD = jnp.einsum("bhts,bshd->bthd", probs_BHTS, v_BSHD.astype(jnp.float32))
    return o_BTHD.astype(dtype)

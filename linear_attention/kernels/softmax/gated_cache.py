"""A KV cache for softmax attention whose logits carry a cumulative log forget gate, shared by the
families that decode that way: forgetting attention (FoX) and PaTH attention.

Every filled slot j holds a key, a value, the cumulative log gate c_j (restarting at each reset)
and the reset count n_j. A new query i at position p + i, with c_i and n_i continued from the
last filled slot, sees slot j iff j ≤ p + i and n_j = n_i, with the logit

    s_ij = ℓ_ij + c_i − c_j

where ℓ_ij is the family's own term (FoX: scale·q_i·k_j; PaTH: the transported product). The
family computes ℓ over all L slots; `attend_slots` adds the gate, masks before `exp` and takes
the softmax over the slots. O(L) per decoded token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.kernels.segments import cumulative_log_decay


class ForgettingCache(NamedTuple):
    """The decoding state of a gated softmax family, `L` slots: keys `[B, L, H, D]` (PaTH keeps
    them transported to the last filled position), values `[B, L, H, Dv]`, and per slot its
    cumulative log forget gate `c` `[B, L, H]` (float32, restarting at resets) and reset count
    `n` `[B, L, H]` (int32). Slots at or after the decoding position are empty."""

    k: jax.Array
    v: jax.Array
    c: jax.Array
    n: jax.Array


def empty_cache(
    batch: int, length: int, heads: int, key_dim: int, value_dim: int, dtype, key_dtype=None
):
    """A `ForgettingCache` of `length` empty slots; keys in `key_dtype` (None: `dtype`)."""
    return ForgettingCache(
        k=jnp.zeros((batch, length, heads, key_dim), key_dtype or dtype),
        v=jnp.zeros((batch, length, heads, value_dim), dtype),
        c=jnp.zeros((batch, length, heads), jnp.float32),
        n=jnp.zeros((batch, length, heads), jnp.int32),
    )


def extend_gates(cache: ForgettingCache, position, log_forget_BTH):
    """The cumulative log gates c and reset counts n `[B, Tq, H]` of `Tq` new tokens at
    `position ..`, continuing the cache's last filled slot (zeros before the first token).
    `log_forget_BTH`: float32 `[B, Tq, H]` (≤ 0, −inf a reset; zeros for no gate)."""
    position = jnp.asarray(position, jnp.int32)
    last = jnp.maximum(position - 1, 0)
    c_prev = jnp.where(position > 0, jax.lax.dynamic_index_in_dim(cache.c, last, 1), 0.0)
    n_prev = jnp.where(position > 0, jax.lax.dynamic_index_in_dim(cache.n, last, 1), 0)
    c_new, n_new = cumulative_log_decay(log_forget_BTH, axis=1, restart=True)
    c_new = jnp.where(n_new > 0, c_new, c_new + c_prev)  # a reset among the new tokens restarts c
    return c_new, n_new + n_prev


def write_slots(cache: ForgettingCache, position, k, v, c, n) -> ForgettingCache:
    """The cache with slots `position .. position + Tq − 1` set to the new tokens' entries."""
    start = (0, jnp.asarray(position, jnp.int32), 0)
    return ForgettingCache(
        k=jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (*start, 0)),
        v=jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (*start, 0)),
        c=jax.lax.dynamic_update_slice(cache.c, c, start),
        n=jax.lax.dynamic_update_slice(cache.n, n, start),
    )


def attend_slots(cache: ForgettingCache, position, logits_BHTL, c_q, n_q):
    """Softmax over the slots of a cache that already holds the new tokens: the family's logits
    `[B, H, Tq, L]` plus c_i − c_j, masked to the filled slots of the query's reset group, times
    the values. Returns float32 `[B, Tq, H, Dv]`; NaN when the new tokens overflowed the cache
    (their write was clamped: refused loudly rather than attending to wrong slots)."""
    position = jnp.asarray(position, jnp.int32)
    tq, length = logits_BHTL.shape[2], cache.k.shape[1]
    c_q, n_q = jnp.moveaxis(c_q, 1, 2), jnp.moveaxis(n_q, 1, 2)  # [B, H, Tq]
    c_k, n_k = jnp.moveaxis(cache.c, 1, 2), jnp.moveaxis(cache.n, 1, 2)  # [B, H, L]
    slots = jnp.arange(length)
    visible = slots[None, :] <= position + jnp.arange(tq)[:, None]  # [Tq, L]
    visible = visible & (n_q[..., :, None] == n_k[..., None, :])
    logits_BHTL = logits_BHTL + c_q[..., :, None] - c_k[..., None, :]
    p_BHTL = jax.nn.softmax(jnp.where(visible, logits_BHTL, -jnp.inf), axis=-1)
    o = jnp.einsum("bhtl,blhe->bthe", p_BHTL, cache.v.astype(jnp.float32))
    return jnp.where(position + tq > length, jnp.nan, o)

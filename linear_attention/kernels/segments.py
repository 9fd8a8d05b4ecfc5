"""Packed rows: segment ids → the tokens where a recurrent state is reset, and the attention mask.

A row of `segment_ids: [B, T]` holds several documents; the state is zeroed before every token
whose id differs from the previous token's (never before the first token, so an initial state
flows into the first document only). A reset is a decay factor of exactly 0, i.e. a log decay of
−inf: kernels that take `log_decay` get packed rows by folding the resets into it, and must mask
−inf before any `exp` of a difference of cumulative log decays. Softmax attention instead masks
the logits of keys in another segment (`same_segment`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_segment_ids(segment_ids, batch: int, time: int):
    """Raise unless `segment_ids` is an integer array of shape `[B, T]` = `(batch, time)`; return
    it as an array (None stays None). Bool and arrays without a dtype (lists) are rejected."""
    if segment_ids is None:
        return None
    shape = tuple(np.shape(segment_ids))  # np: also a list, without a JAX warning
    dtype = getattr(segment_ids, "dtype", None)
    if shape != (batch, time) or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"segment_ids must be integers of shape [B, T] = {(batch, time)}, got shape {shape} "
            f"dtype {dtype}"
        )
    return jnp.asarray(segment_ids)


def segment_starts(segment_ids):
    """`[B, T]` bool: True at tokens whose id differs from the previous token's (never at t=0)."""
    changed_BT = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(changed_BT, ((0, 0), (1, 0)))


def segment_log_decay(segment_ids, log_decay, num_heads: int):
    """Fold the resets of `segment_ids [B, T]` into a log decay: −inf at every segment start.

    `log_decay` is float32 `[B, T, H]`, `[B, T, H, M]` (a decay per key dimension; every dimension
    is reset) or None (no decay). Returns float32 of the same shape, `[B, T, H]` for None.
    """
    starts_BT = segment_starts(segment_ids)
    if log_decay is None:
        log_decay = jnp.zeros((*segment_ids.shape, num_heads), jnp.float32)
    starts = starts_BT.reshape(starts_BT.shape + (1,) * (jnp.ndim(log_decay) - 2))
    return jnp.where(starts, -jnp.inf, log_decay)


def same_segment(q_segment_ids, k_segment_ids):
    """`[B, Tq, Tk]` bool: query i and key j are in the same segment (for softmax masks)."""
    return q_segment_ids[:, :, None] == k_segment_ids[:, None, :]


# Longest axis whose reset count `cumulative_log_decay` takes by a triangle matmul (a chunk's).
_COUNT_BY_MATMUL = 256


def cumulative_log_decay(a, axis: int, restart: bool = False, by_matmul: bool = False):
    """Cumulative log decay that stays finite across resets (−inf entries of `a`).

    Returns `(b, n)`: b = cumsum of a with −inf read as 0 (float32), n = cumsum of the resets
    (int32). Then for s ≤ t, Σ_{s<u≤t} a_u is b_t − b_s if n_t = n_s and −inf otherwise, so
    exp(B_t − B_s) = `masked_exp(n_t == n_s, b_t − b_s)` with no (−inf) − (−inf) = NaN.
    With `restart`, b restarts from 0 at every reset (a segmented sum; the same differences):
    under autodiff no gradient then reaches a log decay before a reset, not even as rounding.
    With `by_matmul` (not with `restart`), both sums are taken as a matmul with a triangle, n as
    float32 (exact integers): faster than `cumsum` on CPU along a short axis (a chunk). With
    `restart` along an axis of at most 256 (a chunk), n is taken by that matmul too (int32).
    """
    reset = jnp.isneginf(a)
    finite = jnp.where(reset, 0.0, a)

    def along_axis_by_matmul(x):
        # built only here: the [T, T] triangle of a long axis would not fit outside a chunk
        upper_ST = jnp.triu(jnp.ones((a.shape[axis],) * 2, jnp.float32))  # [s, t]: s ≤ t
        axes = "abcdefghijklmnopqrstuvwxy"[: a.ndim]
        s = axes[axis % a.ndim]
        spec = f"{axes},{s}z->{axes.replace(s, 'z')}"  # in place: no transposes around it
        return jnp.einsum(spec, x, upper_ST)

    if by_matmul:
        if restart:
            raise ValueError("cumulative_log_decay: by_matmul does not restart at resets")
        return along_axis_by_matmul(finite), along_axis_by_matmul(reset.astype(jnp.float32))
    if restart and a.shape[axis] <= _COUNT_BY_MATMUL:
        # a chunk's axis: the reset count by the triangle matmul (exact integers in float32),
        # XLA's CPU cumsum of int32 is a reduce-window, O(C) per entry and slow
        n = along_axis_by_matmul(reset.astype(jnp.float32)).astype(jnp.int32)
    else:
        n = jnp.cumsum(reset.astype(jnp.int32), axis=axis)
    if not restart:
        return jnp.cumsum(finite, axis=axis), n

    def combine(earlier, later):
        keep_e, b_e = earlier
        keep_l, b_l = later
        return keep_e * keep_l, b_l + keep_l * b_e

    keep = jnp.where(reset, 0.0, 1.0)
    return jax.lax.associative_scan(combine, (keep, finite), axis=axis)[1], n


def masked_exp(keep, x):
    """exp(x) where `keep`, exactly 0 elsewhere: masked before exp (no overflow, no NaN grad)."""
    return jnp.exp(jnp.where(keep, x, -jnp.inf))

"""Packed rows: segment ids → the tokens where a recurrent state is reset, and the attention mask.

A row of `segment_ids: [B, T]` holds several documents; the state is zeroed before every token
whose id differs from the previous token's (never before the first token, so an initial state
flows into the first document only). A reset is a decay factor of exactly 0, i.e. a log decay of
−inf: kernels that take `log_decay` get packed rows by folding the resets into it, and must mask
−inf before any `exp` of a difference of cumulative log decays. Softmax attention instead masks
the logits of keys in another segment (`same_segment`).

`Segments` carries what the kernels and layers need of packed rows, derived once per model call
(`Segments.from_ids`): every kernel's `segment_ids` takes it as well as raw ids, and then reads
its checked `ids` and `starts` instead of validating and deriving them again.
"""

from __future__ import annotations

from typing import NamedTuple

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


class Segments(NamedTuple):
    """Packed rows, derived once (`from_ids`), `[B, T]` each:

    ids        int32  the index of each token's document in its row (0, 1, 2, …): a softmax
                      mask over equal ids and a reset at changes of id then describe the same
                      documents even if an id comes back later
    starts     bool   True where a document starts (t = 0 of the row and every change of id;
                      under a time split, a span's first token is a start only if a document
                      starts there in the whole row)
    positions  int32  each token's position within its document (rotary, learned)
    """

    ids: jax.Array
    starts: jax.Array
    positions: jax.Array

    @classmethod
    def from_ids(cls, segment_ids, batch: int, time: int, axis_name: str | None = None):
        """Check `segment_ids` (integers `[batch, time]`, ValueError otherwise) and derive the
        document ids, starts and positions. With `axis_name` (time split over that `shard_map`
        axis, this call seeing one span of each row) the answer is the whole row's: the ids are
        gathered over the axis (`[B, T]` integers, small beside the activations), numbered, and
        this span's part sliced out, so every span numbers a document crossing its start as its
        neighbour does and counts positions from the document's global start."""
        segment_ids = check_segment_ids(segment_ids, batch, time)
        if axis_name is None:
            return cls(*_derive(segment_ids))
        row_BS = jax.lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
        start = jax.lax.axis_index(axis_name) * time
        parts = (jax.lax.dynamic_slice_in_dim(a, start, time, axis=1) for a in _derive(row_BS))
        return cls(*parts)


def _derive(segment_ids_BT):
    """(ids, starts, positions) of whole rows."""
    changes_BT = segment_starts(segment_ids_BT)
    ids_BT = jnp.cumsum(changes_BT, axis=1, dtype=jnp.int32)
    starts_BT = changes_BT.at[:, 0].set(True)
    index_T = jnp.arange(segment_ids_BT.shape[1], dtype=jnp.int32)
    first_BT = jax.lax.cummax(jnp.where(starts_BT, index_T, 0), axis=1)
    return ids_BT, starts_BT, index_T - first_BT


def document_ids(segment_ids, batch: int, time: int):
    """The `[B, T]` ids a kernel compares (masks): a `Segments`' own (checked when it was made,
    only its shape here), or raw `segment_ids` checked. None stays None."""
    if isinstance(segment_ids, Segments):
        _check_shape(segment_ids, batch, time)
        return segment_ids.ids
    return check_segment_ids(segment_ids, batch, time)


def _check_shape(segments: Segments, batch: int, time: int) -> None:
    if tuple(jnp.shape(segments.ids)) != (batch, time):
        raise ValueError(
            f"segment_ids (a Segments) must have shape [B, T] = {(batch, time)}, got "
            f"{tuple(jnp.shape(segments.ids))}"
        )


def segment_resets(segment_ids, batch: int, time: int, axis_name: str | None = None):
    """`[B, T]` bool: the tokens before which a recurrent state is zeroed, or None.

    `segment_ids`: None, raw ids `[B, T]` (checked here) or a `Segments` (read as it is). A reset
    is a document start, never the first token of the sequence (an initial state flows into the
    first document). With `axis_name` (time split), a span's first token is a reset when a
    document starts there in the whole row: a `Segments` made under the split knows it; for raw
    ids the previous span's last id arrives by `ppermute`.
    """
    if segment_ids is None:
        return None
    if isinstance(segment_ids, Segments):
        _check_shape(segment_ids, batch, time)
        first_B = segment_ids.starts[:, 0]
        if axis_name is None:
            first_B = jnp.zeros_like(first_B)
        else:
            first_B = first_B & (jax.lax.axis_index(axis_name) > 0)
        return segment_ids.starts.at[:, 0].set(first_B)
    ids_BT = check_segment_ids(segment_ids, batch, time)
    starts_BT = segment_starts(ids_BT)
    if axis_name is not None:
        starts_BT = starts_BT.at[:, 0].set(_span_start(ids_BT, axis_name))
    return starts_BT


def _span_start(segment_ids, axis_name):
    """`[B]` bool: this span's first token starts a new document (its id differs from the
    previous span's last id, which arrives by `ppermute`); False on the first span."""
    n = jax.lax.axis_size(axis_name)
    idx = jax.lax.axis_index(axis_name)
    prev_last_B = jax.lax.ppermute(
        segment_ids[:, -1], axis_name, perm=[(i, i + 1) for i in range(n - 1)]
    )
    return (idx > 0) & (segment_ids[:, 0] != prev_last_B)


def fold_resets(resets_BT, log_decay, num_heads: int):
    """A log decay with −inf (a reset) before every token of `resets_BT` (None: unchanged).

    `log_decay` is float32 `[B, T, H]`, `[B, T, H, M]` (every key dimension is reset) or None
    (zeros `[B, T, H]` are made when there is a reset to fold)."""
    if resets_BT is None:
        return log_decay
    if log_decay is None:
        log_decay = jnp.zeros((*resets_BT.shape, num_heads), jnp.float32)
    resets = resets_BT.reshape(resets_BT.shape + (1,) * (jnp.ndim(log_decay) - 2))
    return jnp.where(resets, -jnp.inf, log_decay)


def reset_reach(log_decay):
    """`[B, T, H]` bool: a reset lies at or before each token (a −inf log decay in every key
    dimension zeroes the whole state), or None without a decay. Under a time split it tells how
    far a NaN carried into the span reaches."""
    if log_decay is None:
        return None
    reached = jnp.isneginf(jnp.cumsum(log_decay, axis=1))
    return jnp.all(reached, -1) if reached.ndim == 4 else reached


def segment_starts(segment_ids):
    """`[B, T]` bool: True at tokens whose id differs from the previous token's (never at t=0)."""
    changed_BT = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(changed_BT, ((0, 0), (1, 0)))


def segment_log_decay(segment_ids, log_decay, num_heads: int):
    """Fold the resets of `segment_ids [B, T]` into a log decay: −inf at every segment start.

    `log_decay` is float32 `[B, T, H]`, `[B, T, H, M]` (a decay per key dimension; every dimension
    is reset) or None (no decay). Returns float32 of the same shape, `[B, T, H]` for None.
    """
    return fold_resets(segment_starts(segment_ids), log_decay, num_heads)


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


def decay_state(a, state):
    """exp(a) · `state` (`a` broadcast against it), exactly 0 where a = −inf (a reset) whatever
    the state holds: a select, since the product 0 · NaN would carry a NaN state past a reset."""
    return jnp.where(jnp.isneginf(a), 0.0, jnp.exp(a) * state)

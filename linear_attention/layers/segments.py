"""Packed rows: several documents in one row, told apart by `segment_ids[B, T]` (integers).

A document is a maximal run of equal ids: a token starts a new document when its id differs
from the previous token's (as the kernels reset their states). `Segments.from_ids` checks the
ids once and computes, once per model call, everything the layers need:

    ids        int32 [B, T]  the index of each token's document in its row (0, 1, 2, …): a
                             softmax mask over equal ids and a recurrent reset at changes of id
                             then describe the same documents even if an id comes back later
    starts     bool  [B, T]  True where a document starts (t = 0 and every change of id)
    positions  int32 [B, T]  each token's position within its document (rotary, learned)

The model builds it and passes it down its blocks; a mixer called with raw `segment_ids` builds
it itself. With time split over a mesh axis (`layers.sequence.split_sequence`), `from_ids` sees
one shard of the row and answers for the whole row: the ids are gathered over the axis (`[B, T]`
integers, small beside the activations), numbered, and this shard's part is sliced out, so every
shard numbers a document crossing its start as its neighbour does, knows whether its first token
starts a document, and counts positions from the document's global start. Layers below never
validate or convert the ids again (the public kernels, which take `ids` as their `segment_ids`,
keep their own input checks).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.kernels.segments import check_segment_ids, segment_starts
from linear_attention.layers.sequence import sequence_axis


class Segments(NamedTuple):
    """Document ids, starts and positions of packed rows, `[B, T]` each (see the module)."""

    ids: jax.Array
    starts: jax.Array
    positions: jax.Array

    @classmethod
    def from_ids(cls, segment_ids, batch: int, time: int) -> Segments:
        """Check `segment_ids` (integers `[batch, time]`, ValueError otherwise) and derive the
        document ids, starts and positions."""
        segment_ids = check_segment_ids(segment_ids, batch, time)
        axis = sequence_axis()
        if axis is None:
            return cls(*_derive(segment_ids))
        row_BS = jax.lax.all_gather(segment_ids, axis, axis=1, tiled=True)
        start = jax.lax.axis_index(axis) * time
        return cls(*(jax.lax.dynamic_slice_in_dim(a, start, time, axis=1) for a in _derive(row_BS)))


def _derive(segment_ids_BT):
    """(ids, starts, positions) of whole rows."""
    changes_BT = segment_starts(segment_ids_BT)
    ids_BT = jnp.cumsum(changes_BT, axis=1, dtype=jnp.int32)
    starts_BT = changes_BT.at[:, 0].set(True)
    index_T = jnp.arange(segment_ids_BT.shape[1], dtype=jnp.int32)
    first_BT = jax.lax.cummax(jnp.where(starts_BT, index_T, 0), axis=1)
    return ids_BT, starts_BT, index_T - first_BT


def as_segments(segments, batch: int, time: int) -> Segments | None:
    """`segments` as a `Segments`: None and `Segments` pass through, raw ids are checked and
    converted (the entry point of a layer called on its own)."""
    if segments is None or isinstance(segments, Segments):
        return segments
    return Segments.from_ids(segments, batch, time)


def document_ids(segment_ids_BT: jax.Array) -> jax.Array:
    """int32 `[B, T]`: the index of each token's document in its row (0 at t = 0, +1 at every
    change of id, where the kernels reset their states)."""
    b, t = segment_ids_BT.shape
    return Segments.from_ids(segment_ids_BT, b, t).ids


def document_positions(document_ids_BT: jax.Array) -> jax.Array:
    """int32 `[B, T]`: each token's position within its document (0 at a document's start)."""
    b, t = document_ids_BT.shape
    return Segments.from_ids(document_ids_BT.astype(jnp.int32), b, t).positions

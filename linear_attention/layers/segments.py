"""Packed rows: several documents in one row, told apart by `segment_ids[B, T]` (integers).

A document is a maximal run of equal ids: a token starts a new document when its id differs
from the previous token's (as the kernels reset their states). Every mixer reduces the ids to
`document_ids` (0, 1, 2, … per row), so a softmax mask over equal ids and a recurrent reset at
changes of id describe the same documents even if an id value comes back later in a row.

With time split over a mesh axis (`layers.sequence.split_sequence`), both functions see one
shard of the row and answer for the whole row: the ids are gathered over the axis (`[B, T]`
integers, small beside the activations), numbered, and this shard's part is sliced out, so
every shard numbers a document crossing its start as its neighbour does and counts positions
from the document's global start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.segments import segment_starts
from linear_attention.layers.sequence import sequence_axis


def _whole_row(fn, ids_BT: jax.Array) -> jax.Array:
    """``fn`` of the whole row: unsplit, ``fn(ids)``; with time split, ``fn`` of the gathered
    row, sliced back to this shard."""
    axis = sequence_axis()
    if axis is None:
        return fn(ids_BT)
    t = ids_BT.shape[1]
    row_BS = jax.lax.all_gather(ids_BT, axis, axis=1, tiled=True)
    return jax.lax.dynamic_slice_in_dim(fn(row_BS), jax.lax.axis_index(axis) * t, t, axis=1)


def document_ids(segment_ids_BT: jax.Array) -> jax.Array:
    """int32 `[B, T]`: the index of each token's document in its row (0 at t = 0, +1 at every
    change of id, where the kernels reset their states)."""
    return _whole_row(
        lambda ids: jnp.cumsum(segment_starts(ids), axis=1, dtype=jnp.int32), segment_ids_BT
    )


def document_positions(document_ids_BT: jax.Array) -> jax.Array:
    """int32 `[B, T]`: each token's position within its document (0 at a document's start)."""
    return _whole_row(_positions, document_ids_BT)


def _positions(document_ids_BT: jax.Array) -> jax.Array:
    t = document_ids_BT.shape[1]
    index_T = jnp.arange(t, dtype=jnp.int32)
    start_BT = jnp.concatenate(
        [
            jnp.ones_like(document_ids_BT[:, :1], dtype=bool),
            document_ids_BT[:, 1:] != document_ids_BT[:, :-1],
        ],
        axis=1,
    )
    first_BT = jax.lax.cummax(jnp.where(start_BT, index_T, 0), axis=1)
    return index_T - first_BT

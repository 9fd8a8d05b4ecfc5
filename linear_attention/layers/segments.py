"""Packed rows: several documents in one row, told apart by `segment_ids[B, T]` (integers).

A document is a maximal run of equal ids: a token starts a new document when its id differs
from the previous token's (as the kernels reset their states). Every mixer reduces the ids to
`document_ids` (0, 1, 2, … per row), so a softmax mask over equal ids and a recurrent reset at
changes of id describe the same documents even if an id value comes back later in a row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.segments import segment_starts


def document_ids(segment_ids_BT: jax.Array) -> jax.Array:
    """int32 `[B, T]`: the index of each token's document in its row (0 at t = 0, +1 at every
    change of id, where the kernels reset their states)."""
    return jnp.cumsum(segment_starts(segment_ids_BT), axis=1, dtype=jnp.int32)


def document_positions(document_ids_BT: jax.Array) -> jax.Array:
    """int32 `[B, T]`: each token's position within its document (0 at a document's start)."""
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

"""Packed rows: several documents in one row, told apart by `segment_ids[B, T]` (integers).

A document is a maximal run of equal ids: a token starts a new document when its id differs
from the previous token's (as the kernels reset their states). `Segments.from_ids` (the kernels'
`Segments`, which every kernel's `segment_ids` also takes) checks the ids once and computes, once
per model call, everything the layers and kernels need:

    ids        int32 [B, T]  the index of each token's document in its row (0, 1, 2, …): a
                             softmax mask over equal ids and a recurrent reset at changes of id
                             then describe the same documents even if an id comes back later
    starts     bool  [B, T]  True where a document starts (t = 0 and every change of id)
    positions  int32 [B, T]  each token's position within its document (rotary, learned)

The model builds it (`segments_of`) and passes it down its blocks and into the kernels; a mixer
called with raw `segment_ids` builds it itself. With time split over a mesh axis
(`layers.sequence.split_sequence`), `segments_of` sees one shard of the row and answers for the
whole row: the ids are gathered over the axis (`[B, T]` integers, small beside the
activations), numbered, and this shard's part is sliced out, so every shard numbers a document
crossing its start as its neighbour does, knows whether its first token starts a document, and
counts positions from the document's global start. Layers and kernels below never validate or
derive them again.
"""

from __future__ import annotations

from linear_attention.kernels.segments import Segments
from linear_attention.layers.sequence import sequence_axis

__all__ = ["Segments", "as_segments", "segments_of"]


def segments_of(segment_ids, batch: int, time: int) -> Segments:
    """`Segments.from_ids` for this call's rows, answering for the whole row under the layers'
    time split (`sequence_axis()`)."""
    return Segments.from_ids(segment_ids, batch, time, axis_name=sequence_axis())


def as_segments(segments, batch: int, time: int) -> Segments | None:
    """`segments` as a `Segments`: None and `Segments` pass through, raw ids are checked and
    converted (the entry point of a layer called on its own)."""
    if segments is None or isinstance(segments, Segments):
        return segments
    return segments_of(segments, batch, time)

"""The training data pipeline on Grain: source -> shuffle by epoch -> shard by process -> pack
documents with segment ids -> batch, with a checkpointable iterator.

Stages:

1. **source**: the training documents, each a span ``[begin, end)`` of a token stream (text: the
   documents of the training split; a token file: the documents its ``eos_id`` tokens end
   (`eos_spans`), or without one windows of ``seq_len + 1`` tokens). A
   document of ``n`` tokens becomes ``inputs = tokens[:-1]``, ``labels = tokens[1:]``: the
   first token of a document is never a target, as in packed windows (`text`), since nothing
   before it in its document predicts it.
2. **shuffle by epoch**: element ``i`` of the endless stream is document
   ``index_shuffle(i mod N, seed + i // N)``: every epoch visits each document once, in an
   order of its own (Grain's `index_shuffle`, a bijection computed per index, so nothing is
   held in memory and any position can be resumed).
3. **shard by process**: process ``p`` of ``P`` takes elements ``p, p + P, ...`` of that
   stream; the processes see disjoint documents and, together, every one.
4. **pack**: Grain's concat-then-split packing fills rows of ``seq_len`` tokens with whole
   documents, splitting one across rows when it does not fit (its continuation is a new
   document of the next row). ``segment_ids`` number the documents of a row from 0.
5. **batch**: ``batch_size / P`` rows per process (``drop_remainder``; the stream is endless).

The iterator's state (`state` / `restore`) is Grain's own (the parent's next index and the
packer's buffer), a small JSON object saved in every checkpoint by the trainer: a run resumed
from step ``s`` continues with exactly the batch an uninterrupted run takes at step ``s + 1``.
Batches are served in order; asking for another step than the next one raises, so a resume
that forgot to restore cannot pass unnoticed.
"""

from __future__ import annotations

import grain
import numpy as np

from linear_attention.data.batches import IGNORE_INDEX


def document_spans(document_ids: np.ndarray, *, min_tokens: int = 2) -> np.ndarray:
    """``int64[N, 2]``: ``[begin, end)`` of each run of equal ids in ``document_ids`` (the
    documents of a split, `text.split_documents`) holding at least ``min_tokens`` tokens (a
    one-token document has no target)."""
    ids = np.asarray(document_ids)
    if ids.size == 0:
        return np.zeros((0, 2), np.int64)
    cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    begins = np.concatenate([[0], cuts]).astype(np.int64)
    ends = np.concatenate([cuts, [ids.size]]).astype(np.int64)
    spans = np.stack([begins, ends], axis=1)
    return spans[ends - begins >= min_tokens]


def eos_spans(tokens: np.ndarray, eos_id: int, *, block: int = 1 << 24) -> np.ndarray:
    """``int64[N, 2]``: the documents of a token stream that ends each one with ``eos_id``:
    ``[begin, end)`` up to and including each ``eos_id`` token, and the tail after the last one
    (when there is one). Together they cover the stream. Read in blocks of ``block`` tokens
    (the stream may be a large memory-mapped file); ``N = 0`` when ``eos_id`` never occurs."""
    size = int(tokens.size)
    ends = [
        np.flatnonzero(np.asarray(tokens[b : b + block]) == eos_id).astype(np.int64) + b + 1
        for b in range(0, size, block)
    ]
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    if ends.size == 0:
        return np.zeros((0, 2), np.int64)
    if ends[-1] != size:
        ends = np.append(ends, size)
    return np.stack([np.concatenate([[0], ends[:-1]]), ends], axis=1)


def window_spans(size: int, seq_len: int, keep: np.ndarray | None = None) -> np.ndarray:
    """``int64[N, 2]``: windows ``[c·seq_len, c·seq_len + seq_len + 1)`` of a stream of ``size``
    tokens (consecutive windows share one token, so every token but the first is a target),
    those with ``keep[c]`` when given."""
    count = max(0, (size - 1) // seq_len)
    begins = np.arange(count, dtype=np.int64) * seq_len
    spans = np.stack([begins, begins + seq_len + 1], axis=1)
    return spans if keep is None else spans[keep[:count]]


class GrainPipeline:
    """Training batches ``{"inputs", "labels", "segment_ids"}: int32[batch_size / P, seq_len]``
    from the documents ``spans`` of ``stream`` (see the module docstring)."""

    def __init__(
        self,
        stream: np.ndarray,
        spans: np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if len(spans) == 0:
            raise ValueError(
                "the training split holds no document of two tokens or more; give a larger corpus"
            )
        if batch_size % process_count:
            raise ValueError(
                f"batch_size = {batch_size} must be divisible by the {process_count} processes"
            )
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        self.stream, self.spans = stream, np.asarray(spans, np.int64)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.local_batch_size = batch_size // process_count
        n = len(self.spans)

        def document(index: int, _) -> dict[str, np.ndarray]:
            epoch, i = divmod(index, n)
            j = grain.experimental.index_shuffle(
                i, max_index=n - 1, seed=(seed + epoch) % 2**32, rounds=4
            )
            begin, end = self.spans[j]
            tokens = np.asarray(self.stream[begin:end], np.int32)
            return {"inputs": tokens[:-1], "labels": tokens[1:]}

        ordered = grain.MapDataset.range(n).repeat(None).map_with_index(document)
        sharded = ordered[process_index::process_count]
        packed = grain.experimental.ConcatThenSplitIterDataset(
            sharded.to_iter_dataset(), length_struct={"inputs": seq_len, "labels": seq_len}
        )
        self._dataset = packed.batch(self.local_batch_size, drop_remainder=True).map(_finish)
        self._iterator = iter(self._dataset)
        self.step = 0  # batches served so far

    def next_batch(self, step: int) -> dict[str, np.ndarray]:
        """The batch of step ``step`` (0-based), which must be the next one."""
        if step != self.step:
            raise RuntimeError(
                f"the data pipeline is at step {self.step}, asked for step {step}: restore its "
                "state from the checkpoint first"
            )
        batch = next(self._iterator)
        self.step += 1
        return batch

    def state(self) -> dict:
        """The iterator's position after `step` batches: JSON-serialisable."""
        return {"step": self.step, "iterator": self._iterator.get_state()}

    def restore(self, state: dict) -> None:
        """Continue from a `state` (after its ``step`` batches)."""
        iterator = iter(self._dataset)
        iterator.set_state(_tuples(state["iterator"]))
        self._iterator, self.step = iterator, int(state["step"])


def _tuples(value):
    """A state back from JSON: Grain keeps some positions as tuples, JSON gives lists."""
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def _finish(batch: dict) -> dict[str, np.ndarray]:
    """Grain's packed features -> the batch format: segment ids from 0 in each row, and labels
    of padding (segment 0 in Grain's numbering, none in an endless stream) ignored."""
    seg = batch["inputs_segment_ids"].astype(np.int32)
    labels = np.where(seg > 0, batch["labels"], IGNORE_INDEX).astype(np.int32)
    return {
        "inputs": batch["inputs"].astype(np.int32),
        "labels": labels,
        "segment_ids": np.maximum(seg - 1, 0),
    }

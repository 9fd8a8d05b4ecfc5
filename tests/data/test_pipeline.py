"""The Grain pipeline: epochs visit every document once, processes' shards together are the
one-process batch, packed rows keep documents apart, and a restored iterator continues
exactly."""

import json

import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.pipeline import GrainPipeline, document_spans, window_spans

# Documents of 3..9 tokens (shorter than a row, so packing keeps the stream's order); the
# stream is 0, 1, 2, ... so a token names its document.
LENGTHS = [5, 3, 9, 4, 7, 3, 6, 8, 5, 4, 9, 3]
IDS = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
STREAM = np.arange(IDS.size)


def test_spans():
    np.testing.assert_array_equal(
        document_spans(np.array([0, 0, 1, 2, 2, 2, 3, 3])), [[0, 2], [3, 6], [6, 8]]
    )
    np.testing.assert_array_equal(window_spans(10, 3), [[0, 4], [3, 7], [6, 10]])
    keep = np.array([True, False, True])
    np.testing.assert_array_equal(window_spans(10, 3, keep), [[0, 4], [6, 10]])


def _visits(batches, spans):
    """The documents in the order the rows hold them: a new visit at every segment change and
    at a row start, unless the row continues the previous row's document (a split one)."""
    doc_of = np.searchsorted(spans[:, 0], np.arange(STREAM.size), side="right") - 1
    order, previous_label = [], None
    for batch in batches:
        for row, seg, labels in zip(
            batch["inputs"], batch["segment_ids"], batch["labels"], strict=True
        ):
            # Within a document the labels are the next tokens; a segment is one document.
            np.testing.assert_array_equal(labels, row + 1)
            docs = doc_of[row]
            assert seg[0] == 0 and (np.diff(seg) >= 0).all()
            for t in range(row.size):
                if t and seg[t] == seg[t - 1]:
                    assert docs[t] == docs[t - 1]
                    continue
                if t == 0 and previous_label == row[0]:
                    continue  # the rest of a document split across rows
                order.append(int(docs[t]))
            previous_label = labels[-1]
    return order


def test_epochs_visit_every_document_once_in_new_orders():
    spans = document_spans(IDS)
    pipeline = GrainPipeline(STREAM, spans, seq_len=10, batch_size=2, seed=5)
    batches = [pipeline.next_batch(step) for step in range(12)]  # 240 tokens: > 3 epochs
    order = _visits(batches, spans)
    n = len(LENGTHS)
    epochs = [order[e * n : (e + 1) * n] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]


def test_process_shards_are_the_single_process_batch():
    """The sharding arithmetic behind a multi-process run (tested with two real processes in
    `tests/training/test_multiprocess.py`): with documents that fill a row each (token-file
    windows), process p of P takes elements p, p + P, ... of the shuffled stream, so at step s
    process p holds rows 4s + p and 4s + p + 2 of the one-process batch (batch 4, P = 2),
    and the processes' rows in process order are that batch's rows 0, 2, 1, 3."""
    stream = np.arange(200)
    spans = window_spans(stream.size, 8)  # 24 windows of 9 tokens: one row each
    make = lambda p, n: GrainPipeline(  # noqa: E731
        stream, spans, seq_len=8, batch_size=4, seed=3, process_index=p, process_count=n
    )
    whole, shards = make(0, 1), [make(0, 2), make(1, 2)]
    for step in range(7):  # into the second epoch (6 steps each)
        want = whole.next_batch(step)
        got = [shard.next_batch(step) for shard in shards]
        for key in ("inputs", "labels", "segment_ids"):
            np.testing.assert_array_equal(got[0][key], want[key][[0, 2]], f"{key} {step}")
            np.testing.assert_array_equal(got[1][key], want[key][[1, 3]], f"{key} {step}")
    with pytest.raises(ValueError, match="batch_size = 3 must be divisible by the 2 processes"):
        GrainPipeline(stream, spans, seq_len=8, batch_size=3, seed=5, process_count=2)


def test_restored_state_continues_exactly():
    spans = document_spans(IDS)
    make = lambda: GrainPipeline(STREAM, spans, seq_len=7, batch_size=3, seed=1)  # noqa: E731
    full = make()
    reference = [full.next_batch(s) for s in range(9)]
    run = make()
    for s in range(4):
        run.next_batch(s)
    state = json.loads(json.dumps(run.state()))  # as the checkpoint stores it
    resumed = make()
    resumed.restore(state)
    for s in range(4, 9):
        batch = resumed.next_batch(s)
        for key in ("inputs", "labels", "segment_ids"):
            np.testing.assert_array_equal(batch[key], reference[s][key])
    with pytest.raises(RuntimeError, match="at step 9, asked for step 3: restore its state"):
        resumed.next_batch(3)


def test_packed_rows_ignore_nothing_and_empty_source_raises():
    pipeline = GrainPipeline(STREAM, document_spans(IDS), seq_len=6, batch_size=2, seed=0)
    assert (pipeline.next_batch(0)["labels"] != IGNORE_INDEX).all()  # an endless stream: no pad
    with pytest.raises(ValueError, match="no document of two tokens or more"):
        GrainPipeline(STREAM, document_spans(np.arange(5)), seq_len=6, batch_size=2, seed=0)

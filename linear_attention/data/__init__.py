"""Data sources: the MQAR generator and byte-level text. NumPy only, no model code.

A source has ``vocab_size``, ``seq_len``, ``train_batch(step, batch_size)`` (a batch keyed by
the step, so a resumed run sees the same data) and ``eval_batches(batch_size)``; batches are
``{"inputs": int32[B, T], "labels": int32[B, T]}`` with ``IGNORE_INDEX`` where nothing is
predicted, and ``"segment_ids": int32[B, T]`` for packed text (documents within a row).
"""

from linear_attention.data.batches import IGNORE_INDEX, padded_batches
from linear_attention.data.mqar import MQARData, check_mqar_settings, multiquery_ar
from linear_attention.data.text import (
    VOCAB_SIZE,
    TextData,
    load_corpus,
    load_documents,
    split_corpus,
    split_documents,
)

__all__ = [
    "IGNORE_INDEX",
    "MQARData",
    "TextData",
    "VOCAB_SIZE",
    "check_mqar_settings",
    "load_corpus",
    "load_documents",
    "multiquery_ar",
    "padded_batches",
    "split_corpus",
    "split_documents",
]

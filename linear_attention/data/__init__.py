"""Data sources: the MQAR generator, text (bytes or any tokenizer) and token files, the Grain
pipeline. NumPy (and Grain, tokenizers) only, no model code.

A source has ``vocab_size``, ``seq_len``, ``train_batch(step, batch_size)`` (a batch keyed by
the step, so a resumed run sees the same data) and ``eval_batches(batch_size)``; batches are
``{"inputs": int32[B, T], "labels": int32[B, T]}`` with ``IGNORE_INDEX`` where nothing is
predicted, and ``"segment_ids": int32[B, T]`` for packed text (documents within a row).
Language-modelling sources (`sources`) add ``token_bytes`` (bits per byte), ``tokenizer`` and
``provenance``; the Grain loader adds ``iterator_state()`` / ``restore_iterator(state)``
(saved with checkpoints).
"""

from linear_attention.data.batches import IGNORE_INDEX, padded_batches
from linear_attention.data.corpus import read_documents, read_token_file
from linear_attention.data.mqar import MQARData, check_mqar_settings, multiquery_ar
from linear_attention.data.text import (
    VOCAB_SIZE,
    TextData,
    load_corpus,
    load_documents,
    split_corpus,
    split_documents,
)
from linear_attention.data.tokenizers import load_tokenizer, train_bpe

__all__ = [
    "IGNORE_INDEX",
    "MQARData",
    "TextData",
    "VOCAB_SIZE",
    "check_mqar_settings",
    "load_corpus",
    "load_documents",
    "load_tokenizer",
    "multiquery_ar",
    "padded_batches",
    "read_documents",
    "read_token_file",
    "split_corpus",
    "split_documents",
    "train_bpe",
]

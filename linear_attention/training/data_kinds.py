"""Data kinds: one registry entry per ``config.data.kind``, its frozen config and its builder.

    DATA_KINDS[kind] = DataKind(config=<frozen dataclass>, build=<config, run -> DataSource>)

The configs live with the data (`data.configs`). A builder gets the data config and the
`ExperimentConfig` of the run and returns a `data.protocol.DataSource`. A new data kind is a
config class, a builder and one entry here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from linear_attention.data import MQARData
from linear_attention.data.configs import (
    PREFIX,
    MADDataConfig,
    MQARDataConfig,
    NeedleDataConfig,
    StateTrackingDataConfig,
    TextDataConfig,
    TokenDataConfig,
)
from linear_attention.data.corpus import read_documents
from linear_attention.data.mad import MADData
from linear_attention.data.needles import NeedleData, corpus_sentences
from linear_attention.data.protocol import DataSource
from linear_attention.data.sources import text_source, token_file_source
from linear_attention.data.state_tracking import StateTrackingData
from linear_attention.data.tokenizers import load_tokenizer
from linear_attention.fields import check_choice
from linear_attention.training.metrics import Progress


# ---------------------------------------------------------------------------- builders
def _mqar(d: MQARDataConfig, run, **_) -> DataSource:
    return MQARData(
        vocab_size=d.vocab_size,
        seq_len=d.seq_len,
        num_kv_pairs=d.num_kv_pairs,
        num_train_examples=d.num_train_examples,
        num_test_examples=d.num_test_examples,
        power_a=d.power_a,
        random_non_queries=d.random_non_queries,
        seed=run.seed,
        num_reassignments=d.num_reassignments,
    )


def _mad(d: MADDataConfig, run, **_) -> DataSource:
    return MADData(
        task=d.task,
        vocab_size=d.vocab_size,
        seq_len=d.seq_len,
        num_train_examples=d.num_train_examples,
        num_test_examples=d.num_test_examples,
        seed=run.seed,
        **d.options,
    )


def _state_tracking(d: StateTrackingDataConfig, run, **_) -> DataSource:
    return StateTrackingData(
        task=d.task,
        min_len=d.min_len,
        max_len=d.seq_len,
        eval_lengths=d.eval_lengths,
        num_eval_examples=d.num_eval_examples,
        seed=run.seed,
    )


def _needles(d: NeedleDataConfig, run, **_) -> DataSource:
    sentences = []
    if NeedleData.needs_corpus(d.task):
        documents, _ = read_documents(d.path or None, text_field=d.text_field, max_bytes=1 << 22)
        sentences = corpus_sentences(documents)
    return NeedleData(
        task=d.task,
        seq_len=d.seq_len,
        answer_len=d.answer_len,
        tokenizer=load_tokenizer(d.tokenizer),
        sentences=sentences,
        num_test_examples=d.num_test_examples,
        seed=run.seed,
    )


def _run(run) -> dict:
    """What a language-modelling source takes of the run: its seed, batch and process."""
    return dict(
        seed=run.seed,
        batch_size=run.train.batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


# Corpora tokenized in seconds show no progress.
_PROGRESS_CHARACTERS = 1 << 26


def _text(d: TextDataConfig, run, *, cache_dir=None, message=None) -> DataSource:
    progress = Progress("tokenizing the corpus", unit="characters", min_total=_PROGRESS_CHARACTERS)
    try:
        return text_source(
            d, cache_dir=cache_dir, message=message, progress=progress.update, **_run(run)
        )
    finally:
        progress.close()


def _tokens(d: TokenDataConfig, run, **_) -> DataSource:
    return token_file_source(d, vocab_size=run.model.vocab_size, **_run(run))


@dataclasses.dataclass(frozen=True)
class DataKind:
    """A data kind: its config class and ``build(data_config, run, *, cache_dir, message)``."""

    config: type
    build: Callable[..., DataSource]


DATA_KINDS: dict[str, DataKind] = {
    cls.KIND: DataKind(cls, build)
    for cls, build in (
        (MQARDataConfig, _mqar),
        (TextDataConfig, _text),
        (TokenDataConfig, _tokens),
        (MADDataConfig, _mad),
        (StateTrackingDataConfig, _state_tracking),
        (NeedleDataConfig, _needles),
    )
}
DATA_CONFIGS: tuple[type, ...] = tuple(kind.config for kind in DATA_KINDS.values())


def data_kind(kind: Any) -> DataKind:
    """The registry entry of ``config.data.kind``; ValueError listing the kinds otherwise."""
    return DATA_KINDS[check_choice(PREFIX + "kind", kind, tuple(DATA_KINDS))]


__all__ = [*(cls.__name__ for cls in DATA_CONFIGS), "DATA_CONFIGS", "DATA_KINDS", "DataKind"]

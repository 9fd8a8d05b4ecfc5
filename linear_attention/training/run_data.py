"""A run's data: the source built from ``config.data`` by its kind (`build_data`), the check
that a batch fits the model (`checked`), and the record that identifies the data so that a
resumed run can say what changed (`data_record`, `data_changes`)."""

from __future__ import annotations

import json

import numpy as np

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.protocol import DataSource
from linear_attention.models import ModelConfig
from linear_attention.models.tokens import check_token_ids
from linear_attention.training.config import ExperimentConfig
from linear_attention.training.data_kinds import DATA_KINDS
from linear_attention.training.workdir import RunError


def build_data(
    config: ExperimentConfig, *, cache_dir: str | None = None, message=None
) -> DataSource:
    """The data source of ``config.data``, by its kind's builder (`data_kinds.DATA_KINDS`;
    tokenized text is cached in ``cache_dir``)."""
    kind = DATA_KINDS[config.data.kind]
    return kind.build(config.data, config, cache_dir=cache_dir, message=message)


def checked(batch: dict, model: ModelConfig, where: str) -> dict:
    """``batch`` once its inputs are token ids of the model and its labels too (or
    ``IGNORE_INDEX``); `RunError` naming the bad id and ``where`` otherwise."""
    try:
        check_token_ids(batch["inputs"], model.vocab_size, name=f"inputs of {where}")
        labels = np.asarray(batch["labels"])
        check_token_ids(
            np.where(labels == IGNORE_INDEX, 0, labels), model.vocab_size, name=f"labels of {where}"
        )
    except ValueError as e:
        raise RunError(f"the data do not fit config.model: {e}") from None
    return batch


# What a run's data are, compared on resume (`data_record`): each key of a source's provenance
# that identifies its content, and how a message names it.
_DATA_KEYS = {
    "sha256": "the corpus",
    "digest": "the token file",
    "tokenizer_sha256": "the tokenizer file",
    "vocab_size": "the tokenizer's vocabulary",
}


def data_record(provenance: dict | None) -> dict | None:
    """The part of a source's ``provenance`` that identifies its content (saved with every
    checkpoint; None for synthetic data): the corpus's SHA-256 (text), the token file's digest
    (`data.files.file_digest`: whole, or size + samples for files over 1 GiB), the tokenizer's
    SHA-256 and vocabulary, and the paths for the messages."""
    if not provenance:
        return None
    record = {k: provenance[k] for k in (*_DATA_KEYS, "path", "tokenizer") if k in provenance}
    return json.loads(json.dumps(record))


def data_changes(saved: dict, now: dict) -> list[str]:
    """What differs between two `data_record`s, in words (empty: the same data)."""
    out = []
    for key, name in _DATA_KEYS.items():
        if key in saved and saved[key] != now.get(key):
            old, new = saved[key], now.get(key)
            if isinstance(old, dict) or isinstance(new, dict):  # a file digest
                old, new = (
                    f"{d.get('bytes')} bytes, {str(d.get('sha256', d.get('sampled_sha256')))[:12]}"
                    if isinstance(d, dict)
                    else d
                    for d in (old, new)
                )
            elif isinstance(old, str) and len(old) == 64:
                old, new = old[:12], str(new)[:12]
            where = saved.get("tokenizer" if key.startswith(("tokenizer", "vocab")) else "path")
            out.append(f"{name}{f' {where!r}' if where else ''} ({old} then, {new} now)")
    return out

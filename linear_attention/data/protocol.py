"""`DataSource`: what the trainer asks of a data source, and the answers of a plain one.

    train_batch(step, batch_size) -> batch       keyed by the step: a resumed run sees the same
    eval_batches(batch_size) -> iterator          the evaluation set, padded with ignored rows
    eval_groups(batch_size) -> {name: batches}    evaluation sets scored apart ({"": all} here)
    score                                         "micro" (token accuracy) or "class_macro" (MAD)
    chance                                        the accuracy of a guess (for length metrics)
    token_bytes                                   bytes per token id, for bits per byte (None:
                                                  no text)
    tokenizer, provenance                         what made the tokens and what the corpus was
    process_local                                 each process holds its own rows of a batch
    stateful                                      a loader with a state saved with checkpoints:
    iterator_state() / restore_iterator(state)    (None: stateless, nothing to restore)

A source subclasses `DataSource` and overrides what differs; the trainer reads these names and
never probes for attributes. Batches are ``{"inputs": int32[B, T], "labels": int32[B, T]}``
with ``IGNORE_INDEX`` where nothing is predicted, and ``"segment_ids"`` for packed rows.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DataSource:
    """A data source's defaults: one evaluation group scored by token accuracy, no text, the
    same rows on every process, no iterator state."""

    score: ClassVar[str] = "micro"
    chance: float = 0.0
    token_bytes: Any = None
    tokenizer: Any = None
    provenance: dict | None = None
    process_local: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    seq_len: int
    vocab_size: int

    def train_batch(self, step: int, batch_size: int) -> dict:
        raise NotImplementedError

    def eval_batches(self, batch_size: int):
        raise NotImplementedError

    def eval_groups(self, batch_size: int) -> dict:
        """Evaluation sets scored apart, by name; "" is the whole set scored as one."""
        return {"": self.eval_batches(batch_size)}

    def iterator_state(self) -> dict | None:
        return None

    def restore_iterator(self, state: dict | None) -> None:
        """Restore the state `iterator_state` saved; a stateless source has nothing to do."""

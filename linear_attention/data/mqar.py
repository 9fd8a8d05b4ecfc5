"""Multi-query associative recall (MQAR), the synthetic recall task of Zoology.

Each example of length ``seq_len`` starts with ``num_kv_pairs`` key-value pairs
``k_1 v_1 k_2 v_2 ...`` (keys drawn without replacement from ``[1, vocab_size // 2)``, values
from ``[vocab_size // 2, vocab_size)``). After the pairs every key is asked once: key ``k_i``
is placed at position ``2 * num_kv_pairs + 2 * g_i``, where the distinct gaps ``g_i`` are drawn
without replacement from ``{0, ..., space - 1}``, ``space = (seq_len - 2 * num_kv_pairs) // 2``,
with probability ``p(g) ∝ a * (g + 1)^(a - 1)`` (``a = power_a``; small ``a`` puts queries
near the pairs). The label at a query position is the key's value; every other position carries
``IGNORE_INDEX``. Remaining positions are filler: uniform random tokens of the whole vocabulary
(``random_non_queries=True``, as in Zoology) or 0.
"""

from __future__ import annotations

import functools

import numpy as np

from linear_attention.data.batches import IGNORE_INDEX, padded_batches
from linear_attention.data.forgetting_mqar import forgetting_mqar
from linear_attention.data.protocol import DataSource
from linear_attention.data.recall_sampling import (
    check_mqar_settings,
    sample_distinct,
    sample_weighted_distinct,
)

__all__ = ["MQARData", "check_mqar_settings", "multiquery_ar"]


def multiquery_ar(
    *,
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    num_examples: int,
    seed: int | np.random.SeedSequence,
    power_a: float = 0.01,
    random_non_queries: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Generate ``(inputs, labels)``, both ``int32[num_examples, seq_len]``.

    ``labels[b, t]`` is the token the model must predict after reading ``inputs[b, : t + 1]``:
    a value at the ``num_kv_pairs`` query positions, ``IGNORE_INDEX`` elsewhere.
    Deterministic in ``seed``.
    """
    check_mqar_settings(
        vocab_size=vocab_size, seq_len=seq_len, num_kv_pairs=num_kv_pairs, power_a=power_a
    )
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    rng = np.random.default_rng(seed)
    n, k = num_examples, num_kv_pairs
    context = 2 * k
    half = vocab_size // 2
    keys = sample_distinct(rng, n, 1, half, k)
    values = sample_distinct(rng, n, half, vocab_size, k)

    space = (seq_len - context) // 2
    gap = np.arange(1, space + 1, dtype=np.float64)
    log_p = np.log(power_a) + (power_a - 1.0) * np.log(gap)
    gaps = sample_weighted_distinct(rng, n, log_p, k)

    # Build the unshifted sequence of length seq_len + 1, then inputs = seq[:-1] and the labels
    # are the next tokens (only the values that follow a queried key are kept).
    rows = np.arange(n)[:, None]
    seq = np.zeros((n, seq_len + 1), dtype=np.int32)
    seq[:, 0:context:2] = keys
    seq[:, 1:context:2] = values
    query_pos = context + 2 * gaps
    seq[rows, query_pos] = keys
    target = np.full((n, seq_len + 1), IGNORE_INDEX, dtype=np.int32)
    target[rows, query_pos + 1] = values

    inputs = seq[:, :-1]
    labels = target[:, 1:]
    if random_non_queries:
        filler = rng.integers(0, vocab_size, size=inputs.shape, dtype=np.int32)
        inputs = np.where(inputs == 0, filler, inputs)
    return np.ascontiguousarray(inputs), np.ascontiguousarray(labels)


class MQARData(DataSource):
    """A fixed MQAR train set and test set (different seeds); step-keyed training batches."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        num_kv_pairs: int,
        num_train_examples: int,
        num_test_examples: int,
        power_a: float = 0.01,
        random_non_queries: bool = True,
        seed: int = 0,
        num_reassignments: int = 0,
    ):
        """``num_reassignments > 0``: forgetting MQAR (`forgetting_mqar`), that many keys get a
        new value before the queries."""
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        common = dict(
            vocab_size=vocab_size,
            seq_len=seq_len,
            num_kv_pairs=num_kv_pairs,
            power_a=power_a,
            random_non_queries=random_non_queries,
        )
        generate = multiquery_ar
        if num_reassignments:
            generate = functools.partial(forgetting_mqar, num_reassignments=num_reassignments)
        self.train_inputs, self.train_labels = generate(
            num_examples=num_train_examples, seed=np.random.SeedSequence([seed, 0]), **common
        )
        self.test_inputs, self.test_labels = generate(
            num_examples=num_test_examples, seed=np.random.SeedSequence([seed, 1]), **common
        )

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The training batch of ``step``: distinct examples drawn with a generator keyed by
        ``(seed, step)``, so a resumed run sees the same batches."""
        n = self.train_inputs.shape[0]
        if batch_size > n:
            raise ValueError(f"batch_size={batch_size} exceeds num_train_examples={n}")
        rng = np.random.default_rng([self.seed, 2, step])
        idx = rng.choice(n, size=batch_size, replace=False)
        return {"inputs": self.train_inputs[idx], "labels": self.train_labels[idx]}

    def eval_batches(self, batch_size: int):
        """The whole test set in order, the last batch padded with ignored rows."""
        yield from padded_batches(self.test_inputs, self.test_labels, batch_size)

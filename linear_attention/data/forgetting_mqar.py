"""Forgetting MQAR (Zoology's variant of multi-query associative recall): keys are reassigned
later in the sequence, and a query must return the latest value.

An example of length ``seq_len`` starts with ``num_kv_pairs`` pairs ``k_1 v_1 ... k_n v_n``
(distinct keys from ``[1, vocab_size // 2)``), then ``num_reassignments`` pairs ``k v'`` that
give ``r`` distinct keys among them (a uniformly random subset, in random order) a new value.
All ``n + r`` values are distinct draws from ``[vocab_size // 2, vocab_size)``, so an old value
is never the answer by accident. After these ``2 (n + r)`` positions every key is queried once,
at the power-law spaced positions of MQAR (`mqar.multiquery_ar`, ``power_a``), and the label at
a query is the key's latest value (``v'`` if it was reassigned). Filler as in MQAR.
"""

from __future__ import annotations

import numpy as np

from linear_attention.data.batches import IGNORE_INDEX
from linear_attention.data.recall_sampling import (
    check_mqar_settings,
    sample_distinct,
    sample_weighted_distinct,
)


def check_forgetting_settings(
    *, vocab_size: int, seq_len: int, num_kv_pairs: int, num_reassignments: int, power_a: float
) -> None:
    """Raise ``ValueError`` naming the numbers if a setting cannot be generated."""
    check_mqar_settings(
        vocab_size=vocab_size, seq_len=seq_len, num_kv_pairs=num_kv_pairs, power_a=power_a
    )
    n, r = num_kv_pairs, num_reassignments
    if not 1 <= r <= n:
        raise ValueError(f"num_reassignments must be in [1, num_kv_pairs={n}], got {r}")
    if seq_len < 2 * (n + r) + 2 * n:
        raise ValueError(
            f"seq_len must be >= 2 * (num_kv_pairs + num_reassignments) + 2 * num_kv_pairs = "
            f"{2 * (n + r) + 2 * n} (pairs, reassignments, then the queries), got {seq_len}"
        )
    num_values = vocab_size - vocab_size // 2
    if num_values < n + r:
        raise ValueError(
            f"vocab_size={vocab_size} gives {num_values} values; num_kv_pairs + "
            f"num_reassignments = {n + r} distinct values are needed"
        )


def forgetting_mqar(
    *,
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    num_reassignments: int,
    num_examples: int,
    seed,
    power_a: float = 0.01,
    random_non_queries: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)``, both ``int32[num_examples, seq_len]``; deterministic in ``seed``."""
    check_forgetting_settings(
        vocab_size=vocab_size,
        seq_len=seq_len,
        num_kv_pairs=num_kv_pairs,
        num_reassignments=num_reassignments,
        power_a=power_a,
    )
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    rng = np.random.default_rng(seed)
    n, k, r = num_examples, num_kv_pairs, num_reassignments
    half = vocab_size // 2
    rows = np.arange(n)[:, None]
    keys = sample_distinct(rng, n, 1, half, k)
    values = sample_distinct(rng, n, half, vocab_size, k + r)
    first, new = values[:, :k], values[:, k:]
    which = sample_distinct(rng, n, 0, k, r)  # indices (into keys) of the reassigned keys
    latest = first.copy()
    latest[rows, which] = new

    context = 2 * (k + r)
    space = (seq_len - context) // 2
    gap = np.arange(1, space + 1, dtype=np.float64)
    gaps = sample_weighted_distinct(rng, n, np.log(power_a) + (power_a - 1.0) * np.log(gap), k)

    seq = np.zeros((n, seq_len + 1), dtype=np.int32)
    seq[:, 0 : 2 * k : 2], seq[:, 1 : 2 * k : 2] = keys, first
    seq[:, 2 * k : context : 2] = keys[rows, which]
    seq[:, 2 * k + 1 : context : 2] = new
    query_pos = context + 2 * gaps
    seq[rows, query_pos] = keys
    target = np.full((n, seq_len + 1), IGNORE_INDEX, dtype=np.int32)
    target[rows, query_pos + 1] = latest

    inputs, labels = seq[:, :-1], target[:, 1:]
    if random_non_queries:
        filler = rng.integers(0, vocab_size, size=inputs.shape, dtype=np.int32)
        inputs = np.where(inputs == 0, filler, inputs)
    return np.ascontiguousarray(inputs), np.ascontiguousarray(labels)

"""Samplers and the settings check shared by the recall generators (`mqar.py`,
`forgetting_mqar.py`, `mad.py`): distinct uniform draws, weighted draws without replacement,
and what an MQAR setting needs. NumPy only; every draw comes from the caller's generator.
"""

from __future__ import annotations

import numpy as np

# Rows sampled per chunk so that the [rows, choices] uniform matrix stays ~32 MiB.
_CHUNK_ELEMENTS = 1 << 23


def check_mqar_settings(*, vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float):
    """Raise ``ValueError`` naming the numbers if an MQAR setting cannot be generated."""
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be >= 1, got {num_kv_pairs}")
    if seq_len < 4 * num_kv_pairs:
        raise ValueError(
            f"seq_len must be >= 4 * num_kv_pairs = {4 * num_kv_pairs} (the pairs take "
            f"2 * num_kv_pairs positions and the queries need 2 * num_kv_pairs more), "
            f"got seq_len={seq_len}, num_kv_pairs={num_kv_pairs}"
        )
    num_keys = vocab_size // 2 - 1
    num_values = vocab_size - vocab_size // 2
    if num_keys < num_kv_pairs or num_values < num_kv_pairs:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for {num_kv_pairs} distinct keys and values: "
            f"it gives {num_keys} keys (tokens 1..{vocab_size // 2 - 1}) and {num_values} values; "
            f"need vocab_size >= {2 * num_kv_pairs + 2}"
        )
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0, got {power_a}")


def _top_k_rows(rng: np.random.Generator, scores_fn, num_rows: int, num_choices: int, k: int):
    """Indices of the ``k`` largest of ``scores_fn(u)`` per row, u ~ U(0, 1), in score order."""
    out = np.empty((num_rows, k), dtype=np.int64)
    chunk = max(1, _CHUNK_ELEMENTS // num_choices)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        scores = scores_fn(rng.random((stop - start, num_choices)))
        idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        # argpartition leaves the chosen k in an arbitrary order: sort them by score so the
        # order is itself uniformly random (the scores are i.i.d.).
        order = np.argsort(-np.take_along_axis(scores, idx, axis=1), axis=1)
        out[start:stop] = np.take_along_axis(idx, order, axis=1)
    return out


def sample_distinct(rng: np.random.Generator, num_rows: int, low: int, high: int, k: int):
    """``[num_rows, k]`` ints, each row ``k`` distinct uniform draws from ``[low, high)``
    (a uniformly random ordered ``k``-tuple of distinct values)."""
    m = high - low
    if k * k > 2 * m:
        return low + _top_k_rows(rng, lambda u: u, num_rows, m, k)
    # Collisions are rare enough (P(row repeats) ~ 1 - exp(-k^2 / 2m) <= 0.63): draw with
    # replacement and redraw whole rows that repeat a value. Rejecting whole rows keeps the law
    # exactly uniform, at O(k) work per row instead of O(m).
    out = rng.integers(0, m, size=(num_rows, k))
    bad = np.arange(num_rows)
    while True:
        s = np.sort(out[bad], axis=1)
        bad = bad[(s[:, 1:] == s[:, :-1]).any(axis=1)]
        if bad.size == 0:
            return low + out
        out[bad] = rng.integers(0, m, size=(bad.size, k))


def sample_weighted_distinct(rng: np.random.Generator, num_rows: int, log_p: np.ndarray, k: int):
    """``[num_rows, k]`` ints drawn without replacement with weights ``exp(log_p)``.

    Gumbel top-k: ``argtop_k(log_p + G)`` with i.i.d. Gumbel ``G`` has the law of successive
    sampling without replacement (the law of ``numpy.random.choice(replace=False, p=p)``).
    """
    log_p = np.asarray(log_p, np.float64)
    return _top_k_rows(rng, lambda u: log_p - np.log(-np.log(u)), num_rows, log_p.shape[0], k)

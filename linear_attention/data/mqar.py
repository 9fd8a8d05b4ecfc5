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


class MQARData:
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
            # (imported here: forgetting_mqar builds on this module's samplers)
            from linear_attention.data.forgetting_mqar import forgetting_mqar

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

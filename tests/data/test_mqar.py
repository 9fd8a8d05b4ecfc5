"""MQAR generator: structure checked example by example against a plain Python reading."""

import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX, MQARData, multiquery_ar
from linear_attention.data.recall_sampling import sample_distinct, sample_weighted_distinct


def _check_example(x, y, *, vocab_size, num_kv_pairs, random_non_queries):
    """Read one example the slow way and assert every property of the task."""
    half = vocab_size // 2
    pairs = {}
    for i in range(num_kv_pairs):
        key, value = int(x[2 * i]), int(x[2 * i + 1])
        assert 1 <= key < half, key
        assert half <= value < vocab_size, value
        assert key not in pairs
        pairs[key] = value
    assert len(set(pairs.values())) == num_kv_pairs
    # Nothing is predicted inside the context.
    assert (y[: 2 * num_kv_pairs] == IGNORE_INDEX).all()
    queried = []
    for t in range(2 * num_kv_pairs, len(x)):
        if y[t] != IGNORE_INDEX:
            assert (t - 2 * num_kv_pairs) % 2 == 0, t
            key = int(x[t])
            assert pairs[key] == y[t]
            queried.append(key)
    assert sorted(queried) == sorted(pairs)
    if not random_non_queries:
        labelled = set(np.flatnonzero(y != IGNORE_INDEX))
        for t in range(2 * num_kv_pairs, len(x)):
            if t not in labelled:
                assert x[t] == 0, (t, x[t])
    assert ((0 <= x) & (x < vocab_size)).all()


@pytest.mark.parametrize(
    "vocab_size,seq_len,num_kv_pairs,random_non_queries",
    [(64, 32, 8, True), (20, 21, 4, False), (8192, 128, 16, True), (512, 64, 8, False)],
)
def test_structure(vocab_size, seq_len, num_kv_pairs, random_non_queries):
    x, y = multiquery_ar(
        vocab_size=vocab_size,
        seq_len=seq_len,
        num_kv_pairs=num_kv_pairs,
        num_examples=50,
        seed=3,
        random_non_queries=random_non_queries,
    )
    assert x.shape == y.shape == (50, seq_len)
    assert x.dtype == y.dtype == np.int32
    for b in range(50):
        _check_example(
            x[b],
            y[b],
            vocab_size=vocab_size,
            num_kv_pairs=num_kv_pairs,
            random_non_queries=random_non_queries,
        )


def test_deterministic_by_seed():
    kw = dict(vocab_size=128, seq_len=64, num_kv_pairs=8, num_examples=20)
    a = multiquery_ar(seed=1, **kw)
    b = multiquery_ar(seed=1, **kw)
    c = multiquery_ar(seed=2, **kw)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert (a[0] != c[0]).any()


def test_power_law_query_gap():
    """With one pair the gap g (query at 2 + 2g) has law p(g) ∝ a (g+1)^(a-1) exactly."""
    seq_len, n = 22, 40_000
    space = (seq_len - 2) // 2
    for power_a in (0.01, 1.0):
        _, y = multiquery_ar(
            vocab_size=16,
            seq_len=seq_len,
            num_kv_pairs=1,
            num_examples=n,
            seed=0,
            power_a=power_a,
        )
        pos = np.argmax(y != IGNORE_INDEX, axis=1)
        gaps = (pos - 2) // 2
        freq = np.bincount(gaps, minlength=space) / n
        p = power_a * np.arange(1, space + 1) ** (power_a - 1)
        p /= p.sum()
        # Binomial standard error of each frequency; 5 sigma.
        np.testing.assert_allclose(freq, p, atol=5 * np.sqrt(p * (1 - p) / n).max())


def test_samplers_are_distinct_and_uniform():
    rng = np.random.default_rng(0)
    for k, m in ((3, 10), (8, 10)):  # the rejection path and the top-k path
        s = sample_distinct(rng, 20_000, 5, 5 + m, k)
        assert s.min() >= 5 and s.max() < 5 + m
        assert (np.sort(s, axis=1)[:, 1:] != np.sort(s, axis=1)[:, :-1]).all()
        # Every slot is uniform over the m values: P = 1/m each.
        for j in range(k):
            freq = np.bincount(s[:, j] - 5, minlength=m) / 20_000
            np.testing.assert_allclose(freq, 1 / m, atol=5 * np.sqrt(0.1 * 0.9 / 20_000))
    # Weighted, k=2 of 3 with p = (.5, .3, .2): P(first=0) = .5, P(second=0) = .3/.7*.5+.2/.8*.5.
    g = sample_weighted_distinct(rng, 40_000, np.log([0.5, 0.3, 0.2]), 2)
    p_second0 = 0.3 * 0.5 / 0.7 + 0.2 * 0.5 / 0.8
    np.testing.assert_allclose((g[:, 0] == 0).mean(), 0.5, atol=0.012)
    np.testing.assert_allclose((g[:, 1] == 0).mean(), p_second0, atol=0.012)


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            dict(vocab_size=512, seq_len=31, num_kv_pairs=8),
            "seq_len must be >= 4 \\* num_kv_pairs = 32.*seq_len=31",
        ),
        (
            dict(vocab_size=17, seq_len=64, num_kv_pairs=8),
            "vocab_size=17 is too small for 8.*7 keys",
        ),
        (dict(vocab_size=64, seq_len=64, num_kv_pairs=0), "num_kv_pairs must be >= 1, got 0"),
        (dict(vocab_size=64, seq_len=64, num_kv_pairs=4, power_a=0.0), "power_a must be > 0"),
    ],
)
def test_bad_settings_raise_with_numbers(kw, match):
    with pytest.raises(ValueError, match=match):
        multiquery_ar(num_examples=4, seed=0, **kw)


def test_dataset_batches_and_sets():
    data = MQARData(
        vocab_size=64,
        seq_len=32,
        num_kv_pairs=4,
        num_train_examples=100,
        num_test_examples=10,
        seed=5,
    )
    b1, b2, b3 = data.train_batch(7, 16), data.train_batch(7, 16), data.train_batch(8, 16)
    np.testing.assert_array_equal(b1["inputs"], b2["inputs"])
    assert (b1["inputs"] != b3["inputs"]).any()
    # A batch is a set of distinct training rows.
    rows = {tuple(r) for r in data.train_inputs}
    assert {tuple(r) for r in b1["inputs"]} <= rows
    assert len({tuple(r) for r in b1["inputs"]}) == 16
    # Train and test sets come from different seeds.
    assert not ({tuple(r) for r in data.test_inputs} & rows)
    # Evaluation covers the test set exactly once; padding rows carry no labels.
    batches = list(data.eval_batches(4))
    assert len(batches) == 3
    np.testing.assert_array_equal(
        np.concatenate([b["inputs"] for b in batches])[:10], data.test_inputs
    )
    assert (batches[-1]["labels"][2:] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="batch_size=101 exceeds num_train_examples=100"):
        data.train_batch(0, 101)

"""Forgetting MQAR: every query's label is the key's latest value, read the slow way."""

import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX, MQARData
from linear_attention.data.forgetting_mqar import forgetting_mqar


def test_queries_return_the_latest_value():
    n, r = 6, 3
    x, y = forgetting_mqar(
        vocab_size=64, seq_len=64, num_kv_pairs=n, num_reassignments=r, num_examples=200, seed=0
    )
    assert x.shape == y.shape == (200, 64) and x.dtype == np.int32
    changed = 0
    for row, lab in zip(x, y, strict=True):
        latest, first = {}, {}
        for t in range(0, 2 * (n + r), 2):
            key, value = int(row[t]), int(row[t + 1])
            assert 1 <= key < 32 <= value < 64
            if t < 2 * n:
                assert key not in first
                first[key] = value
            else:
                assert key in first and key not in (latest.keys() - first.keys())
            latest[key] = value
        assert len(set(latest.values()) | set(first.values())) == n + r  # all values distinct
        assert (lab[: 2 * (n + r)] == IGNORE_INDEX).all()
        queried = [int(row[t]) for t in np.flatnonzero(lab != IGNORE_INDEX)]
        assert sorted(queried) == sorted(first)
        for t in np.flatnonzero(lab != IGNORE_INDEX):
            assert (t - 2 * (n + r)) % 2 == 0
            assert lab[t] == latest[int(row[t])]
        changed += sum(latest[k] != first[k] for k in first)
    assert changed == 200 * r  # exactly r keys per example get a new value


def test_mqar_data_option_and_bad_settings():
    common = dict(vocab_size=64, seq_len=64, num_kv_pairs=6, num_train_examples=20)
    plain = MQARData(num_test_examples=5, **common)
    forget = MQARData(num_test_examples=5, num_reassignments=2, **common)
    again = MQARData(num_test_examples=5, num_reassignments=2, **common)
    assert (forget.train_inputs == again.train_inputs).all()
    assert not (forget.train_inputs == plain.train_inputs).all()
    with pytest.raises(ValueError, match="num_reassignments must be in \\[1, num_kv_pairs=6\\]"):
        MQARData(num_test_examples=5, num_reassignments=7, **common)
    with pytest.raises(ValueError, match="seq_len must be >= .* = 44 .* got 40"):
        forgetting_mqar(
            vocab_size=64, seq_len=40, num_kv_pairs=8, num_reassignments=6, num_examples=1, seed=0
        )
    with pytest.raises(ValueError, match="gives 8 values; .* = 10 distinct"):
        forgetting_mqar(
            vocab_size=16, seq_len=64, num_kv_pairs=6, num_reassignments=4, num_examples=1, seed=0
        )

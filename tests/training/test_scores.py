"""Class-macro accuracy and the per-length metrics against hand-computed cases and a NumPy
recount."""

import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.training.scores import (
    class_macro_accuracy,
    class_token_stats,
    length_metrics,
)


def test_class_token_stats_match_a_numpy_recount():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 7, 5)).astype(np.float32)
    labels = rng.integers(0, 5, size=(3, 7))
    labels[rng.random((3, 7)) < 0.4] = IGNORE_INDEX
    loss, correct, count = class_token_stats(jnp.asarray(logits), jnp.asarray(labels))
    mask = labels != IGNORE_INDEX
    pred = logits.argmax(-1)
    for c in range(5):
        assert count[c] == ((labels == c) & mask).sum()
        assert correct[c] == ((labels == c) & (pred == c)).sum()
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -sum(logp[b, t, labels[b, t]] for b, t in zip(*np.nonzero(mask), strict=True))
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_class_macro_by_hand():
    # Class 0: 9 of 10 right; class 1: 0 of 1; class 2 never labelled (left out).
    # Micro accuracy 9/11 = 0.818; macro (0.9 + 0.0) / 2 = 0.45.
    assert class_macro_accuracy([9, 0, 0], [10, 1, 0]) == pytest.approx(0.45)
    assert class_macro_accuracy([0, 0], [0, 0]) == 0.0


def test_length_metrics_by_hand():
    totals = {"length_40": (4.0, 9.0, 10.0), "length_256": (6.0, 5.0, 10.0)}
    out = length_metrics(totals, chance=0.5)
    assert out["eval/length_40/accuracy"] == 0.9 and out["eval/length_256/accuracy"] == 0.5
    assert out["eval/accuracy"] == pytest.approx(0.7)  # each length weighs the same
    assert out["eval/scaled_accuracy"] == pytest.approx(0.4)  # (0.7 - 0.5) / 0.5
    assert out["eval/loss"] == pytest.approx(0.5)  # 10 / 20 scored positions

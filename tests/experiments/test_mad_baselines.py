"""experiments/mad_baselines.py: the counting rule (the value seen most often so far) against a
hand-computed case and a plain loop over noisy-recall sequences, scored class-macro."""

import numpy as np
import pytest

from linear_attention.data.batches import IGNORE_INDEX
from linear_attention.data.mad import noisy_recall
from tests.scripts import load_module


@pytest.fixture(scope="module")
def mb():
    return load_module("experiments/mad_baselines.py", "mad_baselines")


def test_counting_rule_hand_computed(mb):
    # values 8 and 9; before t: nothing (lowest id, 8), 9 once, a tie at t = 4 (lowest id), 8 ahead
    inputs = np.array([[0, 9, 1, 8, 0, 8, 1, 9]])
    assert mb.most_frequent_value(inputs, (9, 8)).tolist() == [[8, 8, 9, 9, 8, 8, 8, 8]]
    labels = np.full((1, 8), IGNORE_INDEX)
    labels[0, [2, 4, 6]] = [8, 8, 9]  # wrong, right, wrong
    pred = mb.most_frequent_value(inputs, (8, 9))
    assert mb.macro(pred, labels, 16) == pytest.approx((0.5 + 0.0) / 2)  # class 8: 1/2, 9: 0/1


def test_counting_rule_matches_a_loop(mb):
    inputs, labels = noisy_recall(np.random.default_rng(3), 20, 16, 64)
    pred = mb.most_frequent_value(inputs, range(8, 16))
    for i in range(inputs.shape[0]):
        counts = np.zeros(32, int)  # (noise tokens are 16–31)
        for t in range(inputs.shape[1]):
            if labels[i, t] >= 0:
                assert pred[i, t] == 8 + np.argmax(counts[8:16])
            counts[inputs[i, t]] += 1

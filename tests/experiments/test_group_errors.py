"""experiments/group_errors.py: the element and sign accuracy of a group word problem, overall,
where the sign is right and by position, against a hand-computed case."""

import numpy as np
import pytest

from linear_attention.data.batches import IGNORE_INDEX
from linear_attention.data.state_tracking import group_elements, permutation_sign
from tests.scripts import load_module


@pytest.fixture(scope="module")
def ge():
    return load_module("experiments/group_errors.py", "group_errors")


def test_length_figures_sign_and_element_accuracy(ge, monkeypatch):
    signs = np.array([permutation_sign(p) for p in group_elements("s3")])
    # S3 in lexicographic order: ids 0, 3, 4 are even (identity, the two 3-cycles); 1, 2, 5 odd
    assert signs.tolist() == [1, -1, -1, 1, 1, -1]
    labels = np.array([[0, 1, 3, 5], [4, 4, 2, 2]], np.int32)
    # row 0: right, right, wrong with the right sign (4 for 3), wrong sign (0 for 5);
    # row 1: right, wrong sign (1 for 4), right, wrong with the right sign (5 for 2)
    preds = np.array([[0, 1, 4, 0], [4, 1, 2, 5]])
    logits = np.eye(6, dtype=np.float32)[preds]

    def forward(tokens_BT):  # the row ids ride in the tokens, so batches of any size work
        return logits[np.asarray(tokens_BT)[:, 0]]

    rows = np.repeat(np.arange(2, dtype=np.int32)[:, None], 4, axis=1)
    monkeypatch.setattr(ge, "BUCKETS", (0, 2, 16))
    out = ge.length_figures(forward, rows, labels, signs, batch_size=2)
    assert out["accuracy"] == 4 / 8
    assert out["sign_accuracy"] == 6 / 8
    assert out["accuracy_where_sign_right"] == 4 / 6
    assert out["by_position"] == [
        dict(positions=[0, 2], accuracy=3 / 4, sign_accuracy=3 / 4),
        dict(positions=[2, 4], accuracy=1 / 4, sign_accuracy=3 / 4),
    ]
    # A5 (every element even): no sign figures; one sequence per batch
    out = ge.length_figures(forward, rows, labels, None, batch_size=1)
    assert "sign_accuracy" not in out and out["accuracy"] == 4 / 8
    # a padded (unscored) position is refused, not counted as a wrong answer
    labels[1, 3] = IGNORE_INDEX
    with pytest.raises(ValueError, match="every position"):
        ge.length_figures(forward, rows, labels, signs, batch_size=2)

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
    # right = [T, T, F, F] and [T, F, T, F]: first errors at 2 and 1; after them row 0 has
    # [F] and row 1 [T, F]; the wrong positions followed by another are (0, 2) -> F, (1, 1) -> T
    assert out["sequence_accuracy"] == 0.0
    assert out["first_error_median"] == 1.5
    assert out["accuracy_after_first_error"] == 1 / 3
    assert out["right_after_wrong"] == 1 / 2
    # wrong at t >= 1: (0, 2) says 4, the previous label is 1; (0, 3) says 0 against 3; (1, 1)
    # says 1 against 4; (1, 3) says 5 against 2: none repeats the previous label
    assert out["wrong_is_previous_label"] == 0.0
    lag = ge.length_figures(
        lambda t: np.eye(6, dtype=np.float32)[[[0, 0, 1, 3]]],
        rows[:1],
        labels[:1],
        signs,
        batch_size=1,
    )
    # preds [0, 0, 1, 3] against [0, 1, 3, 5]: three wrong, each the previous label
    assert lag["wrong_is_previous_label"] == 1.0 and lag["accuracy"] == 1 / 4
    # the wrong answers: 4 for 3 and 5 for 2 (two 3-cycles apart, 2 swaps), 0 for 5 and 1 for 4
    # (a sign apart, 1 swap)
    distances = ge.transposition_distances(group_elements("s3"))
    out = ge.length_figures(forward, rows, labels, signs, batch_size=2, distances=distances)
    assert out["error_distances"] == {"1": 0.5, "2": 0.5}
    # A5 (every element even): no sign figures; one sequence per batch
    out = ge.length_figures(forward, rows, labels, None, batch_size=1)
    assert "sign_accuracy" not in out and out["accuracy"] == 4 / 8
    # a padded (unscored) position is refused, not counted as a wrong answer
    labels[1, 3] = IGNORE_INDEX
    with pytest.raises(ValueError, match="every position"):
        ge.length_figures(forward, rows, labels, signs, batch_size=2)


def test_error_structure_lost_state_against_misread_state(ge):
    # a lost state: wrong from t = 1 on; a misread one: wrong at t = 1 only
    lost = np.array([[True, False, False, False]])
    misread = np.array([[True, False, True, True]])
    assert ge.error_structure(lost) == dict(
        sequence_accuracy=0.0,
        first_error_median=1.0,
        accuracy_after_first_error=0.0,
        right_after_wrong=0.0,
    )
    assert ge.error_structure(misread)["accuracy_after_first_error"] == 1.0
    assert ge.error_structure(misread)["right_after_wrong"] == 1.0
    # nothing wrong: the figures that need an error are None, not 0 or NaN
    out = ge.error_structure(np.ones((3, 5), bool))
    assert out == dict(
        sequence_accuracy=1.0,
        first_error_median=None,
        accuracy_after_first_error=None,
        right_after_wrong=None,
    )
    # the only error at the last position: nothing follows it
    out = ge.error_structure(np.array([[True, True, False], [True, True, True]]))
    assert out["sequence_accuracy"] == 0.5 and out["first_error_median"] == 2.0
    assert out["accuracy_after_first_error"] is None and out["right_after_wrong"] is None


def test_transposition_distances_count_cycles(ge):
    # S3 from the identity: the three swaps are 1 away, the two 3-cycles 2
    d = ge.transposition_distances(group_elements("s3"))
    assert d[0].tolist() == [0, 1, 1, 2, 2, 1]
    # S5 from the identity by cycle type: 10 swaps; 20 3-cycles and 15 double swaps; 30
    # 4-cycles and 20 (3-cycle)(swap); 24 5-cycles
    elements = group_elements("s5")
    d = ge.transposition_distances(elements)
    identity = int(np.flatnonzero((elements == np.arange(5)).all(axis=1))[0])
    assert np.bincount(d[identity]).tolist() == [1, 10, 35, 50, 24]
    # a metric: symmetric, zero only on the diagonal, and its parity is the relative sign
    assert (d == d.T).all() and (np.diag(d) == 0).all() and (d + np.eye(120) > 0).all()
    signs = np.array([permutation_sign(p) for p in elements])
    assert ((-1) ** d == np.outer(signs, signs)).all()

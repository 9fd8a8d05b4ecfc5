"""State-tracking generators: labels recomputed the slow way (Python's own arithmetic and
permutation tuples), hand-computed cases, lengths, statistics and determinism."""

import itertools

import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.state_tracking import (
    EQUALS,
    MINUS,
    PLUS,
    TIMES,
    StateTrackingData,
    evaluate_mod_arith,
    group_elements,
    multiplication_table,
    state_tracking_examples,
    task_chance,
    task_vocab_size,
)

_OPS = {PLUS: "+", MINUS: "-", TIMES: "*"}


def test_mod_arith_hand_computed():
    # 2 + 3 * 4 − 1 = 13 ≡ 3;  4 * 4 * 4 = 64 ≡ 4;  1 − 2 * 3 = −5 ≡ 0;  3 − 4 + 2 * 2 = 3 ≡ 3
    digits = np.array([[2, 3, 4, 1], [4, 4, 4, 0], [1, 2, 3, 0], [3, 4, 2, 2]])
    ops = np.array(
        [
            [0, PLUS, TIMES, MINUS],
            [0, TIMES, TIMES, 0],
            [0, MINUS, TIMES, 0],
            [0, MINUS, PLUS, TIMES],
        ]
    )
    n = np.array([4, 3, 3, 4])  # operands used per row (the rest is padding)
    assert evaluate_mod_arith(digits, ops, n).tolist() == [3, 4, 0, 3]


def _read_expression(row):
    """Tokens up to '=' as a Python expression string (``*`` binds tighter, as in Python)."""
    out = []
    for tok in row:
        if tok == EQUALS:
            return "".join(out)
        out.append(_OPS.get(int(tok), str(int(tok))) if tok >= PLUS else str(int(tok)))
    raise AssertionError("no '=' token")


@pytest.mark.parametrize("task", ["parity", "mod_arith", "s3", "s5", "s5_swaps", "a5"])
def test_labels_match_brute_force(task):
    data = StateTrackingData(
        task=task, min_len=3, max_len=20, eval_lengths=(22,), num_eval_examples=30, seed=4
    )
    batches = [data.train_batch(0, 40), *data.eval_groups(30)["length_22"]]
    elements = group_elements(task).tolist() if task[0] in "sa" else None
    for batch in batches:
        x, y = batch["inputs"], batch["labels"]
        assert x.dtype == y.dtype == np.int32
        assert ((x >= 0) & (x < task_vocab_size(task))).all()
        for row, lab in zip(x, y, strict=True):
            scored = np.flatnonzero(lab != IGNORE_INDEX)
            if task == "parity":
                (last,) = scored  # one label, at the last position of the sequence
                assert lab[last] == sum(int(b) for b in row[: last + 1]) % 2
                assert set(row[: last + 1].tolist()) <= {0, 1}
                assert (row[last + 1 :] == 0).all()
            elif task == "mod_arith":
                (last,) = scored
                assert row[last] == EQUALS and last % 2 == 1
                expr = _read_expression(row)
                assert lab[last] == eval(expr) % 5, expr  # Python: * before + -
                assert len(expr) == last  # digits and operators alternate up to '='
            else:
                length = len(scored)
                assert (scored == np.arange(length)).all()  # every position of the sequence
                p = tuple(range(len(elements[0])))
                for t in range(length):
                    g = elements[row[t]]
                    p = tuple(p[g[i]] for i in range(len(g)))  # (p ∘ g)(i) = p(g(i))
                    assert elements[lab[t]] == list(p)


def test_groups_and_their_tables():
    sizes = {"s3": 6, "s5": 120, "s5_swaps": 120, "a5": 60}
    for task, size in sizes.items():
        elements = group_elements(task)
        assert elements.shape[0] == size == task_vocab_size(task)
        assert task_chance(task) == pytest.approx(1 / size)
    # A5: exactly the even permutations of S5.
    a5 = {tuple(p) for p in group_elements("a5").tolist()}
    s5 = group_elements("s5").tolist()
    inversions = [sum(p[i] > p[j] for i, j in itertools.combinations(range(5), 2)) for p in s5]
    assert a5 == {tuple(p) for p, inv in zip(s5, inversions, strict=True) if inv % 2 == 0}
    # S3 by hand, lexicographic ids: 1 = (0 2 1), 2 = (1 0 2); (p ∘ g)(i) = p(g(i)):
    # [0,2,1] ∘ [1,0,2] = [2,0,1] (id 4), [1,0,2] ∘ [0,2,1] = [1,2,0] (id 3).
    table = multiplication_table(group_elements("s3"))
    assert table[1, 2] == 4 and table[2, 1] == 3
    assert (table[0] == np.arange(6)).all() and (table[:, 0] == np.arange(6)).all()
    # The swaps task draws only the identity and the 10 transpositions, yet its products reach
    # every element of S5 (transpositions generate it).
    data = StateTrackingData(
        task="s5_swaps", min_len=40, max_len=40, eval_lengths=(8,), num_eval_examples=1
    )
    batch = data.train_batch(0, 64)
    inputs = {tuple(s5[i]) for i in np.unique(batch["inputs"])}
    assert len(inputs) == 11
    assert all(sum(a != b for a, b in zip(p, range(5), strict=True)) in (0, 2) for p in inputs)
    assert len(np.unique(batch["labels"])) == 120


def test_lengths_statistics_and_determinism():
    data = StateTrackingData(
        task="parity", min_len=3, max_len=40, eval_lengths=(40, 64), num_eval_examples=50, seed=1
    )
    batch = data.train_batch(5, 4000)
    assert batch["inputs"].shape == (4000, 40)
    last = (batch["labels"] != IGNORE_INDEX).argmax(axis=1)
    lengths = last + 1
    assert lengths.min() == 3 and lengths.max() == 40
    assert abs(lengths.mean() - 21.5) < 0.5  # uniform on 3..40: mean 21.5, sd 11 / sqrt(4000)
    labels = batch["labels"][np.arange(4000), last]
    assert abs(labels.mean() - 0.5) < 0.03
    again = data.train_batch(5, 4000)
    assert all((batch[k] == again[k]).all() for k in batch)
    assert not (data.train_batch(6, 4000)["inputs"] == batch["inputs"]).all()
    groups = data.eval_groups(32)
    assert list(groups) == ["length_40", "length_64"]
    shapes = [
        (b["inputs"].shape, int((b["labels"] != IGNORE_INDEX).sum())) for b in groups["length_64"]
    ]
    assert shapes == [((32, 64), 32), ((32, 64), 18)]  # 50 sequences, the last batch padded
    # mod_arith: lengths are the even ones in range, each operand count equally likely.
    data = StateTrackingData(
        task="mod_arith", min_len=3, max_len=40, eval_lengths=(40,), num_eval_examples=5
    )
    batch = data.train_batch(0, 2000)
    lengths = (batch["labels"] != IGNORE_INDEX).argmax(axis=1) + 1
    assert set(np.unique(lengths).tolist()) == set(range(4, 41, 2))
    results = batch["labels"][batch["labels"] != IGNORE_INDEX]
    assert np.bincount(results, minlength=5).min() > 2000 / 5 * 0.7


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(task="dyck"), "task must be one of"),
        (dict(min_len=0), "min_len must be >= 1"),
        (dict(min_len=30, max_len=20), "max_len must be >= min_len"),
        (dict(task="mod_arith", min_len=5, max_len=5), "holds none"),
        (dict(eval_lengths=()), "at least one length"),
        (dict(task="mod_arith", eval_lengths=(40, 63)), "lengths are even"),
        (dict(eval_lengths=(40, 40)), "distinct"),
        (dict(num_eval_examples=0), "num_eval_examples must be >= 1"),
    ],
)
def test_bad_settings_raise(kwargs, message):
    settings = dict(task="parity", min_len=3, max_len=20, eval_lengths=(40,), num_eval_examples=2)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        StateTrackingData(**settings)
    with pytest.raises(ValueError, match="lengths must be in"):
        state_tracking_examples(task="parity", lengths=[5, 9], width=8, seed=0)

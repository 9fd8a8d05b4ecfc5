"""MAD generators: every example read the slow way against the task's definition, MAD's sizes,
determinism, and settings that cannot be generated (or options of another task) raise."""

import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.mad import (
    MAD_SETTINGS,
    MADData,
    mad_examples,
    mad_num_tokens,
    memorization_map,
    noisy_layout,
)


def _recall_check(x, y, vocab_size, multi_query, noise_low=None):
    """Pairs (key < V/2, value >= V/2) with one value per key; the label at a key is its value
    exactly when the key occurred before (multi-query) / at the last pair only."""
    half = vocab_size // 2
    pairs, t = [], 0
    while t < len(x):
        if noise_low is not None and x[t] >= noise_low:
            assert y[t] == IGNORE_INDEX  # noise is never scored
            t += 1
            continue
        pairs.append((t, int(x[t]), int(x[t + 1])))
        assert y[t + 1] == IGNORE_INDEX
        t += 2
    table, seen = {}, []
    for i, (t, key, value) in enumerate(pairs):
        assert 0 <= key < half <= value < vocab_size
        assert table.setdefault(key, value) == value
        if multi_query:
            expected = value if key in seen else IGNORE_INDEX
        else:
            expected = value if i == len(pairs) - 1 else IGNORE_INDEX
        assert y[t] == expected
        seen.append(key)
    if not multi_query:
        assert pairs[-1][1] in seen[:-1]  # the query key was given before


@pytest.mark.parametrize("multi_query", [True, False])
def test_in_context_and_noisy_recall(multi_query):
    x, y = mad_examples(
        task="in_context_recall",
        vocab_size=16,
        seq_len=128,
        num_examples=40,
        seed=0,
        multi_query=multi_query,
    )
    assert x.shape == y.shape == (40, 128)
    for row, lab in zip(x, y, strict=True):
        _recall_check(row, lab, 16, multi_query)
    x, y = mad_examples(
        task="noisy_recall",
        vocab_size=16,
        seq_len=128,
        num_examples=40,
        seed=1,
        multi_query=multi_query,
        noise_fraction=0.2,
        noise_vocab_size=16,
    )
    pairs, noise = noisy_layout(128, 0.2)
    assert (pairs, noise) == (51, 26)  # 0.2 * 128 = 25.6 -> 26, leaving 51 pairs
    for row, lab in zip(x, y, strict=True):
        assert (row >= 16).sum() == 26 and row.max() < 32
        _recall_check(row, lab, 16, multi_query, noise_low=16)
    # The noise lands anywhere between pairs: position 0 is noise in about 26/77 of the rows.
    x, _ = mad_examples(task="noisy_recall", vocab_size=16, seq_len=128, num_examples=2000, seed=2)
    assert abs((x[:, 0] >= 16).mean() - 26 / 77) < 0.04


def test_fuzzy_recall():
    x, y = mad_examples(task="fuzzy_recall", vocab_size=16, seq_len=128, num_examples=30, seed=3)
    pad = 16
    for row, lab in zip(x, y, strict=True):
        # Split into (key motif, value motif) by the vocab halves; a pad tail ends the row.
        motifs, t = [], 0
        while t < len(row) and row[t] != pad:
            start = t
            while row[t] < 8:
                t += 1
            mid = t
            while t < len(row) and 8 <= row[t] < 16:
                t += 1
            motifs.append((tuple(row[start:mid]), tuple(row[mid:t]), start, mid))
        assert (row[t:] == pad).all() and (lab[t:] == IGNORE_INDEX).all()
        table, seen = {}, set()
        for key, value, start, mid in motifs:
            assert 1 <= len(key) <= 3 and 1 <= len(value) <= 3
            assert table.setdefault(key, value) == value
            expected = list(value) if key in seen else [IGNORE_INDEX] * len(value)
            assert lab[mid - 1 : mid - 1 + len(value)].tolist() == expected
            assert (lab[start : mid - 1] == IGNORE_INDEX).all()
            seen.add(key)
        keys = list(table)
        assert all(a == b or a[: len(b)] != b for a in keys for b in keys)  # prefix-free
        assert 128 - t < 6  # the next pair would not have fit


@pytest.mark.parametrize("selective", [True, False])
def test_selective_copying(selective):
    x, y = mad_examples(
        task="selective_copying",
        vocab_size=16,
        seq_len=256,
        num_examples=30,
        seed=4,
        selective=selective,
    )
    blank, copy = 16, 17
    for row, lab in zip(x, y, strict=True):
        context = row[:240]
        tokens = context[context != blank]
        assert len(tokens) == 16 and tokens.max() < 16
        positions = np.flatnonzero(context != blank)
        if not selective:
            assert (positions == np.arange(224, 240)).all()
        assert row[240] == copy and (row[241:] == tokens[:-1]).all()
        assert (lab[:240] == IGNORE_INDEX).all() and (lab[240:] == tokens).all()
    if selective:  # positions spread over the whole context
        positions = np.flatnonzero(x[:, :240].reshape(-1) != blank) % 240
        assert positions.min() < 20 and positions.max() > 220


def test_compression_and_memorization():
    x, y = mad_examples(task="compression", vocab_size=16, seq_len=32, num_examples=20, seed=5)
    assert mad_num_tokens("compression", 16, 32) == 16 + 1 + 15
    for row, lab in zip(x, y, strict=True):
        assert row[:15].max() < 16 and row[15] == 16
        assert row[16:31].tolist() == list(range(17, 32))
        assert (lab[16:31] == row[:15]).all()  # position token i asks for token i
        assert (lab[:16] == IGNORE_INDEX).all() and lab[31] == IGNORE_INDEX
    table = memorization_map(9, 256)
    assert table.shape == (128,) and table.min() >= 128
    data = MADData(
        task="memorization",
        vocab_size=256,
        seq_len=32,
        num_train_examples=50,
        num_test_examples=9,
        seed=9,
    )
    for x, y in ((data.train_inputs, data.train_labels), (data.test_inputs, data.test_labels)):
        # One map for the training and test sets: every key's label is table[key].
        assert (y[:, 0::2] == table[x[:, 0::2]]).all() and (x[:, 1::2] == table[x[:, 0::2]]).all()
        assert (y[:, 1::2] == IGNORE_INDEX).all()


def test_mad_sizes_determinism_and_batches():
    data = MADData(task="in_context_recall", vocab_size=16, seq_len=128, seed=0)
    assert data.train_inputs.shape == (12_800, 128) and data.test_inputs.shape == (1_280, 128)
    assert data.score == "class_macro" and data.vocab_size == 16
    again = MADData(task="in_context_recall", vocab_size=16, seq_len=128, seed=0)
    assert (again.train_inputs == data.train_inputs).all()
    assert not (data.train_inputs[:1280] == data.test_inputs).all()
    b0, b0_again = data.train_batch(3, 64), again.train_batch(3, 64)
    assert (b0["inputs"] == b0_again["inputs"]).all()
    rows = {r.tobytes() for r in b0["inputs"]}
    assert len(rows) == 64  # distinct examples within a batch
    batches = list(data.eval_batches(500))
    assert [b["inputs"].shape[0] for b in batches] == [500, 500, 500]
    assert (batches[-1]["labels"][280:] == IGNORE_INDEX).all()
    assert set(MAD_SETTINGS) == {
        "in_context_recall", "noisy_recall", "fuzzy_recall", "selective_copying", "compression",
        "memorization",
    }  # fmt: skip


@pytest.mark.parametrize(
    "task,kwargs,message",
    [
        ("recall", {}, "task must be one of"),
        ("in_context_recall", dict(noise_fraction=0.5), "noise_fraction=0.5 is not an option"),
        ("compression", dict(selective=False), "selective=False is not an option"),
        ("in_context_recall", dict(vocab_size=15), "vocab_size must be even"),
        ("in_context_recall", dict(seq_len=127), "seq_len must be even"),
        ("noisy_recall", dict(noise_fraction=1.0), "noise_fraction must be in"),
        ("noisy_recall", dict(seq_len=8, noise_fraction=0.7), "leaves 1 pair"),
        ("fuzzy_recall", dict(seq_len=10), "2 \\* \\(max_key_len \\+ max_value_len\\) = 12"),
        ("fuzzy_recall", dict(max_key_len=0), "max_key_len must be >= 1"),
        ("selective_copying", dict(seq_len=32), "num_tokens_to_copy = 32"),
        ("in_context_recall", dict(bogus=1), "unknown option 'bogus'"),
    ],
)
def test_bad_settings_raise(task, kwargs, message):
    settings = dict(task=task, vocab_size=16, seq_len=128, num_examples=2, seed=0)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        mad_examples(**settings)

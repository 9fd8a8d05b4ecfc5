"""experiments/bpe_vs_bytes.py: byte windows re-tokenized, scored over the bytes they cover."""

import numpy as np

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.tokenizers import ByteTokenizer
from tests.scripts import load_module


def test_window_batches_drop_cut_characters_and_count_covered_bytes():
    bvb = load_module("experiments/bpe_vs_bytes.py", "bpe_vs_bytes")
    # The second window starts inside "é" (0xC3 0xA9): its stray byte is dropped.
    windows = [b"abc", "é".encode()[1:] + b"xy", b"z"]
    batches, covered = bvb.window_batches(windows, ByteTokenizer(), width=3, batch_size=2)
    assert [b["inputs"].shape for b in batches] == [(2, 3), (1, 3)]
    np.testing.assert_array_equal(batches[0]["inputs"], [[97, 98, 0], [120, 0, 0]])
    ignore = IGNORE_INDEX
    np.testing.assert_array_equal(batches[0]["labels"], [[98, 99, ignore], [121, ignore, ignore]])
    assert (batches[1]["labels"] == ignore).all()  # one byte: nothing to predict
    assert covered == 3  # b, c, y

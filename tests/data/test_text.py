"""Byte-level text data: corpus loading, deterministic split, windows."""

import os
import sysconfig

import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX, TextData, load_corpus, split_corpus


def test_default_corpus_is_stdlib_source():
    corpus = load_corpus(None, max_bytes=200_000)
    assert corpus.dtype == np.uint8 and corpus.size == 200_000
    # The first file in sorted order of the stdlib folder, read directly.
    root = sysconfig.get_paths()["stdlib"]
    first = sorted(f for f in os.listdir(root) if f.endswith(".py"))[0]
    with open(os.path.join(root, first), "rb") as f:
        head = f.read(1000)
    assert corpus[: len(head)].tobytes() == head
    assert b"def " in corpus.tobytes()


def test_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"!")
    assert load_corpus(str(tmp_path)).tobytes() == b"hello world!"
    assert load_corpus(str(tmp_path / "b.txt")).tobytes() == b"world"
    assert load_corpus(str(tmp_path), max_bytes=8).tobytes() == b"hello wo"
    with pytest.raises(ValueError, match="'/no/such/path' is neither a file nor a folder"):
        load_corpus("/no/such/path")


def test_split_is_deterministic_blockwise():
    corpus = np.arange(1000, dtype=np.int64) % 251
    train, val = split_corpus(corpus, val_fraction=0.25, block_size=100)
    # Blocks i with floor((i+1)/4) > floor(i/4): i = 3 and 7, i.e. bytes 300-399 and 700-799.
    expected_val = np.r_[corpus[300:400], corpus[700:800]]
    np.testing.assert_array_equal(val, expected_val)
    np.testing.assert_array_equal(train, np.r_[corpus[:300], corpus[400:700], corpus[800:]])
    with pytest.raises(ValueError, match="val_fraction must be in \\(0, 1\\), got 1.5"):
        split_corpus(corpus, val_fraction=1.5)


def test_windows(tmp_path):
    text = bytes(range(256)) * 200  # every 256-byte window is distinct up to rotation
    path = tmp_path / "t.bin"
    path.write_bytes(text)
    data = TextData(seq_len=16, path=str(path), val_fraction=0.2, num_val_windows=5, seed=1)
    assert data.vocab_size == 256
    b = data.train_batch(3, 8)
    assert b["inputs"].shape == b["labels"].shape == (8, 16)
    assert b["inputs"].dtype == np.int32
    # Labels are the inputs shifted by one byte, and each window lies in the train split.
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["labels"][:, :-1])
    train = data.train.tobytes()
    for x, y in zip(b["inputs"], b["labels"], strict=True):
        window = bytes(x.astype(np.uint8)) + bytes([y[-1]])
        assert window in train
    np.testing.assert_array_equal(data.train_batch(3, 8)["inputs"], b["inputs"])
    assert (data.train_batch(4, 8)["inputs"] != b["inputs"]).any()
    # Validation: 5 evenly spaced windows of the validation split, first at 0, last at the end.
    val = data.val
    assert data.val_inputs.shape == (5, 16)
    np.testing.assert_array_equal(data.val_inputs[0], val[:16])
    np.testing.assert_array_equal(data.val_labels[-1], val[-16:])
    batches = list(data.eval_batches(4))
    assert len(batches) == 2 and (batches[1]["labels"][1:] == IGNORE_INDEX).all()
    with pytest.raises(
        ValueError, match="the train split has 16 bytes, fewer than seq_len \\+ 1 = 17"
    ):
        TextData(seq_len=16, path=str(path), val_fraction=0.2, max_bytes=20)

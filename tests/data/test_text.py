"""Byte-level text data: corpus loading, deterministic split, windows."""

import os
import sysconfig

import numpy as np
import pytest

from linear_attention.data import (
    IGNORE_INDEX,
    TextData,
    load_corpus,
    load_documents,
    split_corpus,
    split_documents,
)


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


def test_documents_are_files_or_separated_pieces(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"one\n\ntwo")
    (tmp_path / "b.txt").write_bytes(b"")  # an empty file is no document
    (tmp_path / "c.txt").write_bytes(b"three\n\n")
    corpus, starts = load_documents(str(tmp_path))
    assert corpus.tobytes() == b"one\n\ntwothree\n\n"
    np.testing.assert_array_equal(starts, [0, 8])
    # with a separator, files are not boundaries; the separator ends its document
    corpus, starts = load_documents(str(tmp_path), separator="\n\n")
    np.testing.assert_array_equal(starts, [0, 5])  # "one\n\n" | "twothree\n\n" (no empty tail)
    _, starts = load_documents(str(tmp_path), max_bytes=6, separator=b"\n")
    np.testing.assert_array_equal(starts, [0, 4, 5])  # "one\n" | "\n" | "t"


def test_split_documents_cuts_at_starts_and_block_gaps():
    # 10 bytes, blocks of 2, val_fraction 0.25: block 3 (bytes 6, 7) is validation
    train_doc, val_doc = split_documents(10, np.array([0, 3, 5]), val_fraction=0.25, block_size=2)
    # train bytes 0 1 2 | 3 4 | 5 | (6 7 cut) 8 9 ; validation bytes 6 7 (inside document 2)
    np.testing.assert_array_equal(train_doc, [0, 0, 0, 1, 1, 2, 3, 3])
    np.testing.assert_array_equal(val_doc, [0, 0])


def _packed_reference(stream_orig, window, seq_len):
    """Segment ids and labels of the window of `seq_len + 1` bytes at original byte indices
    `window` (documents of 37 bytes; a jump in the original index is a cut too)."""
    new = (window % 37 == 0) | np.r_[True, np.diff(window) != 1]
    new[0] = True
    seg = np.cumsum(new) - 1
    nxt = stream_orig[window[1:]].astype(np.int64)
    labels = np.where(seg[1:] == seg[:-1], nxt, IGNORE_INDEX)
    return seg[:-1], labels


def test_packed_rows(tmp_path):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 256, 40 * 37).astype(np.uint8)  # 17-byte windows are unique
    for i in range(40):
        (tmp_path / f"{i:02d}.bin").write_bytes(stream[37 * i : 37 * (i + 1)].tobytes())
    kwargs = dict(seq_len=16, path=str(tmp_path), val_fraction=0.2, num_val_windows=6, seed=2)
    plain, packed = TextData(**kwargs), TextData(**kwargs, pack=True)
    # the same bytes in each part and the same windows as without packing
    np.testing.assert_array_equal(packed.train, plain.train)
    np.testing.assert_array_equal(packed.val, plain.val)
    b, p = plain.train_batch(5, 8), packed.train_batch(5, 8)
    np.testing.assert_array_equal(p["inputs"], b["inputs"])
    assert p["segment_ids"].shape == (8, 16) and p["segment_ids"].dtype == np.int32
    # the block split written out: 1480 bytes, blocks of 15, block i is validation when
    # floor((i + 1) / 5) > floor(i / 5), i.e. i = 4, 9, 14, ...
    block = np.arange(stream.size) // 15
    is_val = (block % 5) == 4
    for part, rows in (
        (np.flatnonzero(~is_val), p),
        (
            np.flatnonzero(is_val),
            dict(
                inputs=packed.val_inputs,
                labels=packed.val_labels,
                segment_ids=packed.val_segment_ids,
            ),
        ),
    ):
        part_bytes = stream[part].tobytes()
        for x, y, seg in zip(rows["inputs"], rows["labels"], rows["segment_ids"], strict=True):
            start = part_bytes.find(x.astype(np.uint8).tobytes())
            assert start >= 0
            want_seg, want_labels = _packed_reference(stream, part[start : start + 17], 16)
            np.testing.assert_array_equal(seg, want_seg)
            np.testing.assert_array_equal(y, want_labels)
    assert p["segment_ids"].max() >= 1 and (p["labels"] == IGNORE_INDEX).any()  # not vacuous
    np.testing.assert_array_equal(packed.train_batch(5, 8)["segment_ids"], p["segment_ids"])
    batches = list(packed.eval_batches(4))
    assert len(batches) == 2 and set(batches[0]) == {"inputs", "labels", "segment_ids"}
    np.testing.assert_array_equal(batches[0]["segment_ids"], packed.val_segment_ids[:4])
    assert (batches[1]["segment_ids"][2:] == 0).all()
    assert (batches[1]["labels"][2:] == IGNORE_INDEX).all()
    assert "segment_ids" not in plain.train_batch(0, 2)
    with pytest.raises(ValueError, match="separator=.* needs pack=True"):
        TextData(**kwargs, separator="\n")

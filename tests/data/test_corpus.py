"""Corpora: JSONL / Parquet / files as documents, errors naming file and line, token files,
the tokenization cache."""

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from linear_attention.data import load_corpus
from linear_attention.data.configs import TokenDataConfig
from linear_attention.data.corpus import check_token_range, read_documents, read_token_file
from linear_attention.data.sources import token_file_source
from linear_attention.data.tokenized import tokenize_documents
from linear_attention.data.tokenizers import ByteTokenizer


def test_jsonl_parquet_and_folder_documents(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "héllo", "id": 1}) + "\n\n" + json.dumps({"text": "world"}) + "\n"
    )
    pq.write_table(pa.table({"text": ["pq one", "pq two"], "n": [1, 2]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("plain\nfile\n")
    docs, prov = read_documents(str(tmp_path))
    assert docs == ["héllo", "world", "pq one", "pq two", "plain\nfile\n"]
    assert (prov["files"], prov["bytes"], prov["path"]) == (3, 6 + 5 + 6 + 6 + 11, str(tmp_path))
    # The fingerprint is over every document's length and bytes, in order.
    digest = hashlib.sha256()
    for d in docs:
        digest.update(len(d.encode()).to_bytes(8, "little") + d.encode())
    assert prov["sha256"] == digest.hexdigest()
    docs, prov = read_documents(str(tmp_path), max_bytes=8)  # cut inside "world"
    assert docs == ["héllo", "wo"] and prov["bytes"] == 8
    docs, prov = read_documents(str(tmp_path / "b.parquet"), text_field="text")
    assert docs == ["pq one", "pq two"]


def test_builtin_corpus_provenance():
    docs, prov = read_documents(None, max_bytes=5000)
    assert prov["path"].startswith("builtin:") and prov["bytes"] == 5000
    assert prov["python"].count(".") == 2 and len(docs) >= 1


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "a"}\n{"text": "b"\n', "bad.jsonl, line 2: not a JSON object"),
        ('{"text": "a"}\n\n[1, 2]\n', "bad.jsonl, line 3: a JSON list, not an object"),
        ('{"body": "a"}\n', "bad.jsonl, line 1: the record has no field 'text'"),
        ('{"text": 3}\n', "bad.jsonl, line 1: field 'text' is a int, not a string"),
        (b'{"text": "a"}\n{"text": "\xff"}\n', "bad.jsonl, line 2: not UTF-8 text"),
        ("\n\n", "holds no text"),
    ],
)
def test_bad_jsonl_is_named_with_its_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message):
        read_documents(str(path))


def test_bad_files(tmp_path):
    (tmp_path / "latin.txt").write_bytes(b"ok\nstill ok\ncaf\xe9\n")
    with pytest.raises(ValueError, match="latin.txt, line 3: not UTF-8 text \\(byte 0xe9"):
        read_documents(str(tmp_path / "latin.txt"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="p.parquet: no column 'text' .*its columns: body"):
        read_documents(str(tmp_path / "p.parquet"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="broken.parquet: not a readable Parquet file"):
        read_documents(str(tmp_path / "broken.parquet"))
    with pytest.raises(ValueError, match="'/no/such' is neither a file nor a folder"):
        read_documents("/no/such")
    # An unreadable file in a folder (a dangling link) is named, for text and for bytes.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("fine")
    (tmp_path / "d" / "b.txt").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=r"b.txt: cannot be read \(No such file"):
        read_documents(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"b.txt: cannot be read \(No such file"):
        load_corpus(str(tmp_path / "d"))


def test_token_files(tmp_path):
    ids = np.array([3, 70000 % 65536, 65535, 0], np.uint16)
    ids.tofile(tmp_path / "t.bin")
    tokens = read_token_file(str(tmp_path / "t.bin"), "uint16")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, ids)
    wide = np.array([1, 100_000], np.uint32)
    wide.tofile(tmp_path / "w.bin")
    np.testing.assert_array_equal(read_token_file(str(tmp_path / "w.bin"), "uint32"), wide)
    with pytest.raises(ValueError, match="w.bin: token 100000 at index 1 is outside .*0, 50304"):
        check_token_range(read_token_file(str(tmp_path / "w.bin"), "uint32"), 50304, "w.bin")
    np.save(tmp_path / "n.npy", np.arange(5, dtype=np.int32))
    np.testing.assert_array_equal(read_token_file(str(tmp_path / "n.npy"), "uint16"), range(5))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd.bin: 3 bytes is not a whole number of uint16"):
        read_token_file(str(tmp_path / "odd.bin"), "uint16")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.bin: empty file"):
        read_token_file(str(tmp_path / "empty.bin"), "uint16")
    np.save(tmp_path / "f.npy", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="f.npy: holds float32 .* must be a 1-D integer array"):
        read_token_file(str(tmp_path / "f.npy"), "uint16")


def test_token_file_source_splits_windows(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    config = TokenDataConfig(
        kind="tokens",
        path=str(tmp_path / "t.bin"),
        token_dtype="uint16",
        tokenizer="",
        seq_len=9,
        val_fraction=0.25,
        num_val_windows=3,
    )
    data = token_file_source(config, vocab_size=1000, seed=0, batch_size=2)
    # Blocks of 10 tokens (1/100 of the file); blocks 3, 7, 11, ... go to validation
    # (floor((i + 1) / 4) > floor(i / 4)). A window [9c, 9c + 10) is validation when its first
    # and last tokens both lie in validation blocks (then in one: they are 4 blocks apart).
    inputs = data.eval_rows["inputs"]
    assert inputs.shape == (3, 9)
    for row in inputs:
        block = row[0] // 10
        assert (row[-1] + 1) // 10 == block and (block + 1) % 4 == 0
    batch = data.train_batch(0, 2)
    for row in batch["inputs"]:  # a training window never touches a validation block
        assert all((t // 10 + 1) % 4 != 0 for t in [*row, row[-1] + 1])
    np.testing.assert_array_equal(batch["labels"], batch["inputs"] + 1)
    assert data.token_bytes is None  # no tokenizer: no bits per byte


class CountingTokenizer(ByteTokenizer):
    def __init__(self, fingerprint="count"):
        super().__init__()
        self.fingerprint, self.calls = fingerprint, 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def test_tokenized_once_and_cached(tmp_path):
    docs = ["ab", "", "cde"]
    prov = {"sha256": "x", "bytes": 5}
    tok = CountingTokenizer()
    tokens, starts = tokenize_documents(docs, tok, provenance=prov, cache_dir=str(tmp_path))
    np.testing.assert_array_equal(tokens, [97, 98, 99, 100, 101])
    np.testing.assert_array_equal(starts, [0, 2])  # the empty document is dropped
    assert tokens.dtype == np.uint16 and tok.calls == 3
    again = tokenize_documents(docs, tok, provenance=prov, cache_dir=str(tmp_path))
    assert tok.calls == 3 and (again[0] == tokens).all()  # read from the cache
    # A changed corpus, another tokenizer, another separator: tokenized again.
    tokenize_documents(docs, tok, provenance={**prov, "sha256": "y"}, cache_dir=str(tmp_path))
    assert tok.calls == 6
    other = CountingTokenizer("other")
    tokenize_documents(docs, other, provenance=prov, cache_dir=str(tmp_path))
    assert other.calls == 3
    tokens, starts = tokenize_documents(
        ["a\n\nb\n\n"], tok, provenance=prov, separator="\n\n", cache_dir=str(tmp_path)
    )
    np.testing.assert_array_equal(starts, [0, 3])
    # A damaged cache file is tokenized again and rewritten.
    messages = []
    for path in tmp_path.iterdir():
        path.write_bytes(b"garbage")
    tokenize_documents(docs, tok, provenance=prov, cache_dir=str(tmp_path), message=messages.append)
    assert any("is damaged" in m for m in messages)
    calls = tok.calls
    assert tokenize_documents(docs, tok, provenance=prov, cache_dir=str(tmp_path))[0].size == 5
    assert tok.calls == calls  # the rewritten cache is read

"""Token files with a sidecar (`la-tokenizer encode`): the flat ids are the tokenizer's ids of
each document, followed by the eos id; the ``tokens`` source checks the sidecar (dtype, digest,
vocabulary, eos, tokenizer) and, without one, warns when uint32 ids are read as uint16."""

import json
import os

import numpy as np
import pytest

from linear_attention.data.configs import TokenDataConfig
from linear_attention.data.files import FULL_DIGEST_BYTES, file_digest
from linear_attention.data.sources import token_file_source
from linear_attention.training import tokenizer_cli

DOCS = ["def f(x):\n    return x\n" * 20, "print('héllo')\n" * 30]


def _source(path, *, dtype="uint16", vocab=300, eos=-1, tokenizer=""):
    config = TokenDataConfig(
        kind="tokens",
        path=str(path),
        token_dtype=dtype,
        tokenizer=tokenizer,
        seq_len=8,
        val_fraction=0.1,
        num_val_windows=4,
        eos_id=eos,
    )
    return token_file_source(config, vocab_size=vocab, seed=0, batch_size=2)


@pytest.fixture
def encoded(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(DOCS):
        (corpus / f"{i}.txt").write_text(doc)
    out = tmp_path / "train.bin"
    argv = ["encode", f"--input={corpus}", "--tokenizer=bytes", f"--output={out}", "--eos_id=256"]
    assert tokenizer_cli.main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("encoded 2 documents (")
    return out


def test_encode_writes_the_ids_and_a_sidecar(encoded):
    # by hand: each document's UTF-8 bytes, then 256
    want = np.concatenate(
        [np.r_[np.frombuffer(d.encode(), np.uint8).astype(np.int64), 256] for d in DOCS]
    )
    np.testing.assert_array_equal(np.fromfile(encoded, np.uint16), want)
    record = json.loads(open(f"{encoded}.json").read())
    assert record["dtype"] == "uint16" and record["vocab_size"] == 257
    assert record["eos_id"] == 256 and record["tokens"] == want.size and record["documents"] == 2
    assert record["tokenizer"] == "bytes" and record["tokenizer_sha256"] == "bytes"
    import hashlib

    assert record["digest"] == {
        "bytes": 2 * want.size,
        "sha256": hashlib.sha256(want.astype(np.uint16).tobytes()).hexdigest(),
    }
    data = _source(encoded, eos=256)
    assert data.provenance["digest"] == record["digest"]


def test_the_loader_checks_the_sidecar(encoded):
    for kwargs, message in (
        (dict(dtype="uint32"), "sidecar .* says the ids are uint16, but config.data.token_dtype"),
        (dict(vocab=200), "ids go up to vocab_size 257, more than config.model.vocab_size = 200"),
        (dict(eos=0), "config.data.eos_id = 0, but its sidecar says the documents end with 256"),
    ):
        with pytest.raises(ValueError, match=message):
            _source(encoded, **kwargs)
    ids = np.fromfile(encoded, np.uint16)
    ids[5] = 7  # same size, other content
    ids.tofile(encoded)
    with pytest.raises(
        ValueError, match=r"train.bin has changed since .*train.bin.json was written"
    ):
        _source(encoded, eos=256)
    ids[: ids.size // 3].tofile(encoded)  # cut to a third
    with pytest.raises(ValueError, match=r"has changed since .* \(\d+ bytes, \d+ then"):
        _source(encoded)


def test_the_loader_checks_the_tokenizer_of_the_sidecar(encoded, tmp_path):
    from linear_attention.data.tokenizers import train_bpe

    tok = tmp_path / "tok.json"
    train_bpe(DOCS, vocab_size=257, output=str(tok))
    with pytest.raises(ValueError, match=r"was encoded by the tokenizer 'bytes' .* not by"):
        _source(encoded, eos=256, tokenizer=str(tok))


@pytest.mark.parametrize(("vocab", "high"), [(300, "is 0"), (100_000, "is <= 1")])
def test_uint32_ids_read_as_uint16_are_refused(tmp_path, vocab, high):
    """A uint32 file without a sidecar read as uint16: every second uint16 is an id's high half
    (0 below 65536; 0 or 1 in a vocabulary of 100,000, where ids above 65535 pass the range
    check when read as uint16). Refused, naming the fix; read as uint32, or a uint16 file of
    the same ids, trains."""
    ids = np.random.default_rng(0).integers(1, vocab, 4000)
    wide = tmp_path / "wide.bin"
    ids.astype(np.uint32).tofile(wide)
    message = rf"{wide}: 100% of every second id {high} in the first 8,000 ids: these are uint32"
    with pytest.raises(ValueError, match=message + r".*token_dtype='uint32'"):
        _source(wide, vocab=vocab)
    data = _source(wide, dtype="uint32", vocab=vocab)  # read right
    assert data.provenance["tokens"] == ids.size
    narrow = tmp_path / "narrow.bin"
    (ids % 65536).astype(np.uint16).tofile(narrow)
    assert _source(narrow, vocab=vocab).provenance["tokens"] == ids.size


def test_file_digest_samples_large_files(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(0).integers(0, 255, 1 << 18, dtype=np.uint8)
    data.tofile(path)
    assert set(file_digest(str(path))) == {"bytes", "sha256"}
    monkeypatch.setattr("linear_attention.data.files.FULL_DIGEST_BYTES", 1 << 10)
    sampled = file_digest(str(path))
    assert set(sampled) == {"bytes", "sampled_sha256"} and sampled["bytes"] == 1 << 18
    data[0] ^= 1  # the first byte is in the first sample
    data.tofile(path)
    assert file_digest(str(path)) != sampled
    assert FULL_DIGEST_BYTES == 1 << 30 and os.path.getsize(path) == 1 << 18

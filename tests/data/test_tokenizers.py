"""Tokenizers: bytes, a trained byte-level BPE, sentencepiece; bits per byte; la-tokenizer."""

import json
import math

import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.tokenizers import (
    ByteTokenizer,
    bits_per_byte,
    label_bytes,
    load_tokenizer,
    train_bpe,
)
from linear_attention.training import tokenizer_cli

TEXT = "def añadir(x):\n    return x + 1  # ünïcödé, 日本語\n" * 20


def test_bits_per_byte_hand_computed():
    # Targets 7, 3, 5 (one ignored) covering 4 + 1 + 2 bytes; cross-entropies 1.2, 0.3, 2.5 nats.
    token_bytes = np.zeros(8, np.int64)
    token_bytes[[7, 3, 5]] = [4, 1, 2]
    labels = np.array([[7, 3, IGNORE_INDEX], [5, IGNORE_INDEX, IGNORE_INDEX]])
    assert label_bytes(labels, token_bytes) == 7
    loss_sum = 1.2 + 0.3 + 2.5
    # 4.0 nats over 7 bytes: 4.0 / (7 · 0.693147) = 0.824397... bits per byte.
    assert bits_per_byte(loss_sum, 3, 7) == pytest.approx(0.824397166, rel=1e-9)
    # Bytes as tokens: exactly the mean loss over ln 2 (today's figures unchanged).
    assert bits_per_byte(3.0, 2, 2) == 1.5 / math.log(2)
    assert math.isnan(bits_per_byte(1.0, 1, 0))


def test_bytes_tokenizer():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    ids = tok.encode("é!")
    np.testing.assert_array_equal(ids, [0xC3, 0xA9, 0x21])
    assert tok.decode(ids) == "é!" and (tok.token_bytes == 1).all()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return train_bpe([TEXT, "hello world " * 30], vocab_size=300, output=path)


def test_bpe_round_trip_and_exact_token_bytes(bpe):
    assert load_tokenizer(bpe.name).fingerprint == bpe.fingerprint
    assert 256 < bpe.vocab_size <= 300
    ids = bpe.encode(TEXT)
    assert ids.size < len(TEXT.encode()) / 2  # merges learned: fewer tokens than bytes
    assert bpe.decode(ids) == TEXT
    # Byte-level BPE: the bytes of the tokens are exactly the bytes of the text, also for
    # tokens that hold part of a multi-byte character.
    for text in (TEXT, "日本", "ü", "zz\t\n"):
        assert bpe.token_bytes[bpe.encode(text)].sum() == len(text.encode())
    assert bpe.token_bytes[:256].min() == 1


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece

    (tmp_path / "corpus.txt").write_text(TEXT + "the cat sat on the mat\n" * 50)
    prefix = str(tmp_path / "sp")
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=prefix,
        vocab_size=320,
        byte_fallback=True,
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    tok = load_tokenizer(prefix + ".model")
    sp = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")
    assert 256 < tok.vocab_size == sp.GetPieceSize() <= 320
    ids = tok.encode("the cat sat")
    assert tok.decode(ids) == "the cat sat"
    # "▁mat" is a space and three letters, "日" three UTF-8 bytes; control tokens (<s>) cover
    # nothing; byte pieces <0xNN> one byte.
    expected = {"\u2581mat": 4, "\u65e5": 3, "at": 2, "<s>": 0, "<0x41>": 1}
    for piece, size in expected.items():
        i = sp.PieceToId(piece)
        assert i != sp.unk_id() and tok.token_bytes[i] == size, piece


def test_bad_tokenizer_specs(tmp_path):
    with pytest.raises(ValueError, match="must be 'bytes', a tokenizer.json .* got 'gpt2'"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="is not a file \\(tokenizers are never downloaded\\)"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json' is not a valid tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"vocab_size must be in \[256, "):
        train_bpe(["x"], vocab_size=100, output=str(tmp_path / "t.json"))


def test_la_tokenizer_train_on_jsonl_and_folder(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"body": TEXT[i:]}) for i in range(0, 200, 7)))
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "tok.json"
    argv = ["train", f"--input={corpus}", "--vocab_size=280", f"--output={out}", "--overwrite"]
    assert tokenizer_cli.main([*argv, "--text_field=body"]) == 0
    assert "trained a byte-level BPE of 280 tokens on 29 documents" in capsys.readouterr().out
    assert load_tokenizer(str(out)).vocab_size == 280
    # A folder of text files; the default field name fails on the JSONL, naming file and line.
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.txt").write_text(TEXT)
    assert tokenizer_cli.main(["train", f"--input={tmp_path / 'f'}", "--vocab_size=270",
                               f"--output={out}", "--overwrite"]) == 0  # fmt: skip
    capsys.readouterr()
    assert tokenizer_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("la-tokenizer: error: ") and "c.jsonl, line 1: the record has no " in err
    assert tokenizer_cli.main(["train", "--input=x"]) == 2
    assert "required: --vocab_size, --output" in capsys.readouterr().err

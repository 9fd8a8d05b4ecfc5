"""Token files and document boundaries (`config.data.eos_id`): documents end with the id and
keep it, packed rows restart their segment ids after it, and the documents and validation
windows are exactly those of the text path (`TextData`, which materialises the split) over the
same tokens; without the id the file is one stream, as before."""

import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.configs import TokenDataConfig
from linear_attention.data.pipeline import document_spans, eos_spans, window_spans
from linear_attention.data.sources import token_file_source
from linear_attention.data.text import TextData
from linear_attention.training import build_data, experiment_config
from tests.training.conftest import load_config

EOS, SEQ, VOCAB = 0, 8, 32


def test_eos_spans_by_hand():
    tokens = np.array([5, 1, 2, 0, 3, 0, 0, 4])
    np.testing.assert_array_equal(eos_spans(tokens, 0), [[0, 4], [4, 6], [6, 7], [7, 8]])
    np.testing.assert_array_equal(eos_spans(tokens[:7], 0, block=3), [[0, 4], [4, 6], [6, 7]])
    assert eos_spans(tokens, 9).shape == (0, 2)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    """2,000 tokens: documents of 1..40 tokens from [1, VOCAB), each ended by EOS."""
    rng = np.random.default_rng(0)
    docs, size = [], 0
    while size < 2000:
        doc = np.append(rng.integers(1, VOCAB, rng.integers(0, 40)), EOS)
        docs.append(doc)
        size += doc.size
    tokens = np.concatenate(docs)[:2000].astype(np.uint16)
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    tokens.tofile(path)
    return str(path), tokens


def _source(path, eos_id):
    config = TokenDataConfig(
        kind="tokens",
        path=path,
        token_dtype="uint16",
        tokenizer="",
        seq_len=SEQ,
        val_fraction=0.1,
        num_val_windows=12,
        eos_id=eos_id,
    )
    return token_file_source(config, vocab_size=VOCAB, seed=0, batch_size=4)


def test_documents_and_validation_windows_equal_the_text_path(token_file):
    path, tokens = token_file
    data = _source(path, EOS)
    starts = np.flatnonzero(np.r_[True, tokens[:-1] == EOS])  # a document follows each EOS
    text = TextData(
        tokens=tokens,
        starts=starts,
        seq_len=SEQ,
        val_fraction=0.1,
        num_val_windows=12,
        pack=True,
        vocab_size=VOCAB,
    )
    for key in ("inputs", "labels", "segment_ids"):
        np.testing.assert_array_equal(data.eval_rows[key], getattr(text, f"val_{key}"), key)
    # the training documents: the text path's, in file order, those of two tokens or more
    want = [text.train[b:e] for b, e in document_spans(text.train_documents)]
    got = [tokens[b:e] for b, e in data.pipeline.spans]
    assert len(got) == len(want) > 40
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert data.provenance["eos_id"] == EOS and data.provenance["documents"] == starts.size


def test_packed_rows_restart_segments_at_each_document(token_file):
    """Training rows (documents packed by Grain): each segment is a stretch of one training
    document, ``inputs`` then the last label, and a document's EOS is a target, never an
    input. Validation windows (the text path's): a new segment begins right after every input
    EOS, and the label that would cross into the next document is ignored."""
    path, tokens = token_file
    data = _source(path, EOS)
    documents = [tokens[b:e].tolist() for b, e in data.pipeline.spans]
    ends = 0
    for step in range(16):  # 512 tokens: about 25 documents
        batch = data.train_batch(step, 4)
        for x, y, seg in zip(batch["inputs"], batch["labels"], batch["segment_ids"], strict=True):
            assert seg[0] == 0 and (np.diff(seg) >= 0).all() and (x != EOS).all()
            for k in np.unique(seg):
                piece = np.append(x[seg == k], y[seg == k][-1]).tolist()
                np.testing.assert_array_equal(y[seg == k][:-1], x[seg == k][1:])
                assert any(_holds(doc, piece) for doc in documents), piece
                ends += piece[-1] == EOS
    assert ends > 10
    rows = data.eval_rows
    for x, y, seg in zip(rows["inputs"], rows["labels"], rows["segment_ids"], strict=True):
        new = np.flatnonzero(np.diff(seg)) + 1
        after_eos = np.flatnonzero(x[:-1] == EOS) + 1
        assert set(after_eos) <= set(new)
        same = seg[1:] == seg[:-1]
        np.testing.assert_array_equal(y[:-1][same], x[1:][same])
        assert (y[:-1][~same] == IGNORE_INDEX).all()
        ends += after_eos.size
    assert (rows["labels"] == EOS).any()


def _holds(document: list, piece: list) -> bool:
    """Whether ``piece`` is a contiguous stretch of ``document``."""
    n = len(piece)
    return any(document[i : i + n] == piece for i in range(len(document) - n + 1))


def test_without_eos_the_file_is_one_stream(token_file):
    path, tokens = token_file
    data = _source(path, -1)
    assert "segment_ids" not in data.eval_rows and "eos_id" not in data.provenance
    spans = data.pipeline.spans
    assert (spans[:, 1] - spans[:, 0] == SEQ + 1).all()
    assert set(map(tuple, spans)) <= set(map(tuple, window_spans(tokens.size, SEQ)))
    batch = data.train_batch(0, 4)
    assert (batch["segment_ids"] == 0).all()  # one window per row: no boundary inside


def test_eos_id_through_the_config_and_its_errors(token_file, tmp_path):
    path, tokens = token_file
    config = load_config("lm_tokens", "smoke")
    config.data.path, config.model.vocab_size = path, VOCAB
    config.data.seq_len, config.data.eos_id = SEQ, EOS
    data = build_data(experiment_config(config))
    assert data.provenance["eos_id"] == EOS and "segment_ids" in data.eval_rows
    for value, message in ((VOCAB, r"eos_id = 32 is outside the vocabulary \[0, 32\)"),
                           (-2, r"eos_id must be an integer >= -1, got -2")):  # fmt: skip
        config.data.eos_id = value
        with pytest.raises(ValueError, match=message):
            experiment_config(config)
    (tmp_path / "none.bin").write_bytes(np.ones(100, np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"none\.bin: config\.data\.eos_id = 0 occurs nowhere"):
        _source(str(tmp_path / "none.bin"), EOS)

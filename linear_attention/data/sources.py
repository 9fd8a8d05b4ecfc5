"""Language-modelling sources built from a corpus, a tokenizer and a loader.

`text_source` (``config.data.kind = "text"``) and `token_file_source` (``kind = "tokens"``)
return an object with the source interface (``vocab_size``, ``seq_len``,
``train_batch(step, batch_size)``, ``eval_batches(batch_size)``) plus ``token_bytes`` (the
bytes each token covers, for bits per byte), ``tokenizer`` (or None) and ``provenance`` (what
the corpus is, for ``summary.json``). Two loaders:

- ``"windows"`` (`text.TextData`): random windows of the training token stream keyed by the
  step; the byte-level default, whose figures stay as they were.
- ``"grain"`` (`GrainData`): the Grain pipeline of `pipeline` over the training documents
  (shuffled by epoch, sharded by process, packed, batched); its iterator state goes into every
  checkpoint (``iterator_state`` / ``restore_iterator``). Batches are this process's rows
  (``process_local``).

Bytes of plain files (and the built-in corpus) are read as they are (no decoding, so any file
works, exactly as before); JSONL / Parquet records, and any text for a tokenizer other than
bytes, go through `corpus.read_documents` (UTF-8) and `tokenized.tokenize_documents` (cached).
Evaluation windows are the same in both loaders: evenly spaced windows of the validation split.
"""

from __future__ import annotations

import os

import numpy as np

from linear_attention.data.batches import padded_batches
from linear_attention.data.configs import TextDataConfig, TokenDataConfig
from linear_attention.data.corpus import check_token_range, read_documents, read_token_file
from linear_attention.data.files import file_digest
from linear_attention.data.pipeline import GrainPipeline, document_spans, eos_spans, window_spans
from linear_attention.data.protocol import DataSource
from linear_attention.data.text import TextData, validation_blocks, window_rows
from linear_attention.data.token_files import check_token_file
from linear_attention.data.tokenized import tokenize_documents
from linear_attention.data.tokenizers import BYTES, load_tokenizer

_RECORD_SUFFIXES = (".jsonl", ".parquet")


def _holds_records(path: str) -> bool:
    """Whether ``path`` is, or a folder holding, JSONL or Parquet files."""
    if not path:
        return False
    if os.path.isfile(path):
        return path.endswith(_RECORD_SUFFIXES)
    for _, _, names in os.walk(path):
        if any(name.endswith(_RECORD_SUFFIXES) for name in names):
            return True
    return False


class GrainData(DataSource):
    """Training batches from the Grain pipeline over ``spans`` of ``stream``; evaluation on the
    fixed windows ``eval_rows`` (``inputs``, ``labels`` and, when packed, ``segment_ids``)."""

    process_local = True
    stateful = True

    def __init__(
        self,
        stream,
        spans,
        eval_rows: dict,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        vocab_size: int,
        token_bytes: np.ndarray | None,
        tokenizer,
        provenance: dict,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.token_bytes, self.tokenizer, self.provenance = token_bytes, tokenizer, provenance
        self.eval_rows = eval_rows
        # the names of `TextData`'s validation windows, for scripts that read them
        self.val_inputs, self.val_labels = eval_rows["inputs"], eval_rows["labels"]
        self.val_segment_ids = eval_rows.get("segment_ids")
        self.pipeline = GrainPipeline(
            stream,
            spans,
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
        )

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        if batch_size != self.pipeline.batch_size:
            raise ValueError(
                f"the pipeline was built for batch_size {self.pipeline.batch_size}, "
                f"got {batch_size}"
            )
        return self.pipeline.next_batch(step)

    def iterator_state(self) -> dict:
        return self.pipeline.state()

    def restore_iterator(self, state: dict) -> None:
        self.pipeline.restore(state)

    def eval_batches(self, batch_size: int):
        rows = self.eval_rows
        yield from padded_batches(
            rows["inputs"], rows["labels"], batch_size, segment_ids=rows.get("segment_ids")
        )


def text_source(
    config: TextDataConfig,
    *,
    seed: int,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    cache_dir: str | None = None,
    message=None,
    progress=None,
):
    """The source of ``config.data.kind = "text"`` (see the module docstring) for a run of
    ``seed`` and ``batch_size`` rows in this process (``process_index`` of ``process_count``);
    ``progress(done, total)`` follows the tokenization of a corpus that is not in the cache (in
    characters)."""
    tok = load_tokenizer(config.tokenizer)
    text = _read_text(config, tok, seed, cache_dir, message, progress)
    text.tokenizer = tok
    text.provenance = {
        **text.provenance,
        "tokenizer": tok.name,
        "tokenizer_sha256": tok.fingerprint,
        "vocab_size": tok.vocab_size,
    }
    if config.loader == "windows":
        return text
    rows = {"inputs": text.val_inputs, "labels": text.val_labels}
    if text.val_segment_ids is not None:
        rows["segment_ids"] = text.val_segment_ids
    return GrainData(
        text.train,
        document_spans(text.train_documents),
        rows,
        seq_len=config.seq_len,
        batch_size=batch_size,
        seed=seed,
        vocab_size=text.vocab_size,
        token_bytes=text.token_bytes,
        tokenizer=tok,
        provenance=text.provenance,
        process_index=process_index,
        process_count=process_count,
    )


def _read_text(config: TextDataConfig, tok, seed, cache_dir, message, progress) -> TextData:
    """The corpus of ``config`` as `TextData`: plain bytes read as they are, or documents
    tokenized by ``tok`` (cached in ``cache_dir``)."""
    path, max_bytes = config.path, config.max_bytes or None
    common = dict(
        seq_len=config.seq_len,
        val_fraction=config.val_fraction,
        num_val_windows=config.num_val_windows,
        seed=seed,
        pack=config.pack,
    )
    separator = config.separator_bytes
    if config.tokenizer == BYTES and not _holds_records(path):
        return TextData(path=path or None, max_bytes=max_bytes, separator=separator, **common)
    docs, provenance = read_documents(
        path or None, text_field=config.text_field, max_bytes=max_bytes
    )
    tokens, starts = tokenize_documents(
        docs,
        tok,
        provenance=provenance,
        separator=separator.decode(),
        cache_dir=cache_dir,
        message=message,
        progress=progress,
    )
    return TextData(
        tokens=tokens,
        starts=starts,
        vocab_size=tok.vocab_size,
        token_bytes=tok.token_bytes,
        provenance=provenance,
        **common,
    )


def token_file_source(
    config: TokenDataConfig,
    *,
    vocab_size: int,
    seed: int,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
):
    """The source of ``config.data.kind = "tokens"``, trained through the Grain pipeline. Every
    token is checked against ``vocab_size`` (the first one outside is named with its index).
    With a ``tokenizer`` (the one that made the file) bits per byte are reported too.

    Without ``eos_id`` (-1) the file is one stream with no document boundary: the training
    documents are windows of ``seq_len + 1`` tokens, split by blocks as text is (a window
    belongs to validation when its first and last tokens lie in validation blocks, to training
    when both lie in training blocks; one straddling the two is left out). With ``eos_id``
    the documents are the file's own, each ending with its ``eos_id`` token (`eos_spans`):
    packed rows restart their segment ids, and so the model's states, at every document
    (`_eos_documents`).

    A sidecar ``<path>.json`` (written by ``la-tokenizer encode``) is checked first
    (`token_files.check_token_file`); without one, ids that look like uint32 read as uint16 are
    refused. The provenance holds the file's ``digest`` (`files.file_digest`)
    and the tokenizer's SHA-256, which a resumed run compares."""
    path, tokenizer, eos_id = config.path, config.tokenizer, config.eos_id
    tokens = read_token_file(path, config.token_dtype)
    tok = load_tokenizer(tokenizer) if tokenizer else None
    sidecar = check_token_file(
        path,
        tokens,
        token_dtype=config.token_dtype,
        vocab_size=vocab_size,
        eos_id=eos_id,
        tokenizer=tok,
    )
    check_token_range(tokens, vocab_size, path)
    if tok is not None and tok.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer!r} has {tok.vocab_size} tokens, more than "
            f"config.model.vocab_size = {vocab_size}"
        )
    if eos_id >= 0:
        train, rows, documents = _eos_documents(tokens, config)
    else:
        train, rows, documents = _windows(tokens, config)
    token_bytes = None if tok is None else np.pad(tok.token_bytes, (0, vocab_size - tok.vocab_size))
    provenance = _token_file_provenance(config, tokens, tok, sidecar, documents)
    return GrainData(
        tokens,
        train,
        rows,
        seq_len=config.seq_len,
        batch_size=batch_size,
        seed=seed,
        vocab_size=vocab_size,
        token_bytes=token_bytes,
        tokenizer=tok,
        provenance=provenance,
        process_index=process_index,
        process_count=process_count,
    )


def _token_file_provenance(config: TokenDataConfig, tokens, tok, sidecar, documents) -> dict:
    """What the token file is: its path, size, digest (the sidecar's, or `files.file_digest`),
    token count and dtype, and the tokenizer's name, SHA-256 and vocabulary."""
    path = config.path
    provenance = {
        "path": os.path.abspath(path),
        "files": 1,
        "bytes": os.path.getsize(path),
        "mtime_ns": os.stat(path).st_mtime_ns,
        "digest": sidecar["digest"] if sidecar else file_digest(path),
        "tokens": int(tokens.size),
        "token_dtype": str(tokens.dtype),
        "tokenizer": config.tokenizer,
    }
    if tok is not None:
        provenance.update(tokenizer_sha256=tok.fingerprint, vocab_size=tok.vocab_size)
    if config.eos_id >= 0:
        provenance.update(eos_id=config.eos_id, documents=documents)
    return provenance


def _no_split(path: str, size: int, name: str, seq_len: int) -> ValueError:
    return ValueError(
        f"{path}: {size} tokens leave no {name} window of seq_len + 1 = {seq_len + 1} tokens; "
        "give a larger file or another val_fraction"
    )


def _windows(tokens, config: TokenDataConfig):
    """``(train spans, validation rows, None)`` of a file read as one stream (see
    `token_file_source`)."""
    path, seq_len, val_fraction = config.path, config.seq_len, config.val_fraction
    block, is_val = validation_blocks(tokens.size, val_fraction)
    count = max(0, (tokens.size - 1) // seq_len)
    first = np.arange(count, dtype=np.int64) * seq_len
    first_val, last_val = is_val[first // block], is_val[(first + seq_len) // block]
    train = window_spans(tokens.size, seq_len, ~first_val & ~last_val)
    val = window_spans(tokens.size, seq_len, first_val & last_val)
    for name, spans in (("train", train), ("validation", val)):
        if len(spans) == 0:
            raise _no_split(path, tokens.size, name, seq_len)
    pick = np.unique(np.linspace(0, len(val) - 1, config.num_val_windows).round().astype(np.int64))
    windows = np.stack([np.asarray(tokens[b:e], np.int32) for b, e in val[pick]])
    return train, {"inputs": windows[:, :-1], "labels": windows[:, 1:]}, None


def _eos_documents(tokens, config: TokenDataConfig):
    """``(train spans, validation rows, number of documents)`` of a file whose documents end
    with ``eos_id``, split as text is (`text.split_documents`): the blocks of
    `text.validation_blocks`, a document cut where the blocks change sides becoming two. The
    training documents of two tokens or more go to the pipeline; the validation pieces, in
    order, form the validation stream, read in ``num_val_windows`` evenly spaced windows with
    their segment ids (`text.window_rows`; a label whose input lies in the previous document
    is ignored). Only the spans and those windows are held in memory, never the stream."""
    path, eos_id, seq_len = config.path, config.eos_id, config.seq_len
    docs = eos_spans(tokens, eos_id)
    if len(docs) == 0:
        raise ValueError(
            f"{path}: config.data.eos_id = {eos_id} occurs nowhere in its {tokens.size} tokens, "
            "so there is no document boundary; is it the right id? (-1 reads the file as one "
            "stream)"
        )
    block, is_val = validation_blocks(tokens.size, config.val_fraction)
    sides = (np.flatnonzero(is_val[1:] != is_val[:-1]) + 1) * block  # where a side begins
    begins = np.union1d(docs[:, 0], sides).astype(np.int64)
    ends = np.append(begins[1:], tokens.size)
    in_val = is_val[begins // block]
    train = np.stack([begins, ends], axis=1)[~in_val & (ends - begins >= 2)]
    val = np.stack([begins, ends], axis=1)[in_val]
    offsets = np.concatenate([[0], np.cumsum(val[:, 1] - val[:, 0])])  # in the val stream
    if len(train) == 0:
        raise ValueError(
            f"{path}: its {tokens.size} tokens leave no training document of two tokens or "
            "more; give a larger file or another val_fraction"
        )
    if offsets[-1] < seq_len + 1:
        raise _no_split(path, tokens.size, "validation", seq_len)
    last = offsets[-1] - (seq_len + 1)
    starts = np.unique(np.linspace(0, last, config.num_val_windows).round().astype(np.int64))
    position = (starts[:, None] + np.arange(seq_len + 1)).ravel()
    piece = np.searchsorted(offsets, position, side="right") - 1
    stream = np.asarray(tokens[val[piece, 0] + position - offsets[piece]])
    rows = window_rows(stream, piece, np.arange(starts.size) * (seq_len + 1), seq_len)
    return train, rows, len(docs)

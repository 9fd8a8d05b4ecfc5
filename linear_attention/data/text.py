"""Text: a corpus of bytes (vocabulary 256), or of tokens, split into train and validation.

The default corpus is the source of the running Python's standard library (``*.py`` files
under ``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded, in sorted path order),
read until ``max_bytes``: present on every machine, no download. A file or a folder (all its
files, sorted) can be given instead. The split is deterministic: the byte stream is cut into
blocks (64 KiB, or 1/100 of a smaller corpus) and block ``i`` goes to validation when
``floor((i + 1) f)`` exceeds ``floor(i f)`` (``f = val_fraction``), which spreads validation
over the whole corpus.

Packing (``pack=True``): the corpus is a sequence of documents, each file (or, with a
``separator``, each piece of the byte stream ending with that separator, which stays at the end
of the document it closes). The split is the same block split, so train and validation hold the
same bytes with or without packing; a block cut inside a document makes its two sides separate
documents. Rows are the same windows as without packing, with ``segment_ids[B, T]`` (the
document of each input byte, numbered from 0 in each row) and the labels that cross a document
boundary (input in one document, target the first byte of the next) set to ``IGNORE_INDEX``:
no position is asked to predict a document it cannot see.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sysconfig

import numpy as np

from linear_attention.data.batches import IGNORE_INDEX, padded_batches
from linear_attention.data.protocol import DataSource

VOCAB_SIZE = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def sorted_files(root: str, suffix: str | None):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if suffix is None or name.endswith(suffix):
                yield os.path.join(dirpath, name)


def load_corpus(path: str | None = None, *, max_bytes: int | None = None) -> np.ndarray:
    """Bytes of ``path`` (a file, or every file of a folder in sorted order; ``None`` or
    ``""``: the standard library's ``*.py`` files) as ``uint8[n]``, at most ``max_bytes``."""
    return load_documents(path, max_bytes=max_bytes)[0]


def load_documents(
    path: str | None = None, *, max_bytes: int | None = None, separator: bytes | str = b""
) -> tuple[np.ndarray, np.ndarray]:
    """``(corpus uint8[n], starts int64[D])``: the bytes of `load_corpus` and the offset of
    every document's first byte (``starts[0] = 0``, increasing). A document is a file, or with
    a non-empty ``separator`` a piece of the stream that ends with the separator (or the stream's
    end), the separator included."""
    stream, starts, _ = _read_stream(path, max_bytes)
    return _documents(stream, starts, separator)


def _documents(stream: bytes, file_starts: list[int], separator: bytes | str):
    if isinstance(separator, str):
        separator = separator.encode()
    starts = file_starts
    if separator:
        # every byte after a separator starts a document (files are not boundaries then)
        after = [m.end() for m in re.finditer(re.escape(separator), stream)]
        starts = [0] + [i for i in after if i < len(stream)]
    return np.frombuffer(stream, dtype=np.uint8), np.asarray(starts, np.int64)


def _read_stream(path: str | None, max_bytes: int | None) -> tuple[bytes, list[int], int]:
    """``(bytes, offset of each file's first byte, number of files read)`` of the corpus."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    if not path:
        files = sorted_files(sysconfig.get_paths()["stdlib"], ".py")
    elif os.path.isfile(path):
        files = iter([path])
    elif os.path.isdir(path):
        files = sorted_files(path, None)
    else:
        raise ValueError(f"text path {path!r} is neither a file nor a folder")
    chunks, starts, total, count = [], [], 0, 0
    for name in files:
        try:
            with open(name, "rb") as f:
                data = f.read() if max_bytes is None else f.read(max_bytes - total)
        except OSError as e:
            raise ValueError(f"{name}: cannot be read ({e.strerror or e})") from None
        count += 1
        if data:
            chunks.append(data)
            starts.append(total)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    stream = b"".join(chunks)
    if not stream:
        raise ValueError(f"text path {path!r} holds no bytes")
    return stream, starts, count


def provenance_record(path: str | None, files: int, size: int, sha256: str) -> dict:
    """What a corpus is, for ``summary.json``: ``path`` (``builtin:<stdlib folder>`` for the
    built-in corpus), the ``files`` and ``bytes`` read, their ``sha256``, and the ``python``
    version (the built-in corpus is that version's standard library, so figures on it depend on
    the version)."""
    return {
        "path": path or f"builtin:{sysconfig.get_paths()['stdlib']}",
        "files": files,
        "bytes": size,
        "sha256": sha256,
        "python": platform.python_version(),
    }


def validation_blocks(
    size: int, val_fraction: float, block_size: int | None = None
) -> tuple[int, np.ndarray]:
    """``(block_size, is_val bool[num_blocks])``: the blocks of a stream of ``size`` tokens and
    which of them go to validation (see the module docstring)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if block_size is None:
        block_size = min(1 << 16, max(1, -(-size // 100)))
    num_blocks = -(-size // block_size)
    i = np.arange(num_blocks)
    return block_size, np.floor((i + 1) * val_fraction) > np.floor(i * val_fraction)


def _validation_mask(size: int, val_fraction: float, block_size: int | None) -> np.ndarray:
    """bool[size]: which bytes of the stream go to validation (see the module docstring)."""
    block_size, is_val = validation_blocks(size, val_fraction, block_size)
    return is_val[np.arange(size) // block_size]


def split_corpus(
    corpus: np.ndarray, *, val_fraction: float, block_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic ``(train, validation)`` split by blocks (see the module docstring)."""
    val_mask = _validation_mask(corpus.size, val_fraction, block_size)
    return corpus[~val_mask], corpus[val_mask]


def split_documents(
    size: int, starts: np.ndarray, *, val_fraction: float, block_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(train, validation)`` document ids (int64, one per byte, 0, 1, … in stream order) of
    the bytes `split_corpus` puts in each part: a new document begins at every document start
    and wherever the part skips bytes of the stream (a block cut)."""
    val_mask = _validation_mask(size, val_fraction, block_size)
    first = np.zeros(size, bool)
    first[np.asarray(starts, np.int64)] = True
    parts = []
    for mask in (~val_mask, val_mask):
        index = np.flatnonzero(mask)
        new = first[index]
        new[1:] |= np.diff(index) != 1
        if index.size:
            new[0] = True
        parts.append(np.cumsum(new) - 1)
    return parts[0], parts[1]


def window_rows(stream, segments, starts, seq_len):
    """Windows of ``seq_len + 1`` bytes at ``starts``: inputs, labels (and segment ids, the
    labels crossing a document boundary ignored, when ``segments`` is given)."""
    index = starts[:, None] + np.arange(seq_len + 1)
    windows = stream[index].astype(np.int32)
    batch = {"inputs": windows[:, :-1], "labels": windows[:, 1:]}
    if segments is not None:
        seg = segments[index]
        seg = (seg - seg[:, :1]).astype(np.int32)  # numbered from 0 in each row
        batch["labels"] = np.where(seg[:, 1:] == seg[:, :-1], batch["labels"], IGNORE_INDEX)
        batch["segment_ids"] = seg[:, :-1]
    return batch


class TextData(DataSource):
    """Language-modelling data: random training windows keyed by step, fixed evenly spaced
    validation windows. A window of ``seq_len + 1`` tokens ``w`` gives ``inputs = w[:-1]`` and
    ``labels = w[1:]``; with ``pack=True`` also ``segment_ids`` (the documents of the inputs;
    see the module docstring).

    The tokens are the bytes of ``path`` (vocabulary 256), or, given ``tokens`` (a token
    stream) and ``starts`` (each document's first token), those: text already tokenized
    (``vocab_size`` and ``token_bytes``, the bytes each token covers, come with it; see
    `tokenizers`). ``provenance`` says what the corpus is (for ``summary.json``)."""

    def __init__(
        self,
        *,
        seq_len: int,
        path: str | None = None,
        max_bytes: int | None = 8_000_000,
        val_fraction: float = 0.05,
        num_val_windows: int = 256,
        seed: int = 0,
        pack: bool = False,
        separator: bytes | str = b"",
        tokens: np.ndarray | None = None,
        starts: np.ndarray | None = None,
        vocab_size: int = VOCAB_SIZE,
        token_bytes: np.ndarray | None = None,
        provenance: dict | None = None,
    ):
        if separator and not pack:
            raise ValueError(f"separator={separator!r} needs pack=True (it delimits documents)")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if num_val_windows < 1:
            raise ValueError(f"num_val_windows must be >= 1, got {num_val_windows}")
        self.seq_len = seq_len
        self.seed = seed
        self.pack = bool(pack)
        if tokens is None:
            stream, file_starts, count = _read_stream(path, max_bytes)
            corpus, starts = _documents(stream, file_starts, separator)
            sha = hashlib.sha256(stream).hexdigest()
            provenance = provenance_record(path, count, len(stream), sha)
        else:
            if separator:
                raise ValueError("separator applies to bytes read from path, not to tokens")
            corpus = tokens
            starts = np.zeros(1, np.int64) if starts is None else starts
        self.vocab_size = vocab_size
        self.token_bytes = np.ones(vocab_size, np.int64) if token_bytes is None else token_bytes
        self.provenance = provenance or {}
        self.tokenizer = None  # set by `sources.text_source`
        self.train, self.val = split_corpus(corpus, val_fraction=val_fraction)
        self.train_documents = self.val_documents = None
        if self.pack:
            self.train_documents, self.val_documents = split_documents(
                corpus.size, starts, val_fraction=val_fraction
            )
        for name, part in (("train", self.train), ("validation", self.val)):
            if part.size < seq_len + 1:
                raise ValueError(
                    f"the {name} split has {part.size} bytes, fewer than seq_len + 1 = "
                    f"{seq_len + 1}; give a larger corpus (path / max_bytes) or a larger "
                    f"val_fraction"
                )
        # Evenly spaced validation windows (overlapping only if the split is short).
        last = self.val.size - (seq_len + 1)
        starts = np.unique(np.linspace(0, last, num_val_windows).round().astype(np.int64))
        rows = window_rows(self.val, self.val_documents, starts, seq_len)
        self.val_inputs, self.val_labels = rows["inputs"], rows["labels"]
        self.val_segment_ids = rows.get("segment_ids")

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """Windows at uniform random offsets drawn with a generator keyed by ``(seed, step)``."""
        rng = np.random.default_rng([self.seed, 3, step])
        starts = rng.integers(0, self.train.size - self.seq_len, size=batch_size)
        return window_rows(self.train, self.train_documents, starts, self.seq_len)

    def eval_batches(self, batch_size: int):
        """The validation windows in order, the last batch padded with ignored rows."""
        yield from padded_batches(
            self.val_inputs, self.val_labels, batch_size, segment_ids=self.val_segment_ids
        )

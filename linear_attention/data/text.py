"""Byte-level text: a corpus of bytes (vocabulary 256) split into train and validation.

The default corpus is the source of the running Python's standard library (``*.py`` files
under ``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded, in sorted path order),
read until ``max_bytes``: present on every machine, no download. A file or a folder (all its
files, sorted) can be given instead. The split is deterministic: the byte stream is cut into
blocks (64 KiB, or 1/100 of a smaller corpus) and block ``i`` goes to validation when
``floor((i + 1) f)`` exceeds ``floor(i f)`` (``f = val_fraction``), which spreads validation
over the whole corpus.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

from linear_attention.data.batches import padded_batches

VOCAB_SIZE = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _sorted_files(root: str, suffix: str | None):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if suffix is None or name.endswith(suffix):
                yield os.path.join(dirpath, name)


def load_corpus(path: str | None = None, *, max_bytes: int | None = None) -> np.ndarray:
    """Bytes of ``path`` (a file, or every file of a folder in sorted order; ``None`` or
    ``""``: the standard library's ``*.py`` files) as ``uint8[n]``, at most ``max_bytes``."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    if not path:
        files = _sorted_files(sysconfig.get_paths()["stdlib"], ".py")
    elif os.path.isfile(path):
        files = iter([path])
    elif os.path.isdir(path):
        files = _sorted_files(path, None)
    else:
        raise ValueError(f"text path {path!r} is neither a file nor a folder")
    chunks, total = [], 0
    for name in files:
        with open(name, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes - total)
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if corpus.size == 0:
        raise ValueError(f"text path {path!r} holds no bytes")
    return corpus


def split_corpus(
    corpus: np.ndarray, *, val_fraction: float, block_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic ``(train, validation)`` split by blocks (see the module docstring)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if block_size is None:
        block_size = min(1 << 16, max(1, -(-corpus.size // 100)))
    num_blocks = -(-corpus.size // block_size)
    i = np.arange(num_blocks)
    is_val = np.floor((i + 1) * val_fraction) > np.floor(i * val_fraction)
    block_of_byte = np.arange(corpus.size) // block_size
    val_mask = is_val[block_of_byte]
    return corpus[~val_mask], corpus[val_mask]


class TextData:
    """Byte-level language-modelling data: random training windows keyed by step, fixed
    evenly spaced validation windows. A window of ``seq_len + 1`` bytes ``w`` gives
    ``inputs = w[:-1]`` and ``labels = w[1:]``."""

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        *,
        seq_len: int,
        path: str | None = None,
        max_bytes: int | None = 8_000_000,
        val_fraction: float = 0.05,
        num_val_windows: int = 256,
        seed: int = 0,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if num_val_windows < 1:
            raise ValueError(f"num_val_windows must be >= 1, got {num_val_windows}")
        self.seq_len = seq_len
        self.seed = seed
        self.train, self.val = split_corpus(
            load_corpus(path, max_bytes=max_bytes), val_fraction=val_fraction
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
        windows = self.val[starts[:, None] + np.arange(seq_len + 1)]
        self.val_inputs = windows[:, :-1].astype(np.int32)
        self.val_labels = windows[:, 1:].astype(np.int32)

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """Windows at uniform random offsets drawn with a generator keyed by ``(seed, step)``."""
        rng = np.random.default_rng([self.seed, 3, step])
        starts = rng.integers(0, self.train.size - self.seq_len, size=batch_size)
        windows = self.train[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": windows[:, :-1], "labels": windows[:, 1:]}

    def eval_batches(self, batch_size: int):
        """The validation windows in order, the last batch padded with ignored rows."""
        yield from padded_batches(self.val_inputs, self.val_labels, batch_size)

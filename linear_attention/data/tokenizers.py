"""Tokenizers: bytes (vocabulary 256), a Hugging Face ``tokenizer.json`` or a sentencepiece
``.model``, all behind one small interface, and `train_bpe` (behind ``la-tokenizer train``).

A tokenizer has ``vocab_size``, ``encode(text: str) -> int32[n]``, ``decode(ids) -> str``,
``name`` (what ``config.data.tokenizer`` said), ``fingerprint`` (SHA-256 of its file: a cache of
tokenized text is valid only for the same tokenizer) and ``token_bytes: int64[vocab_size]``, the
number of UTF-8 bytes each token stands for. Bits per byte are the summed cross-entropy of the
predicted tokens divided by ``ln 2`` times the bytes those tokens cover
(``sum(token_bytes[labels])``), so runs with different tokenizers are measured on the same scale
(for bytes every token covers one byte and this is ``loss / ln 2``).

``token_bytes`` is exact for bytes and for byte-level BPE (the GPT-2 byte-to-character table is
inverted, so a token that holds half a UTF-8 character counts the bytes it holds). For other
``tokenizer.json`` models and sentencepiece it is the UTF-8 length of the token's piece, with
sentencepiece's ``▁`` counted as the one space it stands for and byte pieces ``<0xNN>`` as one
byte; special (control) tokens count zero. Nothing is ever downloaded: a tokenizer is a local
file.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable

import numpy as np

from linear_attention.data.batches import IGNORE_INDEX
from linear_attention.data.files import atomic_file, sha256_file

BYTES = "bytes"
_SPACE_PIECE = "\u2581"  # sentencepiece's "▁": a space


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's character of each byte (printable bytes stand for themselves, the others are
    shifted past 255), inverted: character -> byte. The table every byte-level BPE uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, every token one byte."""

    name = BYTES
    fingerprint = BYTES
    vocab_size = 256

    def __init__(self):
        self.token_bytes = np.ones(256, np.int64)

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode() if isinstance(text, str) else text
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.int64).astype(np.uint8).tolist()).decode(
            "utf-8", errors="replace"
        )


class HFTokenizer:
    """A Hugging Face ``tokenizers`` model read from a ``tokenizer.json``."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library's own message names what is wrong
            raise ValueError(f"tokenizer {path!r} is not a valid tokenizer.json: {e}") from None
        self.name = path
        self.fingerprint = sha256_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.token_bytes = self._token_bytes()

    def _token_bytes(self) -> np.ndarray:
        import json

        spec = json.loads(self._tok.to_str())
        byte_level = any(
            isinstance(part, dict) and part.get("type") == "ByteLevel"
            for part in (spec.get("pre_tokenizer"), spec.get("decoder"))
        )
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        table = _byte_level_table()
        out = np.zeros(self.vocab_size, np.int64)
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i)
            if piece is None or i in special:
                continue
            if byte_level and all(c in table for c in piece):
                out[i] = len(piece)  # one character of the table is one byte
            elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                out[i] = 1
            else:
                out[i] = len(piece.replace(_SPACE_PIECE, " ").encode())
        return out

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def decode(self, ids) -> str:
        return self._tok.decode(np.asarray(ids, np.int64).tolist(), skip_special_tokens=False)


class SentencePieceTokenizer:
    """A sentencepiece model read from a ``.model`` file."""

    def __init__(self, path: str):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except Exception as e:  # the library's own message names what is wrong
            raise ValueError(f"tokenizer {path!r} is not a sentencepiece model: {e}") from None
        self.name = path
        self.fingerprint = sha256_file(path)
        self.vocab_size = int(self._sp.GetPieceSize())
        out = np.zeros(self.vocab_size, np.int64)
        for i in range(self.vocab_size):
            if self._sp.IsControl(i):
                continue
            if self._sp.IsByte(i):
                out[i] = 1
            else:
                out[i] = len(self._sp.IdToPiece(i).replace(_SPACE_PIECE, " ").encode())
        self.token_bytes = out

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.Encode(text), np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self._sp.Encode(texts)]

    def decode(self, ids) -> str:
        return self._sp.Decode(np.asarray(ids, np.int64).tolist())


def label_bytes(labels: np.ndarray, token_bytes: np.ndarray) -> int:
    """The bytes the labelled targets of ``labels`` cover (``IGNORE_INDEX`` positions none)."""
    labels = np.asarray(labels)
    return int(np.asarray(token_bytes)[labels[labels != IGNORE_INDEX]].sum())


def bits_per_byte(loss_sum: float, num_tokens: float, num_bytes: float) -> float:
    """Bits per byte of a summed cross-entropy ``loss_sum`` (nats) over ``num_tokens`` targets
    covering ``num_bytes`` bytes: ``loss_sum / (ln 2 · num_bytes)``, computed as the mean loss
    per token times tokens per byte so that with bytes as tokens it is exactly
    ``mean loss / ln 2``."""
    if num_bytes <= 0:
        return float("nan")
    mean = loss_sum / max(num_tokens, 1.0)
    return mean * (num_tokens / num_bytes) / math.log(2)


def check_tokenizer_spec(spec: str) -> None:
    """ValueError unless ``spec`` is ``"bytes"`` or an existing ``.json`` / ``.model`` file."""
    if spec == BYTES:
        return
    if not spec.endswith((".json", ".model")):
        raise ValueError(
            f"must be 'bytes', a tokenizer.json (Hugging Face tokenizers) or a sentencepiece "
            f".model file, got {spec!r}"
        )
    if not os.path.isfile(spec):
        raise ValueError(f"{spec!r} is not a file (tokenizers are never downloaded)")


@functools.lru_cache(maxsize=8)
def _load(spec: str, mtime_ns: int):
    if spec.endswith(".json"):
        return HFTokenizer(spec)
    return SentencePieceTokenizer(spec)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer | SentencePieceTokenizer:
    """The tokenizer ``config.data.tokenizer`` names: ``"bytes"``, a ``tokenizer.json`` or a
    sentencepiece ``.model`` (loaded once per file version)."""
    check_tokenizer_spec(spec)
    if spec == BYTES:
        return ByteTokenizer()
    return _load(spec, os.stat(spec).st_mtime_ns)


# The tokenizers library reserves memory for the vocabulary it is asked for: 10**9 aborts the
# process inside Rust, so requests are bounded (far above any vocabulary a model here uses).
MAX_VOCAB_SIZE = 1 << 24


def check_vocab_size(vocab_size: int) -> None:
    """ValueError unless a byte-level BPE of ``vocab_size`` tokens can be trained."""
    low = len(_byte_level_table())
    if not low <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be in [{low}, {MAX_VOCAB_SIZE:,}] (at least the byte alphabet), "
            f"got {vocab_size}"
        )


def train_bpe(
    texts: Iterable[str], *, vocab_size: int, output: str, show_progress: bool = False
) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2's byte alphabet and pre-tokenizer, so any text encodes,
    with no unknown token) of at most ``vocab_size`` tokens on ``texts``; saved as a
    ``tokenizer.json`` at ``output`` (written whole or not at all: a failed write, e.g. a full
    disk, raises OSError and leaves no file) and returned. The vocabulary is smaller when the
    corpus has fewer distinct merges. ``show_progress``: the library's own bar of the merges
    (on a terminal)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=alphabet,
        special_tokens=[],
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with atomic_file(output) as f:  # (the library's own save raises a bare Exception)
        f.write(tok.to_str().encode())
    return HFTokenizer(output)

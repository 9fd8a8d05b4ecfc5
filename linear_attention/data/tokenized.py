"""Text tokenized once: documents -> one token stream with each document's first token, cached.

The cache is a ``.npz`` (``tokens``: uint16 when the vocabulary fits, else uint32; ``starts``:
int64) named by a SHA-256 of the corpus's content digest (`corpus.read_documents`), the
tokenizer's fingerprint (the SHA-256 of its file) and the separator. A changed corpus or
tokenizer has another name, so a stale cache is never read; a damaged cache file is tokenized
again and rewritten. It is written to a temporary name and moved into place, so a run killed
while writing leaves no half file under the real name.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

CACHE_VERSION = 1


def cache_key(provenance: dict, tokenizer, separator: str) -> str:
    """The name of a tokenized corpus: what it was made from, hashed."""
    parts = {
        "version": CACHE_VERSION,
        "corpus": provenance["sha256"],
        "tokenizer": tokenizer.fingerprint,
        "separator": separator,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _split(docs: list[str], separator: str) -> list[str]:
    """Documents cut after every ``separator`` (kept at the end of the piece it closes)."""
    if not separator:
        return docs
    out = []
    for doc in docs:
        pieces = doc.split(separator)
        out += [p + separator for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    return out


def _encode_all(docs: list[str], tokenizer, batch: int = 1024) -> list[np.ndarray]:
    if not hasattr(tokenizer, "encode_batch"):
        return [tokenizer.encode(d) for d in docs]
    out = []
    for begin in range(0, len(docs), batch):
        out += tokenizer.encode_batch(docs[begin : begin + batch])
    return out


def tokenize_documents(
    docs: list[str],
    tokenizer,
    *,
    provenance: dict,
    separator: str = "",
    cache_dir: str | None = None,
    message=None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, starts)``: the documents' tokens in order (empty documents dropped) and the
    index of each document's first token; from ``cache_dir`` when it holds this corpus
    tokenized by this tokenizer, else tokenized and saved there (no cache when None)."""
    path = None
    if cache_dir:
        name = f"tokens-{cache_key(provenance, tokenizer, separator)}.npz"
        path = os.path.join(cache_dir, name)
        if os.path.exists(path):
            try:
                with np.load(path, allow_pickle=False) as f:
                    return f["tokens"], f["starts"]
            except (OSError, ValueError, KeyError) as e:
                if message:
                    message(f"token cache {path} is damaged ({e}): tokenizing again")
    encoded = [ids for ids in _encode_all(_split(docs, separator), tokenizer) if ids.size]
    if not encoded:
        raise ValueError("the corpus tokenizes to no tokens")
    lengths = np.asarray([ids.size for ids in encoded], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    tokens = np.concatenate(encoded).astype(dtype)
    if path is not None:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}.npz"
        np.savez(tmp, tokens=tokens, starts=starts)
        os.replace(tmp, path)
        if message:
            message(f"tokenized {provenance['bytes']:,} bytes into {tokens.size:,} tokens: {path}")
    return tokens, starts

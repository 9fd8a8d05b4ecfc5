"""Flat token files with a sidecar: `encode_token_file` (behind ``la-tokenizer encode``) writes
``train.bin`` and ``train.bin.json``; `check_token_file` (used by the ``tokens`` source) checks
a file against its sidecar, or, without one, against the commonest mistake.

The sidecar records what the ids are: ``dtype``, ``vocab_size`` (the ids lie in
``[0, vocab_size)``), ``eos_id`` (-1: none; else it ends every document), the ``tokens`` and
``documents`` counts, the ``tokenizer`` and its SHA-256, the corpus's provenance and the file's
``digest`` (`files.file_digest`: whole, or sampled for files over 1 GiB). A file that no
longer matches its digest, a ``token_dtype``, ``eos_id`` or tokenizer other than the
sidecar's, or more ids than ``config.model.vocab_size`` holds, is a ValueError naming both
sides. Without a sidecar, a uint16 read of a file of uint32 ids (little-endian: every second
uint16 is a high half, zero for ids below 65536) is recognised in a sample of the file and
refused (a file whose size is no whole number of ``token_dtype`` ids is refused by
`corpus.read_token_file`).
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np

from linear_attention.data.files import atomic_file, file_digest, write_atomic
from linear_attention.data.tokenized import tokenize_documents

SIDECAR_SUFFIX = ".json"
FORMAT = "linear_attention.tokens/1"
_SAMPLE = 1 << 20  # ids read for the uint32-as-uint16 check


def sidecar_path(path: str) -> str:
    return path + SIDECAR_SUFFIX


def encode_token_file(
    docs: list[str], tokenizer, output: str, *, provenance: dict, eos_id: int = -1, progress=None
) -> dict:
    """Tokenize ``docs`` with ``tokenizer`` into the flat file ``output`` (each document
    followed by ``eos_id`` when it is >= 0) and write its sidecar; returns the sidecar. Both
    files are written whole or not at all: a failure (a full disk) leaves neither."""
    tokens, starts = tokenize_documents(docs, tokenizer, provenance=provenance, progress=progress)
    vocab_size = max(tokenizer.vocab_size, eos_id + 1)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    if eos_id >= 0:
        ends = np.append(starts[1:], tokens.size)
        tokens = np.insert(tokens.astype(dtype), ends, dtype(eos_id))
    tokens = np.ascontiguousarray(tokens, dtype)
    sidecar = sidecar_path(output)
    try:
        with atomic_file(output) as f:
            f.write(memoryview(tokens).cast("B"))
        record = {
            "format": FORMAT,
            "dtype": np.dtype(dtype).name,
            "vocab_size": int(vocab_size),
            "eos_id": int(eos_id),
            "tokens": int(tokens.size),
            "documents": int(starts.size),
            "tokenizer": tokenizer.name,
            "tokenizer_sha256": tokenizer.fingerprint,
            "corpus": provenance,
            "digest": file_digest(output),
        }
        write_atomic(sidecar, json.dumps(record, indent=2, sort_keys=True) + "\n")
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(output)
        raise
    return record


def read_sidecar(path: str) -> dict | None:
    """The sidecar of the token file ``path`` (None when there is none); ValueError when it
    cannot be read as one."""
    sidecar = sidecar_path(path)
    if not os.path.isfile(sidecar):
        return None
    try:
        with open(sidecar) as f:
            record = json.load(f)
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"not a token-file sidecar (no format {FORMAT!r})")
        for key in ("dtype", "vocab_size", "eos_id", "digest"):
            if key not in record:
                raise ValueError(f"no {key!r}")
    except (OSError, ValueError) as e:
        raise ValueError(f"{sidecar}: damaged ({e}); remove it or encode the file again") from None
    return record


def check_token_file(
    path: str,
    tokens: np.ndarray,
    *,
    token_dtype: str,
    vocab_size: int,
    eos_id: int,
    tokenizer=None,
) -> dict | None:
    """Check the token file ``path`` (read as ``tokens``) against its sidecar, returned (see
    the module docstring); without a sidecar, ids that look like uint32 read as uint16 are a
    ValueError, and None is returned."""
    record = read_sidecar(path)
    sidecar = sidecar_path(path)
    if record is None:
        problem = _narrow_read(tokens, token_dtype, vocab_size)
        if problem:
            raise ValueError(f"{path}: {problem}")
        return None
    if record["dtype"] != token_dtype:
        raise ValueError(
            f"{path}: its sidecar {sidecar} says the ids are {record['dtype']}, but "
            f"config.data.token_dtype = {token_dtype!r}"
        )
    digest = file_digest(path)
    if digest != record["digest"]:
        raise ValueError(
            f"{path} has changed since {sidecar} was written ({digest['bytes']} bytes, "
            f"{record['digest'].get('bytes')} then; digest differs); encode it again or remove "
            "the sidecar"
        )
    if record["vocab_size"] > vocab_size:
        raise ValueError(
            f"{path}: its sidecar says the ids go up to vocab_size {record['vocab_size']}, more "
            f"than config.model.vocab_size = {vocab_size}"
        )
    if eos_id >= 0 and eos_id != record["eos_id"]:
        raise ValueError(
            f"{path}: config.data.eos_id = {eos_id}, but its sidecar says the documents end with "
            f"{record['eos_id']} (-1: none)"
        )
    if tokenizer is not None and record.get("tokenizer_sha256") not in (
        None,
        tokenizer.fingerprint,
    ):
        raise ValueError(
            f"{path} was encoded by the tokenizer {record.get('tokenizer')!r} (SHA-256 "
            f"{record['tokenizer_sha256'][:12]}...), not by config.data.tokenizer = "
            f"{tokenizer.name!r} (SHA-256 {tokenizer.fingerprint[:12]}...)"
        )
    return record


def _narrow_read(tokens: np.ndarray, token_dtype: str, vocab_size: int) -> str | None:
    """Why ``tokens`` look like uint32 ids read as uint16, or None: little-endian, every
    second uint16 is then the high half of an id below ``vocab_size``, at most
    ``(vocab_size - 1) >> 16`` (0 for a vocabulary that uint16 holds), while the low halves
    spread over the whole range."""
    if token_dtype != "uint16" or tokens.dtype != np.uint16 or tokens.size % 2:
        return None
    sample = np.asarray(tokens[: min(tokens.size, _SAMPLE)])
    if sample.size < 16:
        return None
    top = (max(vocab_size, 1) - 1) >> 16  # the largest high half of an id in the vocabulary
    low, high = sample[0::2] <= top, sample[1::2] <= top
    if np.mean(high) >= 0.95 and np.mean(low) < 0.5:
        return (
            f"{np.mean(high):.0%} of every second id is {'0' if top == 0 else f'<= {top}'} in "
            f"the first {sample.size:,} ids: these are uint32 ids read as uint16; set "
            "config.data.token_dtype='uint32' (a file that is uint16 after all needs the "
            "sidecar that la-tokenizer encode writes)"
        )
    return None

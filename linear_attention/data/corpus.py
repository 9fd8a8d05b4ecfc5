"""Reading a corpus as documents: text files, folders, JSONL and Parquet, and flat token files.

`read_documents(path)` returns the documents of ``path`` as UTF-8 strings:

- ``""`` / None: the built-in corpus, the running Python's standard library ``*.py`` files
  (the files of `text.load_documents`, in the same order) that are UTF-8 text (a few are test
  data for other source encodings, e.g. ``test/test_source_encoding.py``: left out);
- a ``.jsonl`` file: one JSON object per line, the document is its ``text_field`` (blank lines
  are skipped);
- a ``.parquet`` file: one row per document, the string column ``text_field``;
- any other file: one document;
- a folder: each of its files (sorted, recursively) read by the rules above.

Bad input stops with a ValueError naming the file and, for JSONL and text, the line: an
unreadable file, a line that is not JSON, a record without the field or whose field is not a
string, text that is not UTF-8, a Parquet file without the column, a corpus with no text at all.

`read_token_file(path, dtype)` memory-maps a flat binary file of token ids (``.bin``: the
nanoGPT / Megatron convention, ``uint16`` or ``uint32``, no header) or loads a ``.npy``
(memory-mapped too).

The provenance of a corpus (`text.provenance_record`, for ``summary.json``) has its path, the
number of files and bytes, a SHA-256 of the documents (every document's length and bytes in
order) and the Python version (the built-in corpus is that version's standard library).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig

import numpy as np

from linear_attention.data.text import provenance_record, sorted_files

TOKEN_DTYPES = ("uint16", "uint32")


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{name}, line {_line_of(data, e.start)}: not UTF-8 text (byte {data[e.start]:#04x} at "
            f"offset {e.start}); a tokenizer reads UTF-8 text only"
        ) from None


def _read_bytes(name: str, limit: int | None = None) -> bytes:
    try:
        with open(name, "rb") as f:
            return f.read() if limit is None else f.read(limit)
    except OSError as e:
        raise ValueError(f"{name}: cannot be read ({e.strerror or e})") from None


def _jsonl(name: str, text_field: str) -> list[str]:
    data = _read_bytes(name)
    text = _decode(data, name)
    out = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{name}, line {number}: not a JSON object ({e})") from None
        if not isinstance(record, dict):
            kind = type(record).__name__
            raise ValueError(f"{name}, line {number}: a JSON {kind}, not an object")
        if text_field not in record:
            raise ValueError(
                f"{name}, line {number}: the record has no field {text_field!r} "
                f"(config.data.text_field); its fields: {', '.join(sorted(record)) or 'none'}"
            )
        value = record[text_field]
        if not isinstance(value, str):
            raise ValueError(
                f"{name}, line {number}: field {text_field!r} is a {type(value).__name__}, "
                "not a string"
            )
        out.append(value)
    return out


def _parquet(name: str, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(name)
    except Exception as e:  # pyarrow's own message says what is wrong with the file
        raise ValueError(f"{name}: not a readable Parquet file ({e})") from None
    if text_field not in table.column_names:
        raise ValueError(
            f"{name}: no column {text_field!r} (config.data.text_field); its columns: "
            f"{', '.join(table.column_names)}"
        )
    values = table.column(text_field).to_pylist()
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(
                f"{name}, row {row}: column {text_field!r} holds a {type(value).__name__}, "
                "not a string"
            )
    return values


def _files(path: str | None) -> list[str]:
    if not path:
        return list(sorted_files(sysconfig.get_paths()["stdlib"], ".py"))
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return list(sorted_files(path, None))
    raise ValueError(f"{path!r} is neither a file nor a folder")


def read_documents(
    path: str | None, *, text_field: str = "text", max_bytes: int | None = None
) -> tuple[list[str], dict]:
    """``(documents, provenance)`` of ``path`` (see the module docstring), reading at most
    ``max_bytes`` bytes of text (the last document is cut there; None: everything)."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    docs, total, files, cut = [], 0, 0, False
    digest = hashlib.sha256()
    for name in _files(path):
        if name.endswith(".jsonl"):
            texts = _jsonl(name, text_field)
        elif name.endswith(".parquet"):
            texts = _parquet(name, text_field)
        elif not path:  # the built-in corpus: its few non-UTF-8 files are left out
            data = _read_bytes(name)
            try:
                texts = [data.decode("utf-8")]
            except UnicodeDecodeError:
                continue
        else:
            texts = [_decode(_read_bytes(name), name)]
        files += 1
        for text in texts:
            data = text.encode()
            cut = max_bytes is not None and total + len(data) >= max_bytes
            if cut:  # the last document ends at a character boundary at most max_bytes in
                data = data[: max_bytes - total].decode("utf-8", errors="ignore").encode()
                text = data.decode()
            if data:
                docs.append(text)
                digest.update(len(data).to_bytes(8, "little"))
                digest.update(data)
                total += len(data)
            if cut:
                break
        if cut:
            break
    if not docs:
        raise ValueError(f"{path or 'the built-in corpus'!r} holds no text")
    return docs, provenance_record(path, files, total, digest.hexdigest())


def read_token_file(path: str, token_dtype: str) -> np.ndarray:
    """The token ids of ``path``, memory-mapped: a ``.npy`` (its own dtype, 1-D, integer) or a
    flat binary file of ``token_dtype`` (``uint16`` / ``uint32``, native byte order)."""
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {TOKEN_DTYPES}, got {token_dtype!r}")
    try:
        if path.endswith(".npy"):
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            size = os.path.getsize(path)
            item = np.dtype(token_dtype).itemsize
            if size % item:
                raise ValueError(
                    f"{path}: {size} bytes is not a whole number of {token_dtype} tokens "
                    f"({item} bytes each); is config.data.token_dtype right?"
                )
            if size == 0:
                raise ValueError(f"{path}: empty file, no tokens")
            tokens = np.memmap(path, dtype=token_dtype, mode="r")
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        if str(e).startswith(path):
            raise
        raise ValueError(f"{path}: not a valid .npy file ({e})") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(
            f"{path}: holds {tokens.dtype} of shape {tokens.shape}; token ids must be a 1-D "
            "integer array"
        )
    if tokens.size == 0:
        raise ValueError(f"{path}: empty, no tokens")
    return tokens


def check_token_range(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    """ValueError naming the first token id of ``tokens`` that is negative or
    ``>= vocab_size``, and its index in ``path`` (read in blocks: the file may be large)."""
    block = 1 << 24
    for begin in range(0, tokens.size, block):
        part = np.asarray(tokens[begin : begin + block])
        bad = np.flatnonzero((part < 0) | (part >= vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{path}: token {int(part[i])} at index {begin + i} is outside the vocabulary "
                f"[0, {vocab_size}) (config.model.vocab_size = {vocab_size})"
            )

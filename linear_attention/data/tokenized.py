"""Text tokenized once: documents -> one token stream with each document's first token, cached.

The cache is a ``.npz`` (``tokens``: uint16 when the vocabulary fits, else uint32; ``starts``:
int64; ``key``: the name below; ``digest``: a SHA-256 of the arrays) named by a SHA-256 of the
corpus's content digest (`corpus.read_documents`), the tokenizer's fingerprint (the SHA-256 of
its file) and the separator. A changed corpus or tokenizer has another name, so a stale cache is
never read.

A cache is used only when it reads back whole: its key is its name (a file copied from another
corpus is foreign), its digest matches its arrays (a rewritten or bit-flipped file does not),
and its arrays have the cache's shapes and dtypes. Anything else — a truncated or emptied file,
any exception while reading it, a folder at its path — is set aside as ``<name>.damaged``
(replacing an earlier one), said in one line naming it, and the corpus is tokenized again.

A cache is written to ``<name>.tmp<pid>.npz`` and moved into place, so a run killed while
writing leaves no half file under the real name. A write that fails (a full disk, no
permission) removes its temporary file and is said in one line; the run goes on with the tokens
in memory. Temporaries left by a killed process (its pid no longer running) are removed by the
next run that uses the folder.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil

import numpy as np

CACHE_VERSION = 2
_TMP = re.compile(r"\.tmp(\d+)\.npz$")


def cache_key(provenance: dict, tokenizer, separator: str) -> str:
    """The name of a tokenized corpus: what it was made from, hashed."""
    parts = {
        "version": CACHE_VERSION,
        "corpus": provenance["sha256"],
        "tokenizer": tokenizer.fingerprint,
        "separator": separator,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def arrays_digest(tokens: np.ndarray, starts: np.ndarray) -> str:
    """SHA-256 of a token stream and its document starts (their dtypes, sizes and bytes)."""
    digest = hashlib.sha256()
    for array in (tokens, starts):
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}:{array.size};".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def _split(docs: list[str], separator: str) -> list[str]:
    """Documents cut after every ``separator`` (kept at the end of the piece it closes)."""
    if not separator:
        return docs
    out = []
    for doc in docs:
        pieces = doc.split(separator)
        out += [p + separator for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    return out


def _encode_all(docs: list[str], tokenizer, progress=None, batch: int = 1024) -> list[np.ndarray]:
    """The ids of every document; ``progress(done, total)`` (in bytes) after each batch."""
    total = sum(len(d) for d in docs)
    out, done = [], 0
    for begin in range(0, len(docs), batch):
        part = docs[begin : begin + batch]
        if hasattr(tokenizer, "encode_batch"):
            out += tokenizer.encode_batch(part)
        else:
            out += [tokenizer.encode(d) for d in part]
        done += sum(len(d) for d in part)
        if progress is not None:
            progress(done, total)
    return out


def _read_cache(path: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The arrays of the cache at ``path``; ValueError saying why when it is not whole."""
    with np.load(path, allow_pickle=False) as f:
        names = set(f.files)
        if names != {"tokens", "starts", "key", "digest"}:
            raise ValueError(f"holds {sorted(names)}, not a token cache of this version")
        tokens, starts = f["tokens"], f["starts"]
        stored_key, stored_digest = str(f["key"]), str(f["digest"])
    if stored_key != key:
        raise ValueError(f"made for {stored_key}, not for this corpus and tokenizer")
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32) or tokens.size == 0:
        raise ValueError(f"tokens are {tokens.dtype}{list(tokens.shape)}")
    if starts.ndim != 1 or starts.dtype != np.int64 or starts.size == 0:
        raise ValueError(f"starts are {starts.dtype}{list(starts.shape)}")
    if arrays_digest(tokens, starts) != stored_digest:
        raise ValueError("its arrays do not match their digest")
    return tokens, starts


def _set_aside(path: str) -> str:
    """Move ``path`` (a file or a folder) to ``path.damaged``, replacing an earlier one."""
    aside = f"{path}.damaged"
    if os.path.isdir(aside) and not os.path.islink(aside):
        shutil.rmtree(aside)
    elif os.path.lexists(aside):
        os.remove(aside)
    os.replace(path, aside)
    return aside


def _pid_running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process writes no cache now: a leftover of a reused pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(cache_dir: str, message=None) -> list[str]:
    """Remove the temporary files in ``cache_dir`` whose writing process is gone; their
    paths."""
    removed = []
    for tmp in glob.glob(os.path.join(glob.escape(cache_dir), "tokens-*.npz.tmp*.npz")):
        match = _TMP.search(tmp)
        if match and not _pid_running(int(match.group(1))):
            try:
                os.remove(tmp)
            except OSError:
                continue
            removed.append(tmp)
    if removed and message:
        message(f"token cache: removed {len(removed)} temporary file(s) left by a killed run")
    return removed


def _write_cache(path: str, key: str, tokens, starts, message) -> bool:
    """Write the cache at ``path`` through a temporary file; False (said, nothing left
    behind) when the disk refuses."""
    tmp = f"{path}.tmp{os.getpid()}.npz"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, tokens=tokens, starts=starts, key=key, digest=arrays_digest(tokens, starts))
        os.replace(tmp, path)
        return True
    except OSError as e:
        if message:
            message(f"token cache {path} not written ({e.strerror or e}): going on without it")
        return False
    finally:
        if os.path.lexists(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass


def tokenize_documents(
    docs: list[str],
    tokenizer,
    *,
    provenance: dict,
    separator: str = "",
    cache_dir: str | None = None,
    message=None,
    progress=None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, starts)``: the documents' tokens in order (empty documents dropped) and the
    index of each document's first token; from ``cache_dir`` when it holds this corpus
    tokenized by this tokenizer, else tokenized and saved there (no cache when None; see the
    module docstring). ``message`` takes the lines said; ``progress(done, total)`` is called
    with the bytes tokenized so far."""
    path = key = None
    if cache_dir:
        key = cache_key(provenance, tokenizer, separator)
        path = os.path.join(cache_dir, f"tokens-{key}.npz")
        if os.path.isdir(cache_dir):
            remove_stale_temporaries(cache_dir, message)
        if os.path.lexists(path):
            try:
                if os.path.isdir(path):
                    raise ValueError("a folder, not a file")
                return _read_cache(path, key)
            except Exception as e:  # any way a file can fail to read back whole
                reason = str(e) or type(e).__name__
                try:
                    where = f"set aside as {_set_aside(path)}"
                except OSError as moved:
                    raise ValueError(
                        f"token cache {path} is damaged ({reason}) and cannot be moved aside "
                        f"({moved.strerror or moved}); remove it"
                    ) from None
                if message:
                    message(f"token cache {path} is damaged ({reason}): {where}, tokenizing again")
    encoded = [ids for ids in _encode_all(_split(docs, separator), tokenizer, progress) if ids.size]
    if not encoded:
        raise ValueError("the corpus tokenizes to no tokens")
    lengths = np.asarray([ids.size for ids in encoded], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    tokens = np.concatenate(encoded).astype(dtype)
    if path is not None and _write_cache(path, key, tokens, starts, message) and message:
        message(f"tokenized {provenance['bytes']:,} bytes into {tokens.size:,} tokens: {path}")
    return tokens, starts

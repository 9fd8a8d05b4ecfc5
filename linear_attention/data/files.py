"""Files written whole or not at all (`atomic_file`, `write_atomic`), and digests of data files
(`sha256_file`, `file_digest`).

The data go to a temporary file beside the target, flushed to disk, then moved onto the target
name, so a reader never sees half a file and a killed writer leaves the old file in place. A
write that fails (a full disk, ``ulimit -f``, no permission) removes its temporary and raises
the OSError; the caller says what failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str):
    """``with atomic_file(path) as f:`` a binary file object whose content becomes ``path``
    when the block ends without an exception (see the module docstring)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plain open() would not
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename is None:  # (a failed write names no file)
            raise OSError(e.errno, e.strerror, path) from None
        raise


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through `atomic_file`."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def sha256_file(path: str) -> str:
    """SHA-256 of the file at ``path``, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Files up to this size are hashed whole; larger ones by samples (reading them would take
# minutes at every start of a run).
FULL_DIGEST_BYTES = 1 << 30
_SAMPLES, _SAMPLE_BYTES = 256, 1 << 16


def file_digest(path: str) -> dict:
    """What a data file is, cheap enough for every run start: ``{"bytes", "sha256"}`` for a
    file of at most `FULL_DIGEST_BYTES`, else ``{"bytes", "sampled_sha256"}``: the SHA-256 of
    the size and of 256 blocks of 64 KiB spaced evenly from the first byte to the last (a
    change outside the samples of a file larger than 1 GiB, at the same size, goes unseen)."""
    size = os.path.getsize(path)
    if size <= FULL_DIGEST_BYTES:
        return {"bytes": size, "sha256": sha256_file(path)}
    digest = hashlib.sha256(f"{size};".encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return {"bytes": size, "sampled_sha256": digest.hexdigest()}

"""The token cache checks what it reads: a damaged, truncated, foreign or rewritten cache (or a
folder at its path) is set aside with one line and the corpus tokenized again; a failed write
leaves no temporary file, and temporaries of killed runs are removed."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from linear_attention.data.tokenized import arrays_digest, cache_key, tokenize_documents
from linear_attention.data.tokenizers import ByteTokenizer

DOCS = ["ab", "cde"]
PROV = {"sha256": "x", "bytes": 5}
EXPECTED = [97, 98, 99, 100, 101]


def _cache(tmp_path):
    messages = []
    tokens, _ = tokenize_documents(
        DOCS, ByteTokenizer(), provenance=PROV, cache_dir=str(tmp_path), message=messages.append
    )
    np.testing.assert_array_equal(tokens, EXPECTED)
    (path,) = tmp_path.glob("tokens-*.npz")
    return path


def _reread(tmp_path):
    """The tokens read again, and the lines said."""
    messages = []
    tokens, starts = tokenize_documents(
        DOCS, ByteTokenizer(), provenance=PROV, cache_dir=str(tmp_path), message=messages.append
    )
    return tokens, starts, messages


def _npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _damage(path, how):
    data = path.read_bytes()
    key = cache_key(PROV, ByteTokenizer(), "")
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "bit_flipped":  # a byte of the tokens array (the zip's CRC no longer matches)
        with np.load(path) as f:
            raw = f["tokens"].tobytes()
        i = data.index(raw) + 1
        path.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :])
    elif how == "rewritten_old_format":  # other valid tokens, as the first version wrote them
        _npz(path, tokens=np.array([5, 6, 7], np.uint16), starts=np.array([0], np.int64))
    elif how == "rewritten_same_digest":  # other tokens under the old digest
        with np.load(path) as f:
            digest = str(f["digest"])
        tokens = np.array([97, 98, 99, 100, 102], np.uint16)
        _npz(path, tokens=tokens, starts=np.array([0, 2], np.int64), key=key, digest=digest)
    elif how == "foreign":  # a whole cache of another corpus under this name
        tokens, starts = np.array([1, 2], np.uint16), np.array([0], np.int64)
        digest = arrays_digest(tokens, starts)
        _npz(path, tokens=tokens, starts=starts, key="0" * 24, digest=digest)
    elif how == "wrong_dtype":  # whole and signed, but not a token stream
        tokens, starts = np.array([1.5], np.float32), np.array([0], np.int64)
        _npz(path, tokens=tokens, starts=starts, key=key, digest=arrays_digest(tokens, starts))
    elif how == "folder":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("x")
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    "how, reason",
    [
        ("truncated", "File is not a zip file"),
        ("emptied", ""),
        ("bit_flipped", "Bad CRC-32"),
        ("rewritten_old_format", "not a token cache of this version"),
        ("rewritten_same_digest", "do not match their digest"),
        ("foreign", "made for 000000000000000000000000, not for this corpus"),
        ("wrong_dtype", "tokens are float32"),
        ("folder", "a folder, not a file"),
    ],
)
def test_a_damaged_cache_is_set_aside_and_rebuilt(tmp_path, how, reason):
    path = _cache(tmp_path)
    _damage(path, how)
    tokens, starts, messages = _reread(tmp_path)
    np.testing.assert_array_equal(tokens, EXPECTED)  # the corpus's own tokens, never the file's
    np.testing.assert_array_equal(starts, [0, 2])
    damaged = [m for m in messages if "is damaged" in m]
    assert len(damaged) == 1 and reason in damaged[0], messages
    assert f"set aside as {path}.damaged" in damaged[0]
    assert os.path.lexists(f"{path}.damaged") and path.is_file()
    # The rebuilt cache is whole: read back with nothing said.
    assert _reread(tmp_path)[2] == []


def test_a_second_damage_replaces_the_first_set_aside(tmp_path):
    path = _cache(tmp_path)
    _damage(path, "folder")
    _reread(tmp_path)
    _damage(path, "emptied")
    messages = _reread(tmp_path)[2]
    assert len(messages) == 2 and "is damaged" in messages[0]  # and the rewrite's line
    assert os.path.isfile(f"{path}.damaged") and os.path.getsize(f"{path}.damaged") == 0


_FULL_DISK = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from linear_attention.data.tokenized import tokenize_documents
    from linear_attention.data.tokenizers import ByteTokenizer

    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # as `ulimit -f 1`
    messages = []
    tokens, _ = tokenize_documents(
        ["x" * 5000], ByteTokenizer(), provenance={"sha256": "z", "bytes": 5000},
        cache_dir=sys.argv[1], message=messages.append,
    )
    assert tokens.size == 5000, tokens.size
    print("\\n".join(messages))
    """
)


def test_a_full_disk_leaves_no_temporary_file_and_goes_on(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "not written (File too large): going on without it" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_temporaries_of_killed_runs_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"tokens-abc.npz.tmp{dead.pid}.npz"
    live = tmp_path / f"tokens-abc.npz.tmp{os.getppid()}.npz"  # a running writer's: kept
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    messages = _reread(tmp_path)[2]
    assert not stale.exists() and live.exists()
    assert messages[0] == "token cache: removed 1 temporary file(s) left by a killed run"


def test_progress_reports_the_characters_tokenized():
    calls = []
    docs = [f"doc {i}" for i in range(2500)]
    tokenize_documents(docs, ByteTokenizer(), provenance=PROV, progress=lambda *a: calls.append(a))
    total = sum(len(d) for d in docs)
    assert [c[1] for c in calls] == [total] * 3  # batches of 1024 documents
    assert calls[-1][0] == total and calls[0][0] == sum(len(d) for d in docs[:1024])

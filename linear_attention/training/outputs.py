"""Files the command lines write for the user: checked before any work, never a run's own file,
never replaced without ``--overwrite``, and written whole or not at all.

`check_output` is called before anything is computed, so a bad ``--output`` costs nothing: a
missing folder, a folder at the path, a folder that cannot be written in (tried, not guessed
from the mode bits: root ignores them), an existing file without ``overwrite``, or a file of a
run (`run_file`: even with ``overwrite``) is a ValueError naming the flag. The write itself goes
through `data.files.atomic_file` (whole or not at all).
"""

from __future__ import annotations

import os
import tempfile

# What a run's workdir holds (training/trainer.py, checkpoint.py, tensorboard.py, tokenized.py).
_RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", ".lock")
_RUN_FOLDERS = ("checkpoints", "checkpoints_damaged", "token_cache", "plugins")


def run_file(path: str, workdir: str | None = None) -> str | None:
    """What ``path`` is to a run, if it is one of its files: a file of ``workdir`` or of any
    folder above ``path`` that holds a run (a ``config.json``); None otherwise."""
    target = os.path.realpath(path)
    runs = {os.path.realpath(workdir)} if workdir else set()
    folder = os.path.dirname(target)
    while True:
        if os.path.isfile(os.path.join(folder, "config.json")):
            runs.add(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    for run in runs:
        rel = os.path.relpath(target, run)
        if rel.startswith(os.pardir):
            continue
        top = rel.split(os.sep)[0]
        if rel in _RUN_FILES:
            return f"the run's {rel}"
        if top in _RUN_FOLDERS:
            return f"part of the run's {top}/"
        if top.startswith("events.out.tfevents"):
            return "the run's TensorBoard event file"
    return None


def check_output(
    path: str | None, *, flag: str = "--output", overwrite: bool = False, workdir: str | None = None
) -> None:
    """ValueError (naming ``flag``) unless ``path`` can be written as a new file, or replaced
    when ``overwrite``; see the module docstring."""
    if not path:
        raise ValueError(f"{flag} needs a file path")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; give a file path inside it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: the folder {folder!r} does not exist")
    owned = run_file(path, workdir)
    if owned is not None:
        raise ValueError(f"{flag} {path!r} is {owned}; choose another file")
    if os.path.lexists(path) and not overwrite:
        raise ValueError(f"{flag} {path!r} exists; pass --overwrite to replace it")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".la-write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"{flag} {path!r}: cannot write in {folder!r} ({e.strerror or e})"
        ) from None

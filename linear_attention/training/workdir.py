"""The run folder's safety: one run per workdir (a lock), checkpoint integrity digests, folders
written whole or not at all (`staged_folder`), and `RunError`, the error of a run that cannot
start or go on for a reason the user can fix.

A folder path given on a command line is never empty (`check_folder_arg`: an empty string
would be the current folder). A new folder (``la-convert``'s outputs) is written as
``<parent>/.<name>.partial`` under that folder's lock and renamed to its name when complete, so
a refused, failed or killed writer leaves no half-written folder, and its rerun works (a
``.partial`` folder whose lock's process is gone is cleared and written again).

Lock: ``<workdir>/.lock`` holds the owner's ``{"pid", "pid_start", "hostname", "started"}``.
It is created atomically (written to a private file, then hard-linked to the lock name, which
fails if it exists) and removed on exit. A lock whose process is gone (same host, no such pid)
is stale: it is removed with a message and the run goes on. So is a lock whose pid now belongs
to another process: ``pid_start`` is the process's start time (``/proc/<pid>/stat``, clock
ticks since boot), and a live pid that started at another time is a reused pid, not the
holder (where the start time cannot be read, e.g. off Linux or a lock written without it, a
live pid counts as the holder). A lock held by a live process, or by another
host (whose processes cannot be checked from here), refuses the run and names the holder.

Digests: after a checkpoint is saved, ``<step>/integrity.json`` records the size and SHA-256 of
every file of the step's folder. `verify_digest` re-reads them and names the first missing,
resized, altered or unexpected file; a step without the record (a save interrupted before it
was written) counts as incomplete.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import socket

LOCK_NAME = ".lock"
DIGEST_NAME = "integrity.json"


class RunError(ValueError):
    """A run that cannot start or continue: a damaged or busy workdir, a config that does not
    fit the saved run, unusable data. ``la-train`` prints it as ``la-train: error: ...``
    (exit status 2)."""


# ----------------------------------------------------------------------------- workdir
def check_folder_arg(flag: str, path: str | None) -> None:
    """RunError unless ``path`` (given as ``flag``) names a folder: not empty or blank (which
    would write into the current folder)."""
    if path is not None and not path.strip():
        raise RunError(
            f"{flag} is empty; give the folder to write (an empty path would be the current folder)"
        )


def check_new_folder(flag: str, path: str) -> None:
    """RunError unless ``path`` (given as ``flag``) is absent or an empty folder."""
    check_folder_arg(flag, path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise RunError(f"{flag} {path!r} exists and is not an empty folder; give a new one")


@contextlib.contextmanager
def staged_folder(flag: str, path: str, *, message=print):
    """``with staged_folder(flag, path) as staging:`` write the new folder ``path`` (given as
    ``flag``; absent or empty, `check_new_folder`) into ``staging`` (``<parent>/.<name>
    .partial``, under its `WorkdirLock`), which becomes ``path`` when the block ends without an
    error; on an error (or a signal) it is removed, and so are the parents it created, and an
    `OSError` (a full disk, a read-only or non-folder parent) becomes a `RunError`."""
    check_new_folder(flag, path)
    if os.path.isdir(path) and os.path.samefile(path, os.getcwd()):
        # (the rename would put a new folder in its place, under a shell that stays in the old)
        raise RunError(f"{flag} {path!r} is the current folder; give a new folder")
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    staging = os.path.join(parent, f".{name}.partial")
    created = _missing_parents(staging)
    try:
        os.makedirs(staging, exist_ok=True)
    except OSError as e:
        raise RunError(f"{flag} {path!r} cannot be created: {e.strerror or e}") from None
    lock = WorkdirLock(staging, message=message)
    try:
        lock.acquire()
    except RunError:
        _remove_created(created)
        raise
    try:
        for entry in sorted(set(os.listdir(staging)) - {LOCK_NAME}):  # a killed writer's
            message(f"removed {os.path.join(staging, entry)}, left by an unfinished writer")
            _remove(os.path.join(staging, entry))
        check_new_folder(flag, path)  # (again: under the lock)
        yield staging
        os.rename(staging, path)  # (onto an empty folder too)
        lock.moved_to(path)
    except OSError as e:
        _remove(staging)
        _remove_created(created)
        raise RunError(
            f"{flag} {path!r} not written ({e.strerror or e}); nothing of it is left"
        ) from None
    except BaseException:
        _remove(staging)
        _remove_created(created)
        raise
    finally:
        lock.release()


def _missing_parents(path: str) -> list[str]:
    """The folders above ``path`` that do not exist yet, the deepest first."""
    missing, folder = [], os.path.dirname(path)
    while folder and not os.path.exists(folder) and folder != os.path.dirname(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def _remove_created(folders: list[str]) -> None:
    for folder in folders:  # (the deepest first; one that holds something else is kept)
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def check_run_config(path: str, config) -> None:
    """RunError unless ``config``, read from the ``config.json`` at ``path``, is a run's: a JSON
    object, not a transformers checkpoint's (``model_type`` and no ``model`` section)."""
    if not isinstance(config, dict):
        raise RunError(f"{path} is a JSON {type(config).__name__}, not a run's config")
    if "model_type" in config and "model" not in config:
        raise RunError(
            f"{os.path.dirname(path) or '.'!r} is a transformers checkpoint (config.json with "
            f"model_type {config['model_type']!r}), not a run: import it with la-convert "
            "--from-hf into a new workdir"
        )


def prepare_workdir(workdir: str) -> None:
    """Create ``workdir`` (and parents) or check the existing one is a writable folder."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise RunError(f"workdir {workdir!r} exists and is not a folder")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise RunError(f"workdir {workdir!r} cannot be created: {e.strerror or e}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise RunError(f"workdir {workdir!r} is not writable")


def _process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (field 22 of
    ``/proc/<pid>/stat``), or None where it cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        # the command name (field 2) is in parentheses and may hold spaces or ')'
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _pid_reused(pid: int, recorded_start) -> bool:
    """Whether live process ``pid`` is not the one that started at ``recorded_start`` (False
    when either start time is unknown: the pid is then taken for the holder)."""
    if not isinstance(recorded_start, int) or not _pid_alive(pid):
        return False
    start = _process_start(pid)
    return start is not None and start != recorded_start


class WorkdirLock:
    """``with WorkdirLock(workdir, message=print):`` holds the workdir's lock (see the module
    docstring); raises `RunError` naming the holder if another live run has it."""

    def __init__(self, workdir: str, *, message=print):
        self.path = os.path.join(workdir, LOCK_NAME)
        self.message = message
        pid = os.getpid()
        self.owner = {
            "pid": pid,
            "pid_start": _process_start(pid),
            "hostname": socket.gethostname(),
        }
        self._held = False

    def _read_owner(self) -> dict | None:
        try:
            with open(self.path) as f:
                owner = json.load(f)
            return owner if isinstance(owner, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or damaged: treated as stale

    def _try_create(self) -> bool:
        tmp = f"{self.path}.{self.owner['hostname']}.{self.owner['pid']}"
        record = dict(self.owner, started=datetime.datetime.now(datetime.UTC).isoformat())
        try:
            with open(tmp, "w") as f:
                json.dump(record, f)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            return True
        except OSError as e:
            raise RunError(
                f"workdir {os.path.dirname(self.path)!r} is not writable: {e.strerror or e}"
            ) from None
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def acquire(self) -> None:
        for _ in range(3):  # a stale lock removed by a concurrent run too: try again
            if self._try_create():
                self._held = True
                return
            owner = self._read_owner()
            if owner is None:
                continue  # released meanwhile
            pid, host = owner.get("pid"), owner.get("hostname")
            if not isinstance(pid, int) or not isinstance(host, str):
                self.message(f"removed a damaged lock file {self.path}")
            elif host != self.owner["hostname"]:
                raise RunError(
                    f"workdir {os.path.dirname(self.path)!r} is in use by process {pid} on host "
                    f"{host!r} (lock {self.path}, since {owner.get('started', '?')}); if that "
                    "run is over, delete the lock file"
                )
            elif _pid_reused(pid, owner.get("pid_start")):
                self.message(
                    f"removed a stale lock of process {pid} from {self.path}: pid {pid} now "
                    f"belongs to another process (started at tick {_process_start(pid)}, the "
                    f"lock's holder at tick {owner['pid_start']})"
                )
            elif _pid_alive(pid):  # (our own pid too: a second lock in this process)
                raise RunError(
                    f"workdir {os.path.dirname(self.path)!r} is in use by another run "
                    f"(process {pid} on this host, since {owner.get('started', '?')}); wait for "
                    f"it to finish or use another workdir (if process {pid} is no training run, "
                    f"delete {self.path})"
                )
            else:
                self.message(
                    f"removed a stale lock of process {pid} (no longer running) from {self.path}"
                )
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        raise RunError(f"could not take the lock {self.path}: it keeps changing hands")

    def moved_to(self, workdir: str) -> None:
        """The locked folder was renamed to ``workdir`` (its lock file with it)."""
        self.path = os.path.join(workdir, LOCK_NAME)

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if not self._held:
            return
        self._held = False
        owner = self._read_owner() or {}
        if {k: owner.get(k) for k in self.owner} == self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


# ----------------------------------------------------------------------------- digests
def _files(step_dir: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(step_dir):
        dirnames.sort()
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), step_dir)
            if rel != DIGEST_NAME:
                out.append(rel)
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_digest(step_dir: str) -> None:
    """Record the size and SHA-256 of every file of ``step_dir`` (written atomically)."""
    files = {
        rel: {
            "size": os.path.getsize(os.path.join(step_dir, rel)),
            "sha256": _sha256(os.path.join(step_dir, rel)),
        }
        for rel in _files(step_dir)
    }
    tmp = os.path.join(step_dir, f"{DIGEST_NAME}.tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, DIGEST_NAME))


def verify_digest(step_dir: str) -> str | None:
    """``None`` if every file of ``step_dir`` matches its record, else what is wrong (naming the
    file)."""
    record_path = os.path.join(step_dir, DIGEST_NAME)
    try:
        with open(record_path) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return f"{record_path} is missing (an interrupted save, or one from before the record)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{record_path} is damaged ({type(e).__name__}: {e})"
    present = set(_files(step_dir))
    for rel, expected in sorted(files.items()):
        path = os.path.join(step_dir, rel)
        if rel not in present:
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != expected["size"]:
            what = "empty" if size == 0 else f"{size} bytes"
            return f"{path} is {what}, expected {expected['size']} bytes (truncated or replaced)"
        if _sha256(path) != expected["sha256"]:
            return f"{path} has changed (SHA-256 mismatch)"
    extra = sorted(present - set(files))
    if extra:
        return f"{os.path.join(step_dir, extra[0])} was not part of the saved checkpoint"
    return None

"""Checkpoints of the whole training state (parameters, optimizer state, step) with an orbax
`CheckpointManager`: one numbered folder per saved step under ``<workdir>/checkpoints``,
the newest ``keep`` kept. Saving is synchronous, so a checkpoint is complete on disk before
training goes on (and before its device buffers are donated to the next step).

A data pipeline with an iterator (the Grain loader) has its state saved in each step's folder
too (``data_iterator.process<i>.json``, one per process), so a resumed run continues the data
where the checkpoint left it.

Every saved step gets an integrity record (``<step>/integrity.json``, see `workdir`), checked
before a restore: `restore_latest` skips a damaged or incomplete step, names it and the damaged
file, moves it aside to ``checkpoints_damaged/`` (so the step is saved afresh when the run
reaches it again) and falls back to the newest intact one.

Beside the arrays, a step may hold ``meta.json``: a small JSON object the loop saves with it (the
run's timings so far), covered by the integrity record like every other file."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from linear_attention.training.workdir import RunError, verify_digest, write_digest

META_NAME = "meta.json"


def saved_steps(workdir: str) -> list[int]:
    """The checkpoint steps of the run in ``workdir`` (its ``checkpoints/<step>`` folders), oldest
    first, read from the folder names: cheap, for readers that only list (no orbax manager).
    Whether a step is intact is `Checkpoints.verify`'s answer (`load.restore_run` asks it)."""
    folder = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    return sorted(int(d) for d in os.listdir(folder) if d.isdigit())


def latest_saved_step(workdir: str) -> int:
    """The newest of `saved_steps` (ValueError naming the folder if there is none)."""
    steps = saved_steps(workdir)
    if not steps:
        folder = os.path.join(workdir, "checkpoints")
        raise ValueError(f"workdir {workdir!r} has no checkpoint yet (nothing in {folder})")
    return steps[-1]


@contextlib.contextmanager
def _stderr_held():
    """Hold back what is written to file descriptor 2 inside the block, and write it out after
    a block that succeeds. A write that fails inside orbax is reported by each of its writer
    threads with a traceback, some from C++ callbacks (no logger to quiet); the `RunError`
    raised instead says it in one line."""
    try:
        held = tempfile.TemporaryFile()
        saved = os.dup(2)
    except OSError:  # no room even for this: nothing is held back
        yield
        return
    sys.stderr.flush()
    os.dup2(held.fileno(), 2)
    ok = False
    try:
        yield
        ok = True
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if ok:
            held.seek(0)
            text = held.read()
            if text:
                sys.stderr.buffer.write(text)
                sys.stderr.flush()
        held.close()


def _settle(before: set, timeout: float = 5.0) -> None:
    """Wait (at most ``timeout`` s) for the threads started since ``before`` to end, then a
    little more for callbacks from threads Python does not list (tensorstore's)."""
    deadline = time.monotonic() + timeout
    for thread in set(threading.enumerate()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
    time.sleep(0.5)


def _drop_unretrieved(record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in record.getMessage()


def _quiet_failed_writers() -> None:
    """After a failed save, keep orbax's abandoned asyncio futures from printing their
    tracebacks when they are collected (at any later time, up to the interpreter's exit): each
    reports the write error the `RunError` already names. Collect what can be collected now,
    and filter the rest out of the ``asyncio`` logger."""
    gc.collect()
    logger = logging.getLogger("asyncio")
    if _drop_unretrieved not in logger.filters:
        logger.addFilter(_drop_unretrieved)


def _write_error(e: Exception) -> str:
    """What a failed write says, in one line: the OS error's text when there is one (orbax's
    tensorstore messages carry it as ``os_error_code='27'``)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    code = re.search(r"os_error_code='(\d+)'", str(e))
    if code:
        return os.strerror(int(code.group(1)))
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return first[:200]


class Checkpoints:
    def __init__(self, directory: str, *, keep: int):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self,
        step: int,
        state: nnx.State,
        meta: dict | None = None,
        *,
        data_state: dict | None = None,
    ) -> None:
        """Save ``state`` as step ``step`` (a no-op if that step is already saved), with
        ``meta`` (a JSON object) as ``meta.json`` and this process's data-iterator state
        ``data_state`` (JSON) when given: both go into the step's folder before the integrity
        record, so the record covers them."""
        if step in self.manager.all_steps():
            return
        need = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(state))
        free = shutil.disk_usage(self.directory).free
        if need > free:
            raise RunError(
                f"checkpoint step {step} needs about {need:,} bytes, {self.directory} has "
                f"{free:,} free; {self._kept()}: free space, then rerun to resume"
            )
        try:
            with _stderr_held():
                before = set(threading.enumerate())
                try:
                    self._save(step, state, meta, data_state)
                except Exception:
                    _settle(before)  # their reports still come in: held back too
                    _quiet_failed_writers()
                    raise
        except Exception as e:  # orbax raises ValueError / OSError from its writer threads
            self._remove_partial(step)
            raise RunError(
                f"checkpoint step {step} could not be written in {self.directory} "
                f"({_write_error(e)}); nothing of it is left, {self._kept()}: free space (or "
                "raise the file size limit), then rerun to resume"
            ) from None

    def _kept(self) -> str:
        last = self.latest_step()
        return (
            f"the last checkpoint (step {last}) is kept" if last else "there is no checkpoint yet"
        )

    def _remove_partial(self, step: int) -> None:
        """Remove what a failed save of ``step`` left: its folder and orbax's temporaries."""
        if jax.process_index() != 0:
            return
        for name in os.listdir(self.directory):
            if name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        self.manager.reload()

    def _save(self, step, state, meta, data_state) -> None:
        self.manager.save(step, args=ocp.args.StandardSave(nnx.to_pure_dict(state)), force=True)
        self.manager.wait_until_finished()
        if data_state is not None:
            path = self._data_state_path(step)
            with open(f"{path}.tmp", "w") as f:
                json.dump(data_state, f, sort_keys=True)
            os.replace(f"{path}.tmp", path)
            if jax.process_count() > 1:  # every process's file is in before the record
                multihost_utils.sync_global_devices(f"data_state_{step}")
        if jax.process_index() == 0:
            if meta is not None:
                with open(os.path.join(self.step_dir(step), META_NAME), "w") as f:
                    json.dump(meta, f, sort_keys=True)
            write_digest(self.step_dir(step))

    def _data_state_path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), f"data_iterator.process{jax.process_index()}.json")

    def data_state(self, step: int) -> dict | None:
        """This process's data-iterator state saved with step ``step`` (None if none was)."""
        path = self._data_state_path(step)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def meta(self, step: int) -> dict:
        """The ``meta`` saved with step ``step`` ({} if none: a step saved without it, or one
        whose meta is damaged, which `verify` names and `restore_latest` sets aside)."""
        try:
            with open(os.path.join(self.step_dir(step), META_NAME)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def verify(self, step: int) -> str | None:
        """``None`` if step ``step`` is intact, else what is wrong with it (naming the file)."""
        return verify_digest(self.step_dir(step))

    def restore_latest(self, abstract_state: nnx.State, *, message=print):
        """``(step, state)`` of the newest intact checkpoint, or ``(0, None)`` if there is none
        at all. Damaged or incomplete steps are reported through ``message`` and moved aside;
        if every step is damaged, raises `RunError` listing them."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        problems = []
        for step in steps:
            problem = self.verify(step)
            if problem is None:
                if problems:
                    aside = self._set_aside([s for s, _ in problems])
                    message(
                        f"moved the damaged step(s) {', '.join(str(s) for s, _ in problems)} to "
                        f"{aside}; falling back to step {step}, the newest intact checkpoint"
                    )
                return step, self.restore(step, abstract_state)
            problems.append((step, problem))
            message(f"checkpoint step {step} is damaged or incomplete: {problem}")
        if problems:
            listing = "; ".join(f"step {s}: {p}" for s, p in problems)
            raise RunError(
                f"no intact checkpoint in {self.directory} ({listing}); remove the damaged "
                "steps to start over, or use another workdir"
            )
        return 0, None

    def _set_aside(self, steps: list[int]) -> str:
        aside = os.path.join(os.path.dirname(self.directory), "checkpoints_damaged")
        if jax.process_index() == 0:
            os.makedirs(aside, exist_ok=True)
            for step in steps:
                target = os.path.join(aside, str(step))
                if os.path.exists(target):
                    shutil.rmtree(target)
                os.replace(self.step_dir(step), target)
        self.manager.reload()
        return aside

    def restore(self, step: int, abstract_state: nnx.State) -> nnx.State:
        """Restore step ``step`` into the structure, dtypes and shardings of ``abstract_state``
        (a State of `jax.ShapeDtypeStruct` with ``sharding`` set)."""
        target = nnx.to_pure_dict(abstract_state)
        # Compare the trees first: a restore into another tree fails part-way and leaves orbax's
        # pending reads to fail later, when garbage-collected (noise in whatever runs then).
        detail = self._tree_difference(step, target)
        if not detail:
            try:
                restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
            except (ValueError, KeyError, TypeError) as e:
                # The files are intact (checked) but hold another tree: the config changed.
                detail = str(e).strip().split("\n")[0] or type(e).__name__
        if detail:
            raise RunError(
                f"checkpoint step {step} in {self.directory} does not fit this config's "
                f"parameters and optimizer state ({detail}); the model or optimizer settings "
                "(e.g. config.optimizer.grad_clip on/off) changed since it was saved: resume "
                "with the same settings, or use another workdir"
            )
        state = jax.tree.map(lambda x: x, abstract_state)
        nnx.replace_by_pure_dict(state, restored)
        return state

    def _tree_difference(self, step: int, target) -> str:
        """The first array path (and shape) the checkpoint and ``target`` disagree on."""
        try:
            # The item's handler, not a `StandardCheckpointer`: the checkpointer looks for a
            # step-level `_CHECKPOINT_METADATA` inside the item folder and logs a warning on
            # every resume when it is not there (it never is: the manager writes it a level up).
            handler = ocp.StandardCheckpointHandler()
            try:
                saved = handler.metadata(epath.Path(self.step_dir(step), "default"))
            finally:
                handler.close()
            saved = getattr(saved, "item_metadata", saved)
            saved = getattr(saved, "tree", saved)
            flat = lambda tree: {  # noqa: E731
                "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(
                    getattr(x, "shape", ())
                )
                for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            }
            old, new = flat(saved), flat(target)
        except Exception:  # noqa: BLE001 (only used to word the message)
            return ""
        for path in sorted(set(old) | set(new)):
            if path not in new:
                return f"the checkpoint has {path}, this config's state has not"
            if path not in old:
                return f"this config's state has {path}, the checkpoint has not"
            if old[path] != new[path]:
                return f"{path} has shape {old[path]} in the checkpoint, {new[path]} here"
        return ""

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

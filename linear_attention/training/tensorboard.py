"""TensorBoard records of a run, in its workdir: scalar event files and an optional profiler trace.

``tensorboard --logdir runs/`` then shows every run by its folder name. The scalars are the
records of ``metrics.jsonl`` under the same names (``train/loss``, ``train/accuracy``, ``lr``,
``grad_norm``, ``tokens_per_sec``, ``eval/...``), written with `tensorboardX` (no TensorFlow).
A resumed run starts its event file with a purge at the first step it redoes, so TensorBoard
drops what the interrupted run logged past its checkpoint (each step is shown once). With
``config.train.profile_steps = n`` the n steps after the first (compiling) one are traced with
`jax.profiler` into ``<workdir>/plugins/profile/`` (TensorBoard's profile tab); the
``tokens_per_sec`` logged over those steps includes the tracer's overhead.
"""

from __future__ import annotations

import math
import time

import jax


class TensorBoardWriter:
    """Scalars of each record (every numeric field but ``step``) at the record's step."""

    def __init__(self, workdir: str, *, resume_step: int):
        # (imported here: tensorboardX imports torch where it is installed, 1.5 s of CPU that
        # a process importing the training package without training need not pay)
        from tensorboardX import SummaryWriter

        # The file name holds the time in seconds only: a suffix in ns keeps a quick rerun's
        # file apart from (and sorted after) the last one.
        self.writer = SummaryWriter(
            logdir=workdir,
            purge_step=resume_step + 1 if resume_step else None,
            flush_secs=10,
            filename_suffix=f".{time.time_ns()}",
        )

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value if math.isfinite(value) else math.nan, step)

    def close(self) -> None:
        self.writer.close()


class Profiler:
    """Traces the steps ``first + 1 .. first + num_steps`` (counted as completed steps)."""

    def __init__(self, log_dir: str, *, first: int, num_steps: int):
        self.log_dir, self.start, self.stop = log_dir, first, first + num_steps
        self.active = False

    def before_step(self, step: int) -> None:
        """Called before running step index ``step`` (which completes step ``step + 1``)."""
        if self.stop > self.start and step == self.start and not self.active:
            jax.profiler.start_trace(self.log_dir)
            self.active = True

    def after_step(self, done: int, outputs) -> str | None:
        """Called after step ``done`` completed; returns a message when the trace is written."""
        if self.active and done >= self.stop:
            self.close(outputs)
            return (
                f"profiled steps {self.start + 1}..{done}: trace in {self.log_dir}/plugins/profile"
            )
        return None

    def close(self, outputs=None) -> None:
        if self.active:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.active = False

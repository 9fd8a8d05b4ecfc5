"""Training points in worker processes (``--jobs N``), and the worker's side of the protocol.

The parent starts N workers (``python -m linear_attention.training.sweep --worker``, one XLA
thread each: these small models leave a second intra-op thread idle), each in its own session,
and sends them points on stdin, one pickled, base64 line each (config, run directory, decode
batch size); a worker answers each with one ``@@sweep-result {json}`` line on stdout (status
and seconds, or ``interrupted`` / ``error``). A setting's seeds go to one worker in a row (they
share its compiled step) unless another worker would sit idle: then it takes a waiting seed
(`PointQueue`). Only the parent writes results files.

Signals: SIGINT or SIGTERM reach the parent only (a terminal's Ctrl-C too: the workers are in
their own session). The handler only sets flags (no I/O in a handler, issue 23); the parent's
join loop forwards each signal once to the running workers, whose runs save a checkpoint and
report ``interrupted``; no new point starts, and `run_parallel` raises `SweepInterrupted`. A
second signal to a worker means "stop now, without a checkpoint".
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import linear_attention
from linear_attention.training.config import experiment_config
from linear_attention.training.sweep.grid import Point
from linear_attention.training.sweep.points import run_point

# Worker processes (--jobs N) run XLA on one thread each: these models are too small for
# XLA's intra-op threads to keep two cores busy (docs/studies/mqar.md).
WORKER_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
# A worker's answer line starts with this, so that anything else it prints is not mistaken for one.
_RESULT = "@@sweep-result "
# The package's folder first on the workers' path: they run the parent's code, installed or not.
PACKAGE_ROOT = str(Path(linear_attention.__file__).resolve().parents[1])
WORKER_COMMAND = (sys.executable, "-m", "linear_attention.training.sweep", "--worker")


def worker_main() -> int:
    """``python -m linear_attention.training.sweep --worker``: run the points sent on stdin
    (one pickled, base64 line each: config, run directory, decode batch size) and answer each
    with a result line."""
    try:
        for line in sys.stdin:
            cfg, run_dir, decode_batch_size = pickle.loads(base64.b64decode(line))
            start = time.perf_counter()
            try:
                status = run_point(
                    cfg, Path(run_dir), decode_batch_size=decode_batch_size, log=_quiet
                )
                result = {"status": status}
            except KeyboardInterrupt as e:  # the parent forwarded SIGINT (Interrupted: saved)
                result = {"interrupted": str(e) or "before training started"}
            except Exception as e:  # reported to the parent, which stops the sweep
                result = {"error": f"{type(e).__name__}: {e}"}
            result["seconds"] = time.perf_counter() - start
            print(_RESULT + json.dumps(result), flush=True)
            if "interrupted" in result:
                return 130
    except KeyboardInterrupt:  # between points: nothing to save
        return 130
    return 0


def _quiet(*_):
    pass


class PointQueue:
    """The points still to train, handed to the workers one at a time. A setting's
    ``replicate`` runs (its seeds) go to the worker that took its first one, in a row: they
    share that worker's compiled step (a seed changes no shape or constant), which saves a
    compilation each. A worker with nothing left in its setting takes the next setting; with
    none left either, it takes the last waiting seed of the setting with the most waiting,
    since a compilation costs less than an idle core (with fewer settings than workers, or at
    the end of a sweep, seeds kept together would run one after another on one core).
    Thread-safe: the workers' threads share one queue."""

    def __init__(self, points: list[Point], replicate: str | None = None):
        groups: dict[tuple, collections.deque] = {}
        for i, point in enumerate(points):
            key = tuple(sorted((k, v) for k, v in point.labels.items() if k != replicate))
            groups.setdefault(key, collections.deque()).append((i, point))
        self._settings = collections.deque(groups.values())
        self._held: dict[int, collections.deque] = {}  # worker -> the setting it is running
        self._lock = threading.Lock()

    def take(self, worker: int) -> tuple[int, Point] | None:
        """The next ``(index in points, point)`` for ``worker``, or None when none is left."""
        with self._lock:
            held = self._held.get(worker)
            if held:
                return held.popleft()
            if self._settings:
                held = self._held[worker] = self._settings.popleft()
                return held.popleft()
            others = [d for w, d in self._held.items() if w != worker and d]
            if not others:
                return None
            return max(others, key=len).pop()


class SweepInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the sweep; the runs in progress saved checkpoints."""


class SweepProgress:
    """Runs done and to go: `done()` after each run returns the line to log, ``N of M runs
    done, K to go (T s so far, about E s more)`` (the estimate: the mean time per run so far
    times the runs to go, divided by the workers)."""

    def __init__(self, total: int, *, workers: int = 1):
        self.total, self.workers, self.count = total, max(1, workers), 0
        self.start = time.perf_counter()

    def done(self) -> str:
        self.count += 1
        elapsed = time.perf_counter() - self.start
        left = self.total - self.count
        line = (
            f"sweep: {self.count} of {self.total} runs done, {left} to go ({elapsed:.0f} s so far"
        )
        if left:
            line += f", about {elapsed / self.count * left:.0f} s more"
        return line + ")"


def run_parallel(
    points: list[Point], runs_dir: Path, *, jobs: int, decode_batch_size: int, log, replicate=None
):
    """Train ``points`` in ``jobs`` worker processes (one XLA thread each); every worker
    writes only its points' run directories, this process writes every results file. The
    ``replicate`` runs (seeds) of a setting go to one worker, one after the other: they share
    its compiled step, unless another worker would sit idle (`PointQueue`)."""
    driver = _Driver(points, runs_dir, decode_batch_size, log, replicate)
    workers = _start_workers(min(jobs, len(points)))
    threads = [threading.Thread(target=driver.drive, args=(n, w)) for n, w in enumerate(workers)]
    try:
        with _forwarded_signals(workers, driver.interrupted) as forward:
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():  # a timed join lets the signal handler run
                    thread.join(0.1)
                    forward()
    finally:
        for worker in workers:
            worker.stdin.close()
            worker.wait()
    driver.raise_outcome()


class _Driver:
    """The parent's side of one parallel sweep, shared by one thread per worker: the queue of
    points, the errors and interruptions reported (either stops every thread from taking a
    new point) and the log."""

    def __init__(self, points, runs_dir: Path, decode_batch_size: int, log, replicate):
        self.points, self.runs_dir, self.log = points, runs_dir, log
        self.decode_batch_size = decode_batch_size
        self.todo = PointQueue(points, replicate)
        self.errors: list[str] = []
        self.interrupted: list[str] = []
        self.progress = SweepProgress(len(points))
        self.lock = threading.Lock()

    def drive(self, n: int, worker) -> None:
        """Worker ``n``'s thread: its points, one after another, until none is left or the
        sweep stops."""
        while not self.errors and not self.interrupted:
            job = self.todo.take(n)
            if job is None or not self.run_one(worker, *job):
                return

    def run_one(self, worker, i: int, point: Point) -> bool:
        """Send ``point`` to ``worker`` and log its result; False if it failed or was stopped."""
        result = self.exchange(worker, point)
        if "interrupted" in result:
            self.interrupted.append(f"{point.name}: {result['interrupted']}")
            return False
        if "error" in result:
            self.errors.append(f"{point.name}: {result['error']}")
            return False
        with self.lock:
            self.log(
                f"[{i + 1}/{len(self.points)}] {point.name}: {result['status']} in "
                f"{result['seconds']:.0f} s"
            )
            self.log(self.progress.done())
        return True

    def exchange(self, worker, point: Point) -> dict:
        """The worker's answer to ``point`` (its result line, or what its exit means)."""
        job = (
            experiment_config(point.config),
            str(self.runs_dir / point.name),
            self.decode_batch_size,
        )
        worker.stdin.write(base64.b64encode(pickle.dumps(job)).decode() + "\n")
        worker.stdin.flush()
        for line in worker.stdout:
            if line.startswith(_RESULT):
                return json.loads(line[len(_RESULT) :])
        code = worker.wait()
        if self.interrupted:  # stopped by the forwarded signal before it could report
            return {"interrupted": f"worker exited (code {code})"}
        return {"error": f"worker exited (code {code})", "seconds": 0.0}

    def raise_outcome(self) -> None:
        """RuntimeError if a worker failed, `SweepInterrupted` if a signal stopped the sweep."""
        if self.errors:
            raise RuntimeError("sweep worker failed: " + "; ".join(self.errors))
        if self.interrupted:
            runs = [i for i in self.interrupted if ": " in i]
            raise SweepInterrupted("; ".join(runs) or "before any run reported")


def _start_workers(count: int) -> list[subprocess.Popen]:
    """``count`` worker processes on one XLA thread each, running this process's package.
    Each in its own session: a Ctrl-C at the terminal reaches this process only, which
    forwards it once (a second signal to a worker means "stop now, without a checkpoint")."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {WORKER_XLA_FLAGS}".strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return [
        subprocess.Popen(
            list(WORKER_COMMAND),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for _ in range(count)
    ]


@contextlib.contextmanager
def _forwarded_signals(workers: list[subprocess.Popen], interrupted: list[str]):
    """SIGINT and SIGTERM caught while inside; yields ``forward()``, which sends each signal
    caught since its last call to the running workers. The handler only sets flags (no I/O in
    a handler, issue 23) and stops new points (``interrupted``); the old handlers come back
    on exit."""
    received = []  # signals caught and not yet forwarded

    def on_signal(signum, _frame):
        received.append(signum)
        interrupted.append(signal.Signals(signum).name)  # no new points from here on

    def forward():
        while received:
            signum = received.pop(0)
            for worker in workers:
                if worker.poll() is None:
                    worker.send_signal(signum)

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield forward
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

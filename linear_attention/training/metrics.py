"""Run records: ``metrics.jsonl`` (one flat JSON object per logged step), JSON files, and the
console report (a one-line progress bar on a terminal, plain log lines otherwise)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import IO

from linear_attention.data.files import write_atomic
from linear_attention.training.workdir import RunError


def write_json(path: str, obj) -> None:
    """Write ``obj`` atomically (a half-written file never replaces a good one; a failed write
    leaves no temporary)."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_jsonl(path: str, *, message=None) -> list[dict]:
    """The records of a JSON-lines file ([] if it does not exist). A damaged *last* line (a
    write cut short by a kill) is dropped, with a note through ``message`` if given; a damaged
    line before it raises `RunError` naming the file and line."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    records = []
    for n, (lineno, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as e:
            if n == len(numbered) - 1:
                if message is not None:
                    shown = line if len(line) <= 60 else line[:57] + "..."
                    message(f"{path}: dropped a half-written last line {lineno} ({shown!r})")
                break
            raise RunError(f"{path} line {lineno} is damaged ({e}): {line[:80]!r}") from None
        records.append(record)
    return records


def _clean(value):
    # JSON has no NaN/Inf; write them as strings so the file stays valid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Appends records to ``metrics.jsonl``. On resume from step ``s`` the records after ``s``
    (written by the interrupted run past its last checkpoint) are dropped first, so each step
    appears once; so is a half-written last line (see `read_jsonl`)."""

    def __init__(self, path: str, *, resume_step: int, message=None):
        self.path = path
        kept = [r for r in read_jsonl(path, message=message) if r.get("step", 0) <= resume_step]
        with open(path, "w") as f:
            for record in kept:
                f.write(json.dumps(record, sort_keys=True) + "\n")

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=True) + "\n")

    def close(self) -> None:
        """Nothing to release: every write opens and closes the file."""


def _fmt(record: dict) -> str:
    parts = []
    for key, label, fmt in (
        ("train/loss", "loss", "{:.4f}"),
        ("train/accuracy", "acc", "{:.3f}"),
        ("eval/loss", "eval loss", "{:.4f}"),
        ("eval/accuracy", "eval acc", "{:.4f}"),
        ("eval/bits_per_byte", "eval bpb", "{:.3f}"),
        ("lr", "lr", "{:.2e}"),
        ("tokens_per_sec", "tok/s", "{:,.0f}"),
    ):
        if key in record:
            parts.append(f"{label} {fmt.format(record[key])}")
    return " | ".join(parts)


class Reporter:
    """Console output. On a terminal: a progress bar redrawn in place; eval results and
    messages on their own lines. Otherwise: one log line per record."""

    def __init__(self, num_steps: int, stream: IO[str] | None = None, tty: bool | None = None):
        self.num_steps = num_steps
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._bar_shown = False
        self._start = time.perf_counter()

    def message(self, text: str) -> None:
        self._end_bar()
        print(text, file=self.stream, flush=True)

    def record(self, record: dict) -> None:
        step = record["step"]
        if not self.tty:
            print(f"step {step}/{self.num_steps} | {_fmt(record)}", file=self.stream, flush=True)
            return
        if any(k.startswith("eval/") for k in record):
            evals = {k: v for k, v in record.items() if k.startswith("eval/")}
            self.message(f"eval at step {step}: {_fmt(evals)}")
        train = {k: v for k, v in record.items() if not k.startswith("eval/")}
        if len(train) > 1:
            width = 30
            done = int(width * step / max(self.num_steps, 1))
            bar = "#" * done + "-" * (width - done)
            elapsed = time.perf_counter() - self._start
            line = f"\r[{bar}] {step}/{self.num_steps} {elapsed:6.0f}s | {_fmt(train)}"
            print(line, end="", file=self.stream, flush=True)
            self._bar_shown = True

    def _end_bar(self) -> None:
        if self._bar_shown:
            print(file=self.stream, flush=True)
            self._bar_shown = False

    def close(self) -> None:
        self._end_bar()


class Progress:
    """Progress of long work that is not a training run (tokenizing, a sweep): on a terminal one
    line redrawn in place (at most every ``interval`` seconds, and at the end); otherwise a plain
    line at each tenth of ``total`` (or every ``interval`` seconds when the total is unknown),
    so a log keeps a few lines, not thousands. ``update(done, total)``; ``close()`` ends the
    line. ``unit`` names what is counted; work whose total is below ``min_total`` is quick and
    shows nothing."""

    def __init__(
        self,
        label: str,
        *,
        unit: str = "",
        stream: IO[str] | None = None,
        tty: bool | None = None,
        interval: float = 0.5,
        min_total: float = 0,
    ):
        self.label, self.unit, self.min_total = label, unit, min_total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval if self.tty else max(interval, 30.0)
        self._start = self._last = time.perf_counter()
        self._tenth, self._shown = -1, False

    def _text(self, done: float, total: float | None) -> str:
        unit = f" {self.unit}" if self.unit else ""
        elapsed = time.perf_counter() - self._start
        if not total:
            return f"{self.label}: {done:,.0f}{unit} ({elapsed:.0f}s)"
        return (
            f"{self.label}: {done:,.0f}/{total:,.0f}{unit} "
            f"({100.0 * done / total:.0f}%, {elapsed:.0f}s)"
        )

    def update(self, done: float, total: float | None = None) -> None:
        if total is not None and total < self.min_total:
            return
        now = time.perf_counter()
        end = bool(total) and done >= total
        if self.tty:
            if end or now - self._last >= self.interval or not self._shown:
                print(f"\r{self._text(done, total)}\x1b[K", end="", file=self.stream, flush=True)
                self._shown, self._last = True, now
            return
        if total:
            tenth = int(10 * min(done, total) // total)
            if tenth > self._tenth:
                self._tenth = tenth
                print(self._text(done, total), file=self.stream, flush=True)
        elif now - self._last >= self.interval:
            self._last = now
            print(self._text(done, total), file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self._shown:
            print(file=self.stream, flush=True)
            self._shown = False


class Throughput:
    """Training time and speed of a run, over all of its sessions.

    The first step of each session compiles: its time is ``compile_seconds``, not training
    time. Between two `lap` calls the loop's steps are timed together (a step's time is only
    known once its outputs are fetched), and `pause` / `lap` keep evaluation and checkpoint time
    out. `totals` is saved with each checkpoint and given back on resume, so the figures of a
    resumed run count every earlier session up to the checkpoint it resumed (the steps an
    interrupted session ran past its last checkpoint are run again, and counted once)."""

    def __init__(self, tokens_per_step: int, totals: dict | None = None, *, started: float):
        """``started``: the session's start (`time.perf_counter`), for the wall time."""
        totals = totals or {}
        self.tokens_per_step = tokens_per_step
        self.steps = int(totals.get("timed_steps", 0))
        self.seconds = float(totals.get("train_time_sec", 0.0))
        self.compile_seconds = float(totals.get("compile_time_sec", 0.0))
        self.earlier_wall = float(totals.get("wall_time_sec", 0.0))
        self.log_steps, self.log_seconds = 0, 0.0
        self._session_start, self._mark = started, time.perf_counter()
        self._timed, self._compiled = 0, False

    def stepped(self) -> None:
        """One step was dispatched; the session's first must have finished (it compiled)."""
        if self._compiled:
            self._timed += 1
            return
        now = time.perf_counter()
        self.compile_seconds += now - self._mark
        self._mark, self._compiled = now, True

    def lap(self) -> None:
        """The steps since the last lap are done (their outputs fetched): count their time."""
        seconds = time.perf_counter() - self._mark
        self.log_steps, self.log_seconds = self.log_steps + self._timed, self.log_seconds + seconds
        self.steps, self.seconds = self.steps + self._timed, self.seconds + seconds
        self._timed = 0

    def restart(self) -> None:
        """Training goes on: what happened since the last lap (eval, checkpoint) is not timed."""
        self._mark = time.perf_counter()

    def interval(self) -> dict[str, float]:
        """``tokens_per_sec`` since the last call (none when the interval held only the
        compiling first step), and a new interval."""
        out = {}
        if self.log_steps:
            out["tokens_per_sec"] = self.log_steps * self.tokens_per_step / self.log_seconds
        self.log_steps, self.log_seconds = 0, 0.0
        return out

    def totals(self) -> dict[str, float]:
        """The run's figures so far, over all sessions (saved with each checkpoint)."""
        return {
            "timed_steps": self.steps,
            "train_time_sec": self.seconds,
            "compile_time_sec": self.compile_seconds,
            "wall_time_sec": self.earlier_wall + time.perf_counter() - self._session_start,
        }

    def summary(self) -> dict[str, float]:
        """The summary's timings over all sessions; none when no step was ever timed (never a
        0.0 from a rerun that trained nothing)."""
        totals = self.totals()
        if not self.steps:
            return {"wall_time_sec": totals["wall_time_sec"]}
        return {
            "compile_time_sec": self.compile_seconds,
            "timed_steps": self.steps,
            "train_time_sec": self.seconds,
            "tokens_per_sec": self.steps * self.tokens_per_step / self.seconds,
            "wall_time_sec": totals["wall_time_sec"],
        }

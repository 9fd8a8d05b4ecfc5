"""SIGINT and SIGTERM during training: the loop finishes its step and saves a checkpoint
(`StopSignals`), then stops with `Interrupted`; while the run is built, before its first step,
they stop it (nothing trained). Before that, from the start of ``la-train``
(`keep_ignored_interrupts`, `honour_interrupts`), Ctrl-C stops it too, also where the process
was started with SIGINT ignored."""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (at run time this module imports nothing heavy: `honour_interrupts`)
    from linear_attention.training.metrics import Reporter


# A SIGINT kept by `keep_ignored_interrupts` until `honour_interrupts` acts on it.
_kept: list[str] = []


def keep_ignored_interrupts() -> None:
    """Where the process started with SIGINT ignored (a shell script's background job inherits
    that), keep a SIGINT from now on instead, for `honour_interrupts` to act on: called by
    ``la-train`` before it loads JAX (seconds), so that a Ctrl-C then is not lost. Kept, not
    raised: a `KeyboardInterrupt` raised while JAX loads can abort the process inside its C++
    initialisation, and one raised in a garbage-collection callback is dropped. A second
    SIGINT raises at once. Only in the main thread (elsewhere signals cannot be caught)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, _keep)


def _keep(signum, frame):
    if _kept:  # a second one: do not wait any longer
        raise KeyboardInterrupt
    _kept.append(signal.Signals(signum).name)


def honour_interrupts() -> None:
    """From now on SIGINT (Ctrl-C) raises `KeyboardInterrupt`, as in any Python program, also
    where it was ignored when the process started; raises it now for one kept since
    `keep_ignored_interrupts`. Only in the main thread."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _kept:
        _kept.clear()
        raise KeyboardInterrupt


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run; a checkpoint at ``step`` was saved first."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"{signal_name} at step {step}: checkpoint saved")
        self.step = step


class StopSignals:
    """While active (from the start of a run's building), SIGINT and SIGTERM set ``received``
    instead of killing the process, so the loop can finish its step and save a checkpoint, or
    the run stops before its first step (`stop_before_training`); a second signal stops at
    once. Only in the
    main thread (elsewhere signals cannot be caught, and nothing changes)."""

    def __init__(self, reporter: Reporter):
        self.reporter, self.received, self._previous = reporter, None, {}
        self._announced = False

    def _handle(self, signum, frame):
        # Only set a flag: a handler that writes to a stream the loop is writing to raises
        # "reentrant call" (issue 23), so the loop prints the message (`announce`).
        if self.received is not None:  # a second signal: do not wait any longer
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def stop_before_training(self) -> None:
        """Called when the run is built, before its first step: a signal so far stops it now,
        with nothing trained (`KeyboardInterrupt`)."""
        if self.received is not None:
            raise KeyboardInterrupt

    def announce(self) -> None:
        """Called by the loop between steps: says once that a signal arrived."""
        if self.received is not None and not self._announced:
            self._announced = True
            self.reporter.message(
                f"{self.received} received: saving a checkpoint after this step "
                "(send it again to stop now)"
            )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

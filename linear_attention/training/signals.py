"""SIGINT and SIGTERM during training: the loop finishes its step and saves a checkpoint
(`StopSignals`), then stops with `Interrupted`. Before the loop, from the start of ``la-train``
(`honour_interrupts`), Ctrl-C stops the run at once (nothing has been trained)."""

from __future__ import annotations

import signal
import threading

from linear_attention.training.metrics import Reporter


def honour_interrupts() -> None:
    """From now on SIGINT (Ctrl-C) raises `KeyboardInterrupt`, also where the process was
    started with SIGINT ignored (a background job of a shell script inherits that): otherwise
    a Ctrl-C before the loop's `StopSignals` is lost and the run trains to its end. Only in
    the main thread (elsewhere signals cannot be caught)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run; a checkpoint at ``step`` was saved first."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"{signal_name} at step {step}: checkpoint saved")
        self.step = step


class StopSignals:
    """While active, SIGINT and SIGTERM set ``received`` instead of killing the process, so the
    loop can finish its step and save a checkpoint; a second signal stops at once. Only in the
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

"""SIGTERM or SIGINT during work with nothing to save (a dry run, a `--fit` search): one line on
stderr and the signal's exit status, at once.

Two things stand in the way. libtpu, once loaded (a compile for a TPU target), installs its own
handler, which prints a native crash report with a stack trace; so the handlers are installed
again after libtpu is loaded (the function `exit_on_signal` yields). And a Python handler runs
only when the main thread runs Python, which it does not during an XLA compile (seconds to
minutes); so the signal is also read through `signal.set_wakeup_fd`: the C-level handler writes
its number to a pipe, and a waiting thread (XLA releases the GIL while it compiles) prints the
line and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_LOCK = threading.Lock()


def _stop(program: str, signum: int) -> None:
    with _LOCK:  # (the thread and the main thread's handler may both get here)
        name = signal.Signals(signum).name
        try:
            print(f"{program}: stopped by {name} (nothing was written)", file=sys.stderr)
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)


def _wait(program: str, read_fd: int) -> None:
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while data := pipe.read(1):  # (b"" once the write end is closed: done)
            if data[0] in {int(s) for s in SIGNALS}:
                _stop(program, data[0])


@contextlib.contextmanager
def exit_on_signal(program: str):
    """While active, SIGTERM and SIGINT end the process with one ``<program>: stopped by
    SIGTERM`` line (exit 128 + the signal's number). Yields a function that installs the
    handlers again, for after something that installs its own (libtpu). Main thread only
    (elsewhere nothing changes); the previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    threading.Thread(target=_wait, args=(program, read_fd), daemon=True).start()
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def install():
        for sig in SIGNALS:
            signal.signal(sig, lambda signum, frame: _stop(program, signum))

    install()
    try:
        yield install
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        os.close(write_fd)

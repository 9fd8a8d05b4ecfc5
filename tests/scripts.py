"""Helpers for tests: load a script or config file of the checkout (experiments/, configs/) as
a module, and wait on subprocesses with room for a loaded machine."""

import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A deadline in a test catches a hang, not slowness: the suite must pass on a machine loaded
# many times over (8 jobs on 2 cores), where one subprocess's JAX start and compilations take
# minutes. Every wait on a subprocess or a condition gets this much room (seconds); it never
# makes a passing test slower, since the waits end as soon as their condition holds.
DEADLINE_S = float(os.environ.get("LA_TEST_DEADLINE_S", 1800))


def load_module(relative_path: str, name: str):
    """Execute `ROOT/relative_path` as module `name` (registered, so dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wait_until(condition, proc, what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll `condition()` until it holds, while `proc` (a `subprocess.Popen`) runs. Fails with
    the process's output if it exits first, or after `deadline_s` (a hang) naming `what`."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {deadline_s:.0f} s")
        time.sleep(0.2)

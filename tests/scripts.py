"""Helpers for tests: load a script or config file of the checkout (experiments/, configs/) as
a module, run code on N forced CPU devices in a subprocess, and wait on subprocesses with room
for a loaded machine."""

import importlib.util
import os
import subprocess
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


def run_on_cpu_devices(code: str, devices: int, *args: str) -> str:
    """Run ``python -c code args...`` from the checkout's root with ``devices`` forced CPU devices
    (a mesh needs them before JAX starts, hence the subprocess); its stdout. Fails with the end
    of its stderr if it exits non-zero, or, after `DEADLINE_S`, with what it printed so far."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"still running after {e.timeout} s: {e.stdout}") from None
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def checked_names(stdout: str) -> list[str]:
    """The names a check script printed as ``CHECKED <name>`` lines, in order."""
    return [line.split(" ", 1)[1] for line in stdout.splitlines() if line[:8] == "CHECKED "]

"""A new user's machine without a TPU, where the test extras installed libtpu (issue 75): the
`la-*` programs start without libtpu's error lines unless JAX_PLATFORMS is set, a compile for a
TPU target stays quiet too, and SIGTERM during a dry run ends it with one line instead of
libtpu's native crash report."""

import os
import signal
import subprocess
import sys

import pytest

from linear_attention.training import gpu_target, platforms, tpu_target
from linear_attention.training.quit_signals import exit_on_signal
from tests.scripts import DEADLINE_S, ROOT, wait_until

LIBTPU_ERRORS = ("Failed to find host bounds", "unexpected worker hostname", "received by PID")
# What jaxlib prints at each load of the CUDA plugin (the gpu-compile extra) without a GPU.
CUDA_DRIVER_LINES = ("Could not find cuda drivers", "cudart_stub")
no_accelerator = pytest.mark.skipif(
    platforms.tpu_attached() or platforms.gpu_attached(),
    reason="a TPU or GPU is attached: JAX's platforms are left alone",
)


def user_env() -> dict:
    """The environment of a user who set no JAX_PLATFORMS (the suite sets it in conftest)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_quiet_platforms_only_where_nothing_is_attached(monkeypatch):
    monkeypatch.setattr(platforms, "gpu_attached", lambda: False)
    environ = {"JAX_PLATFORMS": "tpu"}
    assert not platforms.quiet_platforms(environ) and environ == {"JAX_PLATFORMS": "tpu"}
    environ = {"TPU_ACCELERATOR_TYPE": "v5litepod-4"}  # a TPU VM says what it is
    assert not platforms.quiet_platforms(environ) and "JAX_PLATFORMS" not in environ
    monkeypatch.setattr(platforms, "tpu_attached", lambda environ: False)
    environ = {}
    assert platforms.quiet_platforms(environ) and environ == {"JAX_PLATFORMS": "cpu"}


@no_accelerator
def test_a_dry_run_prints_no_libtpu_errors():
    """A dry run starts a backend (the help text does not: nothing to see there)."""
    proc = subprocess.run(
        [sys.executable, "-m", "linear_attention.training.cli", "--dry_run"]
        + ["--config", "configs/mqar.py:cpu", "--config.model.num_layers=1"],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 0 and '"parameters"' in proc.stdout
    assert not [e for e in LIBTPU_ERRORS + CUDA_DRIVER_LINES if e in proc.stderr], proc.stderr


@no_accelerator
@pytest.mark.skipif(gpu_target.cuda_missing() is not None, reason="needs the gpu-compile extra")
def test_a_gpu_target_restarts_la_train_with_the_cuda_plugin():
    """la-train keeps the CUDA plugin out (no driver lines); given a GPU target it starts itself
    again with the plugin, once, and compiles for it."""
    proc = subprocess.run(
        [sys.executable, "-m", "linear_attention.training.cli", "--dry_run"]
        + ["--config", "configs/mqar.py:smoke", "--config.mesh.target=gpu:h100:1"],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('"mesh": {\n') == 1  # the config, printed by the restarted run only
    assert '"compiler": "XLA:GPU"' in proc.stdout and '"gpu:h100:1"' in proc.stdout


SIGNALLED = """
import sys, time
from linear_attention.training.platforms import quiet_platforms
from linear_attention.training.targets import parse_target
from linear_attention.training.quit_signals import exit_on_signal
quiet_platforms()
with exit_on_signal("la-test") as reinstall:
    parse_target("tpu:v5e:2x2").devices()  # libtpu's handlers
    reinstall()
    print("READY", flush=True)
    time.sleep(600)
"""


@no_accelerator
@pytest.mark.skipif(tpu_target.libtpu_missing() is not None, reason="needs libtpu")
def test_sigterm_after_libtpu_loaded_is_one_line():
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED],
        cwd=ROOT,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    wait_until(lambda: lines.append(proc.stdout.readline()) or "READY" in lines[-1], proc, "READY")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "la-test: stopped by SIGTERM (nothing was written)"
    assert not [e for e in LIBTPU_ERRORS if e in err], err


def test_handlers_come_back_after_the_dry_run():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with exit_on_signal("la-test"):
        assert signal.getsignal(signal.SIGINT) is not before[0]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before

"""Suite-wide fixtures and settings."""

import os

# The suite's shapes are tiny, so its time is mostly XLA compiling: LLVM's optimisation level 0
# took tests/kernels/test_linear.py from 154 s to 114 s wall (user CPU 220 s to 148 s) on the
# 2-core machine (the whole default run: 19.7 to 15.5 min). It changes how the CPU code is
# generated, so results move by rounding: one tolerance was raised for it (the packed hybrid's
# split-vs-unsplit gradient in tests/training/test_sequence_parallel.py, 1.9e-5 at the default
# level, 1.15e-4 here). Set before JAX creates its backend; subprocesses inherit it; a level
# already in XLA_FLAGS is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
# XLA:CPU's older loop emitters for fusions instead of its MLIR fusion emitters, whose compile
# time dominates the suite's many small programs: tests/models/test_model.py took 153.8 s of
# user CPU with them and 81.6 s without, on the 2-core machine. Like the level above it changes
# only how the CPU code is generated; a setting already in XLA_FLAGS is kept.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false"
    ).strip()
# The test extras bring libtpu (TPU compile tests), and on a machine without a TPU its plugin
# prints initialisation warnings to stderr whenever a backend starts, which tests reading a
# subprocess's stderr would see. The suite runs on the CPU: JAX_PLATFORMS=cpu (inherited by
# subprocesses) keeps the plugin from starting; compiling for a TPU topology does not need it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# The test extras bring jax's CUDA plugin too (GPU compile tests), and without a GPU jaxlib
# prints "cudart_stub: Could not find cuda drivers" as it loads it, past pytest's capture. The
# suite keeps the plugin (tests/training/test_gpu_target.py compiles with it), so the import
# below runs with stderr in a file, and every line but those goes on to stderr.
_DRIVER_LINES = re.compile(r"cudart_stub|before absl::InitializeLog")
sys.stderr.flush()
_stderr = os.dup(2)
with tempfile.TemporaryFile() as _held:
    os.dup2(_held.fileno(), 2)
    try:
        import jax
    finally:
        os.dup2(_stderr, 2)
        os.close(_stderr)
        _held.seek(0)
        _lines = _held.read().decode(errors="replace").splitlines(keepends=True)
        sys.stderr.write("".join(line for line in _lines if not _DRIVER_LINES.search(line)))


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Drop compiled executables between test modules.

    A full default run compiles thousands of small programs in one process; late in that run
    (~75 %, in tests/models) XLA's CPU compiler segfaulted twice while each module alone
    passes. Clearing the caches per module keeps the process's compiled code bounded.
    """
    jax.clear_caches()
    yield

"""The CUDA plugin stays out of a ``la-*`` program that has no GPU and compiles for none.

The ``gpu-compile`` extra (part of ``test``) installs jax's CUDA plugin so that XLA:GPU can
compile for a GPU target from any machine (`gpu_target`). jaxlib loads the plugin's libraries
when jax is imported and its PJRT plugin when the backends start, and on a machine without a
GPU every load prints "cudart_stub.cc: Could not find cuda drivers on your machine" (6 to 8
lines a process; no log setting silences them). So each ``la-*`` program calls `hide` before it
imports jax: where no GPU device node is present and ``LA_CUDA_PLUGIN`` is not set, jax sees no
CUDA plugin (jaxlib's import of its extension fails as when it is absent, and the PJRT plugin
module is one whose start does nothing). A GPU target needs the plugin, so ``la-train`` given
one in a process that hid it starts itself again with ``LA_CUDA_PLUGIN=1`` (`restart`).

This module imports nothing that imports jax: it must run before jax is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

ENV = "LA_CUDA_PLUGIN"
# The device nodes of an attached GPU (NVIDIA, WSL's, AMD's): there the plugin is the runtime.
GPU_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
# jaxlib's CUDA extensions and the PJRT plugins that register the CUDA backend, newest first.
_EXTENSIONS = ("jax_cuda13_plugin", "jax_cuda12_plugin")
_PJRT = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def gpu_attached() -> bool:
    """Whether a GPU's device node is present."""
    return any(os.path.exists(node) for node in GPU_DEVICE_NODES)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def hide(environ=os.environ) -> bool:
    """Keep jax from loading the CUDA plugin in this process, unless jax is imported already, a
    GPU is attached, ``LA_CUDA_PLUGIN`` is set, or no plugin is installed. True if hidden."""
    if "jax" in sys.modules or environ.get(ENV) or gpu_attached():
        return False
    if not any(_installed(name) for name in _PJRT):
        return False
    for name in _EXTENSIONS:
        sys.modules[name] = None  # an import of it raises ImportError, as when not installed
    for name in _PJRT:
        stub = types.ModuleType(name, "The CUDA plugin, hidden (linear_attention.cuda_plugin).")
        stub.initialize = lambda: None
        sys.modules[name] = stub
    return True


def hidden() -> bool:
    """Whether `hide` hid the CUDA plugin in this process."""
    return any(name in sys.modules and sys.modules[name] is None for name in _EXTENSIONS)


def restart() -> None:
    """Start this program again, with its arguments, in a process that loads the plugin."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, ENV: "1"})

"""Quiet starts on machines without a TPU, where libtpu is installed (the test extras bring it).

JAX, left to choose its platforms, starts every plugin it finds. libtpu's, on a machine without
TPU chips, looks for its slice, fails, and prints error lines ("Failed to find host bounds for
accelerator type", "unexpected worker hostname") before JAX falls back to the CPU. The `la-*`
programs therefore call `quiet_platforms` first: where no TPU and no GPU is attached and the
user set no `JAX_PLATFORMS`, JAX gets "cpu" (the platform it would end on anyway). Wherever a
TPU or GPU is attached, or `JAX_PLATFORMS` is set, nothing changes.

Compiling for a TPU target from such a machine (`tpu_target.topology_devices`) loads libtpu on
purpose; `quiet_libtpu` gives it the one-host answers it would print that it failed to find
(`TPU_HOST_BOUNDS`, `TPU_WORKER_HOSTNAMES`, unless set), which do not enter a deviceless compile:
the target names its own topology.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import jax

from linear_attention.training.cuda_plugin import gpu_attached

# TPU chips: Google's PCI vendor id with these device ids (v3, v4, v5p, v5e, v6e, TPU7x and
# one without a public name), as JAX's own detection (`jax._src.hardware_utils`) lists them;
# a chip of a newer generation still shows as a TPU device node (/dev/accel*, /dev/vfio/N).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
TPU_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*")
# Set on TPU VMs (and by users who point libtpu at a slice): a TPU is meant, whatever is seen.
TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def tpu_attached(environ=os.environ) -> bool:
    """Whether this machine has (or is told it has) TPU chips."""
    if any(environ.get(name) for name in TPU_ENV):
        return True
    if any(glob.glob(pattern) for pattern in TPU_DEVICE_NODES):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        if _read(vendor) == GOOGLE_PCI_VENDOR:
            if _read(os.path.join(os.path.dirname(vendor), "device")) in TPU_PCI_DEVICES:
                return True
    return False


def quiet_platforms(environ=os.environ) -> bool:
    """Run on the CPU (`JAX_PLATFORMS=cpu`, also for subprocesses) where no TPU or GPU is
    attached and `JAX_PLATFORMS` is unset; before JAX starts a backend. Whether it did."""
    if "JAX_PLATFORMS" in environ or tpu_attached(environ) or gpu_attached():
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")  # (JAX read the variable when it was imported)
    return True


def quiet_libtpu(environ=os.environ) -> None:
    """Before libtpu loads for a deviceless compile on a machine without TPU chips: the answers
    of one host, which libtpu otherwise fails to find and reports as errors."""
    if tpu_attached(environ):
        return
    environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

"""Compiling for NVIDIA GPUs from any machine: ``config.mesh.target = "gpu:<chip>:<count>"`` or
``"gpu:<chip>:<hosts>x<per_host>"`` (a `target_base.Target`).

The CUDA PJRT plugin (``pip install 'linear_attention[gpu-compile]'``: ``jax-cuda12-plugin``,
``jax-cuda12-pjrt`` and ``nvidia-cuda-nvcc-cu12``, whose ``ptxas`` turns XLA's PTX into the
chip's code) describes GPUs without owning one:
``get_topology_desc(platform="cuda", target_config=..., topology="1x<hosts>x<per_host>")``
gives compile-only devices of the chip that the ``GpuTargetConfig`` text describes
(`gpu_chips.target_config`, made here from the chip's published facts), and
``jit(f).trace(...).lower().compile()`` runs XLA:GPU and ``ptxas`` for it (``sm_90a`` on an
H100). On a machine without a GPU the plugin loads only where jax's platforms were set before
its backends started (``JAX_PLATFORMS=cpu``; the ``la-*`` programs set it there:
`platforms.quiet_platforms`): its start-up check of the CUDA libraries fails otherwise.

XLA:GPU compiles a program of any size (it checks no memory), and without a GPU it cannot
autotune: the figures are its defaults'. A step fits where the bytes it holds at its peak
(arguments + outputs − aliases + temporaries, `target_base.step_bytes`) are at most the chip's
memory (``cudaDeviceProp.totalGlobalMem``). jax's allocator may hold a process to less: by
default it preallocates a share of the memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``), and NCCL's
buffers and the CUDA context take some outside XLA's figures; leave room (`sizing.dry_run`'s
``hbm_limit``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re

import jax

from linear_attention.training import cuda_plugin
from linear_attention.training.gpu_chips import CHIPS, Chip, target_config
from linear_attention.training.target_base import Target, first_line

GPU_FORMS = (
    "'gpu:<chip>:<count>' or 'gpu:<chip>:<hosts>x<per_host>' with a chip of "
    f"{', '.join(CHIPS)} and at most {min(c.per_host for c in CHIPS.values())} GPUs a host "
    "(a count above it: whole hosts of it) (gpu:h100:1, gpu:h100:8, gpu:h100:2x8, gpu:h200:8)"
)
_TARGET = re.compile(r"gpu:([a-z0-9]+):([1-9][0-9]*)(?:x([1-9][0-9]*))?")
INSTALL = "pip install 'linear_attention[gpu-compile]'"
# The CUDA plugins jax knows, newest first: the module that registers one, its distribution.
_PLUGINS = (
    ("jax_plugins.xla_cuda13", "jax-cuda13-plugin"),
    ("jax_plugins.xla_cuda12", "jax-cuda12-plugin"),
)
# Where jax looks for ptxas when CUDA_ROOT is not set: the pip packages of nvcc.
_NVCC = (("nvidia.cu13", "nvidia-cuda-nvcc"), ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12"))


@dataclasses.dataclass(frozen=True)
class GpuTarget(Target):
    """A parsed ``gpu:<chip>:...``: ``gpu:h100:2x8`` -> chip ``h100``, 2 hosts of 8 GPUs."""

    name: str
    chip_name: str
    hosts: int
    per_host: int

    compiler = "XLA:GPU"
    platform = "cuda"

    @property
    def pallas_backend(self) -> str | None:
        """The Mosaic GPU kernels (wgmma, TMA) are written for Hopper (compute capability 9.0);
        other GPUs have no Pallas kernels here."""
        return "gpu" if self.chip.capability == "9.0" else None

    @property
    def chip(self) -> Chip:
        return CHIPS[self.chip_name]

    @property
    def device_kind(self) -> str:
        return self.chip.name

    def devices(self) -> tuple:
        return topology_devices(self)

    def layout(self, devices: tuple) -> dict:
        return {
            "chips": len(devices),
            "hosts": self.hosts,
            "compute_capability": self.chip.capability,
        }

    def memory(self) -> tuple[int, str]:
        return self.chip.device_memory_size, (
            f"the {self.chip.name}'s memory as CUDA reports it (totalGlobalMem; "
            "linear_attention.training.gpu_chips): XLA:GPU does not check memory, the step's "
            "peak is held to it here"
        )

    def versions(self) -> dict[str, str]:
        return versions()


def match_gpu(target: str) -> GpuTarget | None:
    """The `GpuTarget` of ``"gpu:<chip>:<count>"`` or ``"gpu:<chip>:<hosts>x<per_host>"``
    (None where ``target`` is not one: see `GPU_FORMS`). A count above a host's GPUs is whole
    hosts of them (``gpu:h100:16`` is ``2x8``)."""
    m = _TARGET.fullmatch(target)
    if m is None or m.group(1) not in CHIPS:
        return None
    chip, first, second = CHIPS[m.group(1)], int(m.group(2)), m.group(3)
    if second is not None:
        hosts, per_host = first, int(second)
    elif first <= chip.per_host:
        hosts, per_host = 1, first
    else:
        hosts, per_host = first // chip.per_host, chip.per_host
        if first % chip.per_host:
            return None
    if per_host > chip.per_host:
        return None
    return GpuTarget(target, m.group(1), hosts, per_host)


def cuda_missing() -> str | None:
    """Why this machine cannot compile for a GPU target (None: it can): the CUDA plugin or
    ``ptxas`` is not installed."""
    if not any(_spec(module) for module, _ in _PLUGINS):
        return f"the CUDA plugin of jax is not installed: {INSTALL}"
    root = os.environ.get("CUDA_ROOT")
    if root and os.path.exists(os.path.join(root, "bin", "ptxas")):
        return None
    if not any(_spec(module) for module, _ in _NVCC):
        return f"ptxas (CUDA's nvcc package) is not installed: {INSTALL}"
    return None


def _spec(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is absent
        return False


def versions() -> dict[str, str]:
    """The jax, CUDA plugin and nvcc versions that compile for a GPU target."""
    found = {"jax": jax.__version__}
    for _, dist in _PLUGINS + _NVCC:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


@functools.cache
def topology_devices(target: GpuTarget) -> tuple:
    """The target's compile-only devices. `ValueError` naming the target where the CUDA plugin
    or ptxas is missing, or the plugin did not load."""
    missing = cuda_missing()
    if missing:
        raise ValueError(f"config.mesh.target = {target.name!r} needs XLA:GPU: {missing}")
    if cuda_plugin.hidden():
        raise ValueError(
            f"config.mesh.target = {target.name!r} needs XLA:GPU, whose CUDA plugin this process "
            f"kept out (`cuda_plugin.hide`); run it with {cuda_plugin.ENV}=1"
        )
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            target_config=target_config(target.chip),
            topology=f"1x{target.hosts}x{target.per_host}",
        )
    except NotImplementedError:  # the plugin's start-up check failed: no platforms were set
        raise ValueError(
            f"config.mesh.target = {target.name!r}: the CUDA plugin of jax did not load; on a "
            "machine without a GPU set JAX_PLATFORMS=cpu before jax starts "
            "(JAX_PLATFORMS=cpu la-train ...)"
        ) from None
    except Exception as e:  # the plugin's own message says what it cannot describe
        raise ValueError(
            f"config.mesh.target = {target.name!r}: XLA:GPU cannot describe these GPUs: "
            f"{first_line(e)}; accepted: {GPU_FORMS}"
        ) from None
    return tuple(topology.devices)

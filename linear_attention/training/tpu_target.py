"""Compiling for a TPU slice from any machine: ``config.mesh.target = "tpu:<gen>:<topology>"``
(a `target_base.Target`).

libtpu (``pip install 'jax[tpu]'``, matched to jax) describes a slice without owning one:
`jax.experimental.topologies.get_topology_desc` gives its compile-only devices, a mesh over
them places abstract arrays, and ``jit(f).trace(...).lower(lowering_platforms=("tpu",))
.compile()`` runs XLA:TPU's compiler here, which refuses (``RESOURCE_EXHAUSTED``) a program
that does not fit the chip's memory and otherwise reports its `memory_analysis()` per device.

Devices are what the compiler compiles for: one per chip on v5e, v5p and v6e; on v4 one per
TensorCore (two per chip, each with half the chip's memory). The memory per device is the
compiler's own figure, read from the message it gives for a probe program too large for any
chip (``available HBM (15.75G)`` on v5e: 16 GiB less what the runtime reserves), so it is the
limit the compiler holds the train step to; its message rounds it to 0.01 GiB.

libtpu takes a lock file so that one process at a time drives a chip. Nothing here drives a
chip, so `topology_devices` sets ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (unless set) before libtpu
loads, letting several processes (``pytest -n 2``, sweeps) compile for a target at once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from linear_attention.training.platforms import quiet_libtpu
from linear_attention.training.target_base import Target, TargetCompileError, first_line

# Accelerator generations: the name in the target -> the device kind libtpu reports.
GENERATIONS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
TPU_FORMS = (
    "'tpu:<generation>:<topology>' with a generation of "
    f"{', '.join(GENERATIONS)} and the slice's chips per axis joined by 'x' "
    "(tpu:v5e:4x4, tpu:v5p:2x2x2, tpu:v6e:2x2, tpu:v4:2x2x1)"
)
_TARGET = re.compile(r"tpu:([a-z0-9]+):([1-9][0-9]*(?:x[1-9][0-9]*){1,2})")
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = r"([0-9.]+)([KMGT]?)"
# XLA:TPU's two forms of an out-of-memory refusal: the needed total, or what it used of the
# capacity and by how much it went over.
_OOM_TOTAL = re.compile(rf"HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)")
_OOM_USED = re.compile(
    rf"Used {_SIZE} of {_SIZE} hbm\. Exceeded hbm capacity by {_SIZE}", re.IGNORECASE
)


@dataclasses.dataclass(frozen=True)
class TpuTarget(Target):
    """A parsed ``tpu:<gen>:<topology>``: ``tpu:v5e:4x4`` -> generation ``v5e``, topology
    ``4x4``."""

    name: str
    generation: str
    topology: str

    compiler = "XLA:TPU"
    platform = "tpu"
    pallas_backend = "tpu"

    @property
    def device_kind(self) -> str:
        return GENERATIONS[self.generation]

    def devices(self) -> tuple:
        return topology_devices(self)

    def layout(self, devices: tuple) -> dict:
        return {"chips": len({tuple(d.coords) for d in devices})}  # v4: 2 devices a chip

    def memory(self) -> tuple[int, str]:
        return hbm_bytes_per_device(self), HBM_SOURCE.format(**self.versions())

    def versions(self) -> dict[str, str]:
        return versions()

    def compiler_options(self, limit: int | None) -> dict:
        return {} if limit is None else {"xla_tpu_max_hbm_size_mib": limit // 2**20}

    def refusal(self, message: str) -> tuple[int, str] | None:
        found = oom_bytes(message)
        if found is None:
            return None
        line = next(line for line in message.splitlines() if "HBM" in line or "hbm" in line)
        return found[0], line.strip()


def match_tpu(target: str) -> TpuTarget | None:
    """The `TpuTarget` of ``"tpu:<gen>:<topology>"`` (None where ``target`` is not one: see
    `TPU_FORMS`). Syntax only: whether libtpu knows the topology is checked by
    `topology_devices`."""
    m = _TARGET.fullmatch(target)
    if m is None or m.group(1) not in GENERATIONS:
        return None
    return TpuTarget(target, m.group(1), m.group(2))


def libtpu_missing() -> str | None:
    """Why this machine cannot compile for a TPU target (None: it can)."""
    if importlib.util.find_spec("libtpu") is None:
        return f"libtpu is not installed: pip install 'jax[tpu]=={jax.__version__}'"
    return None


def versions() -> dict[str, str]:
    """The jax and libtpu versions that compile for a target."""
    found = {"jax": jax.__version__}
    try:
        found["libtpu"] = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        found["libtpu"] = "absent"
    return found


@functools.cache
def topology_devices(target: TpuTarget) -> tuple:
    """The compile-only devices of the target's slice. `ValueError` (naming the target and
    libtpu's reason) where libtpu is missing or does not know the topology."""
    missing = libtpu_missing()
    if missing:
        raise ValueError(f"config.mesh.target = {target.name!r} needs libtpu: {missing}")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    quiet_libtpu()
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            topology_name=f"{target.generation}:{target.topology}", platform="tpu"
        )
    except Exception as e:  # libtpu's own message says what it cannot lay out
        raise ValueError(
            f"config.mesh.target = {target.name!r}: libtpu cannot describe this slice: "
            f"{first_line(e)}; accepted: {TPU_FORMS}"
        ) from None
    return tuple(topology.devices)


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit])


def oom_bytes(message: str) -> tuple[int, int] | None:
    """``(needed, available)`` bytes per device from XLA:TPU's out-of-memory message, or None
    where the message is not one (its figures are rounded to two decimals of their unit)."""
    m = _OOM_TOTAL.search(message)
    if m:
        return _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4))
    m = _OOM_USED.search(message)
    if m:
        capacity = _bytes(*m.group(3, 4))
        return capacity + _bytes(*m.group(5, 6)), capacity
    return None


@functools.cache
def hbm_bytes_per_device(target: TpuTarget) -> int:
    """The memory XLA:TPU lets a program use on one device of the target (see the module
    docstring): from its refusal of a probe of 1 TiB replicated on every device."""
    mesh = Mesh(np.asarray(topology_devices(target)), ("all",))
    probe = jax.ShapeDtypeStruct(
        (2**14, 2**14, 2**10), jnp.float32, sharding=NamedSharding(mesh, P())
    )
    try:
        jax.jit(lambda x: x + 1).trace(probe).lower(lowering_platforms=("tpu",)).compile()
    except Exception as e:
        found = oom_bytes(str(e))
        if found:
            return found[1]
        raise TargetCompileError(f"probing the HBM of {target.name}: {e}") from None
    raise TargetCompileError(f"probing the HBM of {target.name}: 1 TiB per device compiled")


HBM_SOURCE = (
    "XLA:TPU compiler (libtpu {libtpu}): the HBM it allows a program per device, from its "
    "refusal of a probe too large for the chip (rounded to 0.01 GiB)"
)

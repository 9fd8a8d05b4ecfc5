"""Devices: a 1-D `Mesh` with axis ``data``; batches split over it, parameters replicated or
FSDP-sharded (each array split along its first dimension divisible by the device count)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def initialize_distributed(multi_host: bool) -> None:
    """Join a multi-host run (coordinator and process ids come from the environment)."""
    if multi_host and not jax.distributed.is_initialized():
        jax.distributed.initialize()


def make_mesh(num_devices: int = 0) -> Mesh:
    """A mesh over the first ``num_devices`` devices (0: all of them)."""
    devices = jax.devices()
    if num_devices > len(devices):
        raise ValueError(
            f"config.mesh.num_devices = {num_devices} but only {len(devices)} devices are visible"
        )
    devices = devices[: num_devices or len(devices)]
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def check_batch_size(name: str, batch_size: int, mesh: Mesh) -> None:
    n = mesh.shape[DATA_AXIS]
    if batch_size % n:
        raise ValueError(
            f"config.{name} = {batch_size} must be divisible by the number of devices ({n})"
        )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def array_sharding(shape: tuple[int, ...], mesh: Mesh, fsdp: bool) -> NamedSharding:
    """Replicated, or with ``fsdp`` split along the first dimension the devices divide."""
    n = mesh.shape[DATA_AXIS]
    if fsdp and n > 1:
        for axis, size in enumerate(shape):
            if size % n == 0:
                return NamedSharding(mesh, P(*([None] * axis), DATA_AXIS))
    return replicated(mesh)


def state_shardings(state, mesh: Mesh, fsdp: bool):
    """The sharding of every array of a pytree (works on arrays, tracers and shape structs)."""
    return jax.tree.map(lambda x: array_sharding(tuple(x.shape), mesh, fsdp), state)


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Place a global host batch on the mesh, rows split over ``data``. Every process holds
    the same global batch (data are keyed by step), so this also works across hosts."""
    sharding = batch_sharding(mesh)
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for k, v in batch.items()
    }

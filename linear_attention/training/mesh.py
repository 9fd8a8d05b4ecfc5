"""Devices: a `Mesh` with axes ``data`` and ``seq``. Batch rows split over ``data``, parameters
replicated or FSDP-sharded over it (each array split along its first dimension divisible by the
``data`` size); with ``seq > 1`` the model's loss runs in `jax.shard_map` with time split over
``seq`` (`sequence_parallel_stats`: the mixers' sequence parallelism, layers/sequence.py)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from linear_attention.layers.sequence import split_sequence

DATA_AXIS = "data"
SEQ_AXIS = "seq"


def initialize_distributed(mesh_config) -> None:
    """Join a multi-process run (``config.mesh.multi_host``): the coordinator address, the
    number of processes and this process's id from ``config.mesh`` where set, otherwise from the
    environment or the cluster (`jax.distributed.initialize`'s auto-detection)."""
    if not mesh_config.multi_host or jax.distributed.is_initialized():
        return
    kwargs = {}
    if mesh_config.coordinator_address:
        kwargs["coordinator_address"] = mesh_config.coordinator_address
    if mesh_config.num_processes:
        kwargs["num_processes"] = mesh_config.num_processes
        kwargs["process_id"] = mesh_config.process_id
    jax.distributed.initialize(**kwargs)


def make_mesh(num_devices: int = 0, seq: int = 1, devices=None) -> Mesh:
    """A ``(data, seq)`` mesh over the first ``num_devices`` of ``devices`` (default: the
    visible ones; 0: all of them), ``seq`` of them along the time axis."""
    where = "are visible" if devices is None else "are in config.mesh.target"
    devices = list(jax.devices() if devices is None else devices)
    if num_devices > len(devices):
        raise ValueError(
            f"config.mesh.num_devices = {num_devices} but only {len(devices)} devices {where}"
        )
    devices = devices[: num_devices or len(devices)]
    if len(devices) % seq:
        raise ValueError(f"config.mesh.seq = {seq} must divide the {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(-1, seq), (DATA_AXIS, SEQ_AXIS))


def check_batch_size(name: str, batch_size: int, mesh: Mesh) -> None:
    n = mesh.shape[DATA_AXIS]
    if batch_size % n:
        raise ValueError(
            f"config.{name} = {batch_size} must be divisible by the number of devices ({n})"
        )


def check_train_batches(train, mesh: Mesh) -> None:
    """`ValueError` unless the mesh's ``data`` axis divides the train and eval batches and
    every micro-batch (``train.batch_size / grad_accum_steps`` rows)."""
    check_batch_size("train.batch_size", train.batch_size, mesh)
    check_batch_size("train.eval_batch_size", train.eval_batch, mesh)
    micro = train.batch_size // train.grad_accum_steps
    if micro % mesh.shape[DATA_AXIS]:
        raise ValueError(
            f"config.train.batch_size / grad_accum_steps = {micro} rows per micro-batch must "
            f"be divisible by the number of devices splitting the batch "
            f"({mesh.shape[DATA_AXIS]})"
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


def shard_local_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Place a batch of which each process holds its own rows (a loader sharded by process)
    on the mesh: the global batch is the processes' rows in process order, split over
    ``data``. With one process this is `shard_batch`."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def sequence_parallel_stats(stats_fn, model, batch: dict, mesh: Mesh):
    """``stats_fn(model, batch)`` (sums over the batch) computed in `jax.shard_map`: every batch
    entry (``[B, T]``) split by rows over ``data`` and by time over ``seq``, the model run in
    `split_sequence` (its mixers then see their shard of the time axis and combine over
    ``seq``). Parameters enter replicated; the sums are `psum`-ed over both axes."""
    graphdef, params = nnx.split(model)

    def local(params, batch):
        with split_sequence(SEQ_AXIS):
            stats = stats_fn(nnx.merge(graphdef, params), batch)
        return jax.lax.psum(stats, (DATA_AXIS, SEQ_AXIS))

    in_specs = (P(), P(DATA_AXIS, SEQ_AXIS))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())(params, batch)

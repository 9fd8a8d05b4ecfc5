"""Devices: a `Mesh` with axes ``data``, ``seq`` and ``model`` (and ``expert``, when it has more
than one device). Batch rows split over ``data`` (and ``expert``),
parameters replicated or FSDP-sharded over it (each array split along its first dimension
divisible by the ``data`` size); with ``seq > 1`` the model's loss runs in `jax.shard_map` with
time split over ``seq`` (`sequence_parallel_stats`: the mixers' sequence parallelism,
layers/sequence.py).

With ``model > 1`` (tensor parallelism, `model_split_dim`) every block's weights are split over
``model`` in the Megatron way: the in-projections (query/key/value, gates, decays, the MLP's up and
gate) by their output columns, so heads, value heads, MLA's latent, convolution channels and MLP
hidden units are divided among the devices, and the out-projections (the mixer's ``out_proj``, the
MLP's ``w_down``) by their input rows, so the mixer and the MLP each end in one reduction over
``model`` (the short convolutions' small filters stay whole: `UNSPLIT`). Only the parameters are
annotated: XLA's SPMD partitioner places the activations and inserts the collectives. A fused
projection (``qkv_proj`` holds the query, key and value columns one after the other) is split as
stored, so XLA regroups its columns by head (collective permutes). The optimizer state follows the
parameters (its leaves sit under the same names).

With ``expert > 1`` (expert parallelism) the batch rows are split over ``data`` × ``expert``
(the ``expert`` devices are data-parallel for everything but the experts) and every MoE layer's
expert weights (``w_gate``, ``w_up``, ``w_down``, ``[E, ...]``) over ``expert`` along E
(`expert_split_dim`): a device holds E / ``expert`` experts. The MoE layers are traced under
`layers.moe.expert_parallel` (`expert_dispatch`): the dispatched ``[E, N, D]`` tokens go from
the token layout (N split over ``data`` × ``expert``) to the expert layout (E split over
``expert``, N over ``data``) and back, which XLA lowers to an all-to-all over ``expert`` each
way. The routing is the dense layer's (dropless: no capacity, no token dropped), so the numbers
are the unsplit model's. It is refused (`training.config`) with ``seq > 1`` or Pallas kernels
(their `jax.shard_map` would hold the dispatch) and with ``model > 1`` (the MoE layers are not
tensor-parallel)."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from linear_attention.layers.moe import expert_parallel
from linear_attention.layers.sequence import split_sequence

DATA_AXIS = "data"
SEQ_AXIS = "seq"
MODEL_AXIS = "model"
EXPERT_AXIS = "expert"
# the MoE layers' expert weights, [E, D, I] / [E, I, D]: split along E over ``expert``
EXPERT_WEIGHTS = frozenset({"w_gate", "w_up", "w_down"})
# Modules whose weights are split by input rows (row-parallel: a block's last matmul); the other
# weights of a block are split by output columns. The MLP's "w_down" is row-parallel only
# under "mlp" (PaTH's input low-rank pair reuses the name for an in-projection).
ROW_PARALLEL = frozenset({"out_proj"})
# Parameters of a block never split over ``model``: the norms over d_model, and the short
# convolutions' [K, C] filters (a few K·C numbers; the channels they act on are split with
# the in-projection's output). Split filters gave FAVOR+ with a short conv gradients 8% off the
# unsplit model's on XLA:CPU (loss equal; other mixers with a conv equal), not yet explained.
UNSPLIT = ("norm", "conv")


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


def make_mesh(
    num_devices: int = 0, seq: int = 1, devices=None, model: int = 1, expert: int = 1
) -> Mesh:
    """A ``(data, seq, model)`` mesh over the first ``num_devices`` of ``devices`` (default:
    the visible ones; 0: all of them), ``seq`` of them along the time axis and ``model`` along
    the heads (the innermost axis: neighbouring devices, the fastest links); with ``expert >
    1`` a ``(data, expert, seq, model)`` mesh, ``expert`` devices splitting the experts."""
    where = "are visible" if devices is None else "are in config.mesh.target"
    devices = list(jax.devices() if devices is None else devices)
    if num_devices > len(devices):
        raise ValueError(
            f"config.mesh.num_devices = {num_devices} but only {len(devices)} devices {where}"
        )
    devices = devices[: num_devices or len(devices)]
    if len(devices) % (seq * model):
        raise ValueError(
            f"config.mesh.seq × config.mesh.model = {seq} × {model} must divide the "
            f"{len(devices)} devices"
        )
    if expert > 1:
        if len(devices) % (seq * model * expert):
            allowed = [
                e for e in range(1, len(devices) + 1) if len(devices) % (seq * model * e) == 0
            ]
            raise ValueError(
                f"config.mesh.expert = {expert} times config.mesh.seq × config.mesh.model = "
                f"{seq} × {model} must divide the {len(devices)} devices (allowed: "
                f"{', '.join(map(str, allowed))})"
            )
        grid = np.asarray(devices).reshape(-1, expert, seq, model)
        return Mesh(grid, (DATA_AXIS, EXPERT_AXIS, SEQ_AXIS, MODEL_AXIS))
    return Mesh(np.asarray(devices).reshape(-1, seq, model), (DATA_AXIS, SEQ_AXIS, MODEL_AXIS))


def expert_sizes(devices: int, others: int) -> str:
    """The ``expert`` axis sizes that ``devices`` devices hold beside ``others`` (the product
    of the other model-splitting axes), as an error message lists them."""
    return ", ".join(str(e) for e in range(1, devices + 1) if devices % (others * e) == 0)


def batch_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The `PartitionSpec` entry of the batch rows: ``data``, or ``(data, expert)`` when the
    mesh has an ``expert`` axis."""
    return (DATA_AXIS, EXPERT_AXIS) if EXPERT_AXIS in mesh.shape else DATA_AXIS


def batch_devices(mesh: Mesh) -> int:
    """The number of devices splitting the batch rows (`batch_axes`)."""
    return mesh.shape[DATA_AXIS] * mesh.shape.get(EXPERT_AXIS, 1)


def expert_dispatch(mesh: Mesh | None):
    """`layers.moe.expert_parallel` with the token and expert layouts of ``mesh``'s axes (module
    docstring), or a null context without an ``expert`` axis."""
    if mesh is None or EXPERT_AXIS not in mesh.shape:
        return contextlib.nullcontext()
    tokens = NamedSharding(mesh, P(None, batch_axes(mesh), None))
    return expert_parallel(tokens, NamedSharding(mesh, P(EXPERT_AXIS, DATA_AXIS, None)))


def check_batch_size(name: str, batch_size: int, mesh: Mesh) -> None:
    n = batch_devices(mesh)
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
    if micro % batch_devices(mesh):
        raise ValueError(
            f"config.train.batch_size / grad_accum_steps = {micro} rows per micro-batch must "
            f"be divisible by the number of devices splitting the batch "
            f"({batch_devices(mesh)})"
        )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def model_split_dim(names: tuple[str, ...], shape: tuple[int, ...], model: int) -> int | None:
    """The dimension of a parameter (or optimizer-state leaf) split over a ``model`` axis of
    ``model`` devices, from its path ``names`` (module docstring), or None (replicated): a
    block's row-parallel kernels (`ROW_PARALLEL`, the MLP's ``w_down``) by their first
    dimension, its other weights by their last; nothing outside the blocks (embeddings, the
    final norm), the norms, scalars and a dimension ``model`` does not divide."""
    if model == 1 or "blocks" not in names or not shape:
        return None
    if any(part in name for name in names for part in UNSPLIT):
        return None
    owner = names[-3:-1] if names[-1] in ("kernel", "bias") else names[-2:]
    row = owner[-1] in ROW_PARALLEL or owner == ("mlp", "w_down")
    if row and names[-1] == "bias":
        return None
    dim = 0 if row and len(shape) > 1 else len(shape) - 1
    return dim if shape[dim] % model == 0 else None


def expert_split_dim(names: tuple[str, ...], shape: tuple[int, ...], expert: int) -> int | None:
    """0 for a block's MoE expert weight (`EXPERT_WEIGHTS`, ``[E, ...]``) that ``expert``
    devices split along E, else None."""
    if expert == 1 or "blocks" not in names or names[-1] not in EXPERT_WEIGHTS:
        return None
    return 0 if len(shape) == 3 and shape[0] % expert == 0 else None


def array_sharding(
    shape: tuple[int, ...], mesh: Mesh, fsdp: bool, names: tuple[str, ...] = ()
) -> NamedSharding:
    """Replicated, or split over ``model`` along `model_split_dim` of its path ``names`` (over
    ``expert`` along `expert_split_dim`), and with ``fsdp`` over ``data`` along the first other
    dimension the ``data`` devices divide."""
    spec = [None] * len(shape)
    split = model_split_dim(names, shape, mesh.shape.get(MODEL_AXIS, 1))
    if split is not None:
        spec[split] = MODEL_AXIS
    experts = expert_split_dim(names, shape, mesh.shape.get(EXPERT_AXIS, 1))
    if experts is not None and split is None:
        split = experts
        spec[split] = EXPERT_AXIS
    n = mesh.shape[DATA_AXIS]
    if fsdp and n > 1:
        for axis, size in enumerate(shape):
            if axis != split and size % n == 0:
                spec[axis] = DATA_AXIS
                break
    return NamedSharding(mesh, P(*spec)) if any(spec) else replicated(mesh)


def path_names(path) -> tuple[str, ...]:
    """A pytree path's dict keys and sequence indices as strings (a variable's ``.value``
    attribute left out: an `nnx.State` leaf is named by its module path)."""
    keys = (getattr(k, "key", getattr(k, "idx", None)) for k in path)
    return tuple(str(k) for k in keys if k is not None)


def state_shardings(state, mesh: Mesh, fsdp: bool):
    """The sharding of every array of a pytree (works on arrays, tracers and shape structs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: array_sharding(tuple(x.shape), mesh, fsdp, path_names(path)), state
    )


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
    ``seq``). Parameters enter replicated over both; the sums are `psum`-ed over both axes.
    A ``model`` axis over more than one device is left to XLA's partitioner inside (the
    parameters keep their split over it: tensor parallelism within each shard)."""
    graphdef, params = nnx.split(model)

    def local(params, batch):
        with split_sequence(SEQ_AXIS):
            stats = stats_fn(nnx.merge(graphdef, params), batch)
        return jax.lax.psum(stats, (DATA_AXIS, SEQ_AXIS))

    in_specs = (P(), P(DATA_AXIS, SEQ_AXIS))
    manual = {DATA_AXIS, SEQ_AXIS} if mesh.shape.get(MODEL_AXIS, 1) > 1 else set(mesh.axis_names)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(), axis_names=manual)(
        params, batch
    )

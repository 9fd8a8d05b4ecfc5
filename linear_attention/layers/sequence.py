"""Sequence parallelism for the layers: the time axis split over a mesh axis.

Inside `jax.shard_map` with time split over a mesh axis, `with split_sequence("seq"):` makes
every mixer's sequence path compute what the unsplit model computes: the linear kernels run with
`axis_name` (kernels/sequence_parallel.py), softmax attends to the gathered keys and values
(context parallelism), the short conv reads the previous shard's last K − 1 inputs (a halo by
`ppermute`), and rotary / learned positions start at the shard's global offset. The axis is
trace-time context (a Python value, not an array), so models keep their call signatures.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

_AXES: list[str] = []


@contextlib.contextmanager
def split_sequence(axis_name: str):
    """Within this context, sequence paths treat their time axis as one shard of `axis_name`."""
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"axis_name must be a mesh axis name, got {axis_name!r}")
    _AXES.append(axis_name)
    try:
        yield
    finally:
        _AXES.pop()


def sequence_axis() -> str | None:
    """The mesh axis time is split over, or None."""
    return _AXES[-1] if _AXES else None


def sequence_offset(length: int):
    """Global position of this shard's first token (`axis_index · length`); 0 unsplit."""
    axis = sequence_axis()
    return 0 if axis is None else jax.lax.axis_index(axis) * length


def previous_tail(x_BTC: jax.Array, width: int) -> jax.Array:
    """The last `width` steps of the previous shard's `x` (zeros on the first shard), float32."""
    axis = sequence_axis()
    if x_BTC.shape[1] < width:
        raise ValueError(
            f"a shard of {x_BTC.shape[1]} tokens is shorter than the conv's context of {width} "
            "tokens; use fewer sequence shards (config.mesh.seq) or a longer sequence"
        )
    n = jax.lax.axis_size(axis)
    tail_BWC = x_BTC[:, x_BTC.shape[1] - width :].astype(jnp.float32)
    return jax.lax.ppermute(tail_BWC, axis, perm=[(i, i + 1) for i in range(n - 1)])

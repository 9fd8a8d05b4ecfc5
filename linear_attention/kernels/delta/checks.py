"""Argument checks of the delta family (`delta.py`, `dplr.py`, `delta_product.py`), written once:
the inputs' layouts and dtypes, β's range, and the state (the method and chunk: each entry
point's descriptor, `primitives.family`).
Each raises a `ValueError` naming the argument and its shape or values, before any work."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from linear_attention.kernels.checks import (
    check_float,
    check_layouts,
    concrete,
)
from linear_attention.kernels.state import LinearAttentionState


def check_inputs(*, time: bool, **arrays) -> None:
    """Layouts (`name=(array, "[B, T, H, K]")`, as `check_layouts`) and float dtypes of the
    inputs; with `time`, at least one time step (axis 1 of the first array); keys at least one
    channel wide (`K`) and at least one sub-step per token (`n`). (An empty batch is no error:
    its outputs are empty.)"""
    sizes = check_layouts(**arrays)
    for axis, what in (
        ("K", "keys need at least one channel"),
        ("n", "a token needs n >= 1 sub-steps"),
    ):
        if sizes.get(axis) == 0:
            name, (x, layout) = next((n, a) for n, a in arrays.items() if axis in a[1])
            raise ValueError(f"{name} has shape {tuple(jnp.shape(x))} {layout}: {axis} = 0, {what}")
    names = tuple(arrays)
    values = [x for x, _ in arrays.values()]
    check_float(names, values)
    if time and jnp.shape(values[0])[1] == 0:
        raise ValueError(
            f"q, k, v must have at least one time step, got shape {jnp.shape(values[0])}"
        )


def check_beta(beta, lo_allowed, hi_allowed, name="beta"):
    """Raise unless the concrete values of `beta` lie in [lo_allowed, hi_allowed]. Values are read
    with NumPy when concrete (a constant closed over under `jit` included); traced: skip."""
    values = concrete(beta)
    if values is not None and values.size:
        nan = np.isnan(values)
        if nan.any():
            raise ValueError(
                f"{name} holds NaN ({int(nan.sum())} of {values.size} values, the first at "
                f"index {tuple(int(i) for i in np.argwhere(nan)[0])}); it must lie in "
                f"[{lo_allowed:g}, {hi_allowed:g}]"
            )
        lo, hi = float(np.min(values)), float(np.max(values))
        if not (lo >= lo_allowed and hi <= hi_allowed):
            raise ValueError(
                f"{name} must lie in [{lo_allowed:g}, {hi_allowed:g}], got values in [{lo}, {hi}]"
            )


def check_delta_state(state, batch, heads, kd, dv, name):
    """Raise unless `state` is a `LinearAttentionState(kv=[B, H, K, Dv], k_sum=None)`."""
    if not isinstance(state, LinearAttentionState):
        raise ValueError(f"{name} must be a LinearAttentionState, got {type(state).__name__}")
    if state.k_sum is not None:
        raise ValueError(f"{name}.k_sum must be None for the delta rule (it has no normaliser)")
    want = (batch, heads, kd, dv)
    if tuple(jnp.shape(state.kv)) != want:
        raise ValueError(
            f"{name}.kv has shape {tuple(jnp.shape(state.kv))}; expected {want} [B, H, K, Dv]"
        )


def initial_state_f32(initial_state, batch, heads, kd, dv):
    """The checked `initial_state` as a float32 `[B, H, K, Dv]` array (zeros for None)."""
    if initial_state is None:
        return jnp.zeros((batch, heads, kd, dv), jnp.float32)
    check_delta_state(initial_state, batch, heads, kd, dv, "initial_state")
    return initial_state.kv.astype(jnp.float32)

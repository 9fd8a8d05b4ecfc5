"""Argument checks shared by the kernels: fail fast, name the argument and the shapes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def check_rank(name: str, x, rank: int, layout: str) -> None:
    """Raise unless `x` has `rank` dimensions, laid out as `layout` (e.g. "[B, T, H, D]")."""
    if jnp.ndim(x) != rank:
        raise ValueError(
            f"{name} must have rank {rank} {layout}, got shape {tuple(jnp.shape(x))} "
            f"(rank {jnp.ndim(x)})"
        )


def check_same(names: Sequence[str], arrays: Sequence, axes: Sequence[int], what: str) -> None:
    """Raise unless every array has the same size on its axis; `what` names the axis (e.g. "B")."""
    sizes = [jnp.shape(a)[ax] for a, ax in zip(arrays, axes, strict=True)]
    if len(set(sizes)) > 1:
        shapes = ", ".join(
            f"{n}: {tuple(jnp.shape(a))}" for n, a in zip(names, arrays, strict=True)
        )
        raise ValueError(f"{' / '.join(names)} disagree on {what} ({shapes})")


def check_choice(name: str, value, allowed: Sequence) -> None:
    """Raise unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(repr, allowed))}")


def check_positive_int(name: str, value) -> None:
    """Raise unless `value` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_log_decay(log_decay, full_shape, layout):
    """Broadcast `log_decay` to `full_shape` (float32); raise on a bad shape or a positive value."""
    if log_decay is None:
        return None
    shape = tuple(jnp.shape(log_decay))
    try:
        ok = jnp.broadcast_shapes(shape, full_shape) == full_shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"log_decay of shape {shape} does not broadcast to {full_shape} {layout}; "
            "use [H] for a fixed per-head decay or the full shape for a data-dependent one"
        )
    if not isinstance(log_decay, jax.core.Tracer) and bool(jnp.any(jnp.asarray(log_decay) > 0)):
        raise ValueError(
            f"log_decay must be <= 0 (a decay factor exp(log_decay) <= 1); got max "
            f"{float(jnp.max(jnp.asarray(log_decay)))}"
        )
    return jnp.broadcast_to(jnp.asarray(log_decay, jnp.float32), full_shape)

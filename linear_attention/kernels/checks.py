"""Argument checks shared by the kernels (public: every family and the layers use them): fail fast,
name the argument and the shapes."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The field checker's messages, so a kernel's bad argument reads as a config's does (re-exported).
from linear_attention.fields import check_choice as check_choice
from linear_attention.fields import check_int


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


# What each axis letter of a layout stands for, in messages.
AXES = {
    "B": "B (batch)",
    "T": "T (time)",
    "Tk": "Tk (key length)",
    "H": "H (heads)",
    "M": "M (feature width)",
    "K": "K (key width)",
    "D": "D (query/key width)",
    "L": "L (cache length)",
}


def check_layouts(**arrays) -> dict[str, int]:
    """Check arrays against their layouts, e.g. `check_layouts(q=(q, "[B, T, H, M]"), ...)`: each
    has its layout's rank, and each axis letter has one size in every array it appears in.
    Returns the sizes by letter. Ranks are checked first (in argument order), then the axes in
    order of first appearance, so a message names the first thing that is wrong."""
    axes = {}
    for name, (x, layout) in arrays.items():
        axes[name] = layout.strip("[]").split(", ")
        check_rank(name, x, len(axes[name]), layout)
    sizes = {}
    for axis in dict.fromkeys(a for names in axes.values() for a in names):
        holders = [name for name in arrays if axis in axes[name]]
        positions = [axes[name].index(axis) for name in holders]
        check_same(holders, [arrays[n][0] for n in holders], positions, AXES.get(axis, axis))
        sizes[axis] = jnp.shape(arrays[holders[0]][0])[positions[0]]
    return sizes


def check_positive_int(name: str, value) -> int:
    """Raise unless `value` is an integer >= 1 (Python or NumPy); return it as an int."""
    return check_int(name, value)


def check_float(names: Sequence[str], arrays: Sequence) -> None:
    """Raise unless every array has a real floating dtype (no integer, bool or complex input)."""
    for name, x in zip(names, arrays, strict=True):
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{name} must have a real floating dtype, got {dtype}")


def concrete(x):
    """`x`'s values as a NumPy array when they can be read now, else None (a tracer under
    `jit`/`vmap`/`grad`). NumPy, not `jnp`: under `jit` a `jnp.min` of a closed-over constant is
    staged into the trace and cannot be read back, while `np.asarray` reads the constant."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_static(name: str, value) -> None:
    """Raise unless `value` is concrete: a static argument (a flag, `eps`) cannot be traced,
    since it picks the computation rather than entering it."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} is a static argument (a Python value), got a traced {value.aval}: pass "
            f"it outside the traced arguments, e.g. jax.jit(f, static_argnames=({name!r},)) "
            "or functools.partial"
        )


def check_eps(eps) -> None:
    """Raise unless `eps` is a static scalar > 0 (it is folded into the compiled kernel)."""
    check_static("eps", eps)
    if jnp.ndim(eps) != 0:
        raise ValueError(f"eps must be a scalar, got shape {tuple(jnp.shape(eps))}")
    if not float(eps) > 0:  # also catches NaN
        raise ValueError(f"eps must be > 0, got {eps!r}")


def refuse_axis_name(what: str, axis_name) -> None:
    """Raise for a time split (`axis_name`) of a softmax family: its output is no affine map of
    a carried state, so there is no `S_out = A S_in + U` summary to combine over the axis."""
    if axis_name is not None:
        raise ValueError(
            f"{what} has no sequence-parallel form (axis_name): its output is not an affine map "
            "of a carried state; run it with time unsplit (mesh.seq = 1)"
        )


@contextlib.contextmanager
def reverse_mode_only(what: str, forward_mode: str):
    """Turn JAX's error for forward-mode autodiff (`jax.jvp`, `jax.jacfwd`) through a custom
    VJP into a `ValueError` naming `what` and the alternatives that support it (`forward_mode`).

    A `jax.custom_vjp` function has no tangent rule, and JAX cannot give one function both a
    custom VJP and a custom JVP: a custom JVP would be transposed for `grad`, which would drop the
    memory-saving backward pass. The error is raised when the JVP reaches the kernel eagerly
    (`jax.jvp(f, ...)`, `jax.jacfwd(f)`); when the kernel was traced first (`jax.jvp(jax.jit(f))`,
    `jax.jit(jax.jvp(...))`) JAX raises its own `TypeError` at compile time instead."""
    try:
        yield
    except TypeError as e:
        if "forward-mode autodiff" not in str(e):
            raise
        raise ValueError(
            f"{what} supports reverse-mode autodiff only (jax.grad, jax.vjp, jax.jacrev, "
            f"jax.hessian): its gradient is a custom VJP, which JAX cannot push tangents through. "
            f"For forward mode (jax.jvp, jax.jacfwd) use {forward_mode}, which give the same "
            "numbers"
        ) from e


def check_log_decay(log_decay, full_shape, layout, *, feature_dim=None):
    """Check and broadcast a log decay to `full_shape` (e.g. (B, T, H)), float32; None stays None.

    Accepted ranks, each explicit so that no shape is read two ways: 1 (`[H]`, a fixed decay per
    head), `len(full_shape)` (`layout`, e.g. `[B, T, H]`) and, with `feature_dim`, one more (a
    decay per key dimension, `full_shape + (M,)`); size-1 axes broadcast. Returns a float32 array
    of `full_shape` or `full_shape + (M,)`. Values must be ≤ 0 and not NaN (−inf, a reset, is
    allowed); the values are checked when they are concrete (eagerly, or a constant closed over
    under `jit`), not when traced.
    """
    if log_decay is None:
        return None
    shape = tuple(jnp.shape(log_decay))
    layouts = {1: (full_shape[-1:], "[H]"), len(full_shape): (full_shape, layout)}
    if feature_dim is not None:
        layouts[len(full_shape) + 1] = (
            (*full_shape, feature_dim),
            layout[:-1] + ", M]",
        )
    allowed = " or ".join(f"{lay} (rank {r})" for r, (_, lay) in sorted(layouts.items()))
    if len(shape) not in layouts:
        raise ValueError(
            f"log_decay of shape {shape} has rank {len(shape)}; allowed: {allowed}. Ranks are "
            "explicit: add size-1 axes (e.g. a[..., None]) rather than drop them"
        )
    want, lay = layouts[len(shape)]
    target = full_shape if len(shape) == 1 else want
    try:
        ok = jnp.broadcast_shapes(shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"log_decay of shape {shape} does not broadcast to {lay} = {want}; allowed: {allowed}"
        )
    check_float(("log_decay",), (log_decay,))
    values = concrete(log_decay)
    if values is not None:
        values = values.astype(np.float32)
        if np.any(np.isnan(values)):
            raise ValueError("log_decay contains NaN")
        if np.any(values > 0):
            raise ValueError(
                f"log_decay must be <= 0 (a decay factor exp(log_decay) <= 1); got max "
                f"{float(np.max(values))}"
            )
    return jnp.broadcast_to(jnp.asarray(log_decay, jnp.float32), target)

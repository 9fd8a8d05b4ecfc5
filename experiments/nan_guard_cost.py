"""What the NaN guard (`kernels/primitives/nan_guard.py`) costs: one chunk form timed with and
without it in one process, interleaved rounds, the median of the per-round ratios.

    python experiments/nan_guard_cost.py                  # ~1 min on 2 cores

Gated DeltaNet (`K.delta_rule`, method "chunk", a data-dependent log decay per head, packed rows)
at B=1, T=2048, H=4, K=Dv=64, float32: the forward pass and the gradient w.r.t. q, k, v, β and
the log decay. "Without" is the same call with `guard_inputs` in `kernels.delta.delta` replaced
by one that returns its inputs and no guard (the arithmetic before issue 75).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention import kernels as K
from linear_attention.kernels.delta import delta as delta_module


@contextlib.contextmanager
def unguarded():
    """`delta_rule` with no guard: its inputs as given, no detection, cleaning or select."""
    saved = delta_module.guard_inputs
    delta_module.guard_inputs = lambda shape, writes, a, states, **kw: (None, writes, a, states)
    try:
        yield
    finally:
        delta_module.guard_inputs = saved


def build(B, T, H, D, chunk):
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, T, H, D))
    k = jax.random.normal(keys[1], (B, T, H, D))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (B, T, H, D))
    beta = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H)))
    a = jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, T, H)) + 3.0)
    seg = jnp.asarray(np.repeat(np.arange(4), T // 4)[None].repeat(B, 0), jnp.int32)
    g = jnp.cos(jnp.arange(B * T * H * D, dtype=jnp.float32)).reshape(B, T, H, D)

    def f(q, k, v, beta, a):
        return K.delta_rule(
            q, k, v, beta, log_decay=a, method="chunk", chunk_size=chunk, segment_ids=seg
        )

    fwd = jax.jit(f)
    grad = jax.jit(jax.grad(lambda *xs: jnp.sum(f(*xs) * g), argnums=(0, 1, 2, 3, 4)))
    return (q, k, v, beta, a), fwd, grad


def timed(fn, xs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*xs))
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    xs, fwd, grad = build(1, args.T, 4, 64, 64)
    with unguarded():
        _, fwd0, grad0 = build(1, args.T, 4, 64, 64)
        for fn in (fwd0, grad0):  # traced and compiled without the guard
            timed(fn, xs)
    for fn in (fwd, grad):
        timed(fn, xs)
    ratios = {"fwd": [], "grad": []}
    times = {"fwd": [], "grad": [], "fwd0": [], "grad0": []}
    for _ in range(args.rounds):
        for name, with_guard, without in (("fwd", fwd, fwd0), ("grad", grad, grad0)):
            t1, t0 = timed(with_guard, xs), timed(without, xs)
            times[name].append(t1)
            times[name + "0"].append(t0)
            ratios[name].append(t1 / t0)
    for name in ("fwd", "grad"):
        print(
            f"{name}: with guard {np.median(times[name]) * 1e3:.1f} ms, without "
            f"{np.median(times[name + '0']) * 1e3:.1f} ms, ratio {np.median(ratios[name]):.3f} "
            f"(rounds {', '.join(f'{r:.3f}' for r in ratios[name])})"
        )


if __name__ == "__main__":
    main()

"""Timing helpers shared by the benchmark scripts: the benchmarks' input shape and inputs, the
linear-attention call that is timed, compiling a forward or gradient point, and interleaved
rounds of timing (a shared machine's load falls on every point of a round alike).

Shape B=1, H=4, d=64, float32: one sequence, small heads, so that T is what varies.
"""

from __future__ import annotations

import random
import statistics
import time

import jax
import jax.numpy as jnp

from linear_attention import kernels as K

B, H, D = 1, 4, 64
DEFAULT_CHUNK = 64  # the library's default chunk size; naive_chunked_causal uses the same


def linear_fn(method, chunk_size=DEFAULT_CHUNK, decay=None, kernels=K):
    """`decay`: None, "head" (a [B, T, H] log decay) or "key" ([B, T, H, d], GLA), both computed
    from q inside the timed function (−0.1·sigmoid), so the gradient reaches them. `kernels`:
    the kernels package to call (another revision's, in ``experiments/chunk_speed.py``)."""

    def f(q, k, v):
        a = None
        if decay == "head":
            a = -0.1 * jax.nn.sigmoid(q[..., 0])
        elif decay == "key":
            a = -0.1 * jax.nn.sigmoid(q)
        return kernels.causal_linear_attention(
            q, k, v, log_decay=a, method=method, chunk_size=chunk_size
        )

    return f


def chunk_flops(T: int, C: int = DEFAULT_CHUNK) -> float:
    """Forward FLOPs of the chunk form: 4·B·T·H·(C·d + d²) (intra-chunk and state matmuls)."""
    return 4.0 * B * T * H * (C * D + D * D)


def make_inputs(T: int, seed: int = 0):
    """{"raw": (q, k, v, g), "feat": (φq, φk, v, g)} with g the output cotangent."""
    q, k, v, g = (
        jax.random.normal(key, (B, T, H, D), jnp.float32)
        for key in jax.random.split(jax.random.key(seed), 4)
    )
    phi = K.feature_maps.elu_plus_one
    return {"raw": (q, k, v, g), "feat": (phi(q), phi(k), v, g)}


def compile_point(fn, mode: str, args):
    """Compiled forward `f(q, k, v)` or gradient of `<f(q, k, v), g>`; args = (q, k, v, g)."""
    if mode == "fwd":
        return jax.jit(fn).lower(*args[:3]).compile(), args[:3]
    grad = jax.grad(lambda q, k, v, g: jnp.vdot(fn(q, k, v), g), argnums=(0, 1, 2))
    return jax.jit(grad).lower(*args).compile(), args


def interleaved(points: dict, rounds: int, slow_s: float, cpu_times: dict | None = None) -> dict:
    """{key: (compiled, args)} -> {key: [seconds]}: a timed warm-up round, then `rounds` rounds
    that each time every point once, in a fresh (seeded) random order: the run right after a
    point that freed large temporaries pays for fresh memory pages, and a fixed or rotated order
    would always put the same neighbour there. A point whose warm-up run took over `slow_s`
    keeps that one post-compilation run as its only measurement (listed first in every point's
    times, so index 0 is always the same round). With `cpu_times` (a dict), each run's process
    CPU time (user + system, all threads) is recorded there under the same keys and indices."""
    cpu_times = {} if cpu_times is None else cpu_times

    def once(key):
        compiled, args = points[key]
        cpu, start = time.process_time(), time.perf_counter()
        jax.block_until_ready(compiled(*args))
        cpu_times.setdefault(key, []).append(time.process_time() - cpu)
        return time.perf_counter() - start

    times = {key: [once(key)] for key in points}
    fast = [key for key in points if times[key][0] <= slow_s]
    order = random.Random(0)
    for _ in range(rounds if fast else 0):
        for key in order.sample(fast, len(fast)):
            times[key].append(once(key))
    return times


def timing_stats(ts):
    """Median and min over the timed rounds (the warm-up alone if that is all there is)."""
    timed = ts[1:] or ts
    return dict(median_s=statistics.median(timed), min_s=min(timed), times_s=ts, rounds=len(timed))


def matmul_point(n: int):
    a, b = (
        jax.random.normal(key, (n, n), jnp.float32) for key in jax.random.split(jax.random.key(1))
    )
    return jax.jit(jnp.matmul).lower(a, b).compile(), (a, b)

"""PaTH attention's gradient memory and time: the blockwise form (O(T)) against the quadratic
reference (O(T²·D)), one call of `path_attention` with its gradient in q, k, v, w, β and the gate.

    python experiments/path_memory.py --out docs/results/path_memory_cpu.json      # ~3 min here

For each T: XLA's compiled temporaries of `jax.grad` (`memory_analysis().temp_size_in_bytes`,
read without running), and the wall time of a forward + backward step (median of `--repeats`
after a warm-up) up to `--max_time_T`. B = 1, H = 2, D = Dv = 64, blocks of 64, float32; the
quadratic form only up to `--max_quadratic_T` (its gradient keeps every key transported at
every step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from linear_attention import kernels as K
from linear_attention.benchmarks import machine_info

B, H, D, BLOCK = 1, 2, 64, 64


def grad_fn(method: str):
    def loss(q, k, v, w, beta, a):
        o = K.path_attention(q, k, v, w, beta, a, method=method, block_size=BLOCK)
        return jnp.sum(o * o)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))


def inputs(t: int):
    keys = jax.random.split(jax.random.key(0), 6)
    q, k, v, w = (jax.random.normal(x, (B, t, H, D)) for x in keys[:4])
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    beta = 2.0 * jax.nn.sigmoid(jax.random.normal(keys[4], (B, t, H)))
    a = jax.nn.log_sigmoid(jax.random.normal(keys[5], (B, t, H)) + 2.0)
    return q, k, v, w, beta, a


def measure(method: str, t: int, timed: bool, repeats: int) -> dict:
    fn = grad_fn(method)
    args = inputs(t)
    compiled = fn.lower(*args).compile()
    row = {
        "method": method,
        "T": t,
        "temp_MiB": compiled.memory_analysis().temp_size_in_bytes / 2**20,
    }
    if timed:
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - start)
        row["step_s"] = statistics.median(times)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="path_memory.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--log2_T", type=int, nargs="+", default=[9, 10, 11, 12, 13])
    parser.add_argument("--max_quadratic_T", type=int, default=2048)
    parser.add_argument("--max_time_T", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    for log2_t in args.log2_T:
        t = 2**log2_t
        for method in ("chunk", "quadratic"):
            if method == "quadratic" and t > args.max_quadratic_T:
                continue
            row = measure(method, t, t <= args.max_time_T, args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    record = {
        "what": "jax.grad of path_attention (q, k, v, w, beta, gate), B=1 H=2 D=Dv=64, block 64",
        "machine": machine_info(),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

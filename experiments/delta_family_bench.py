"""The generalised delta rule's chunk gradients against autodiff through the scan (issue 19 part 7).

    python experiments/delta_family_bench.py --out docs/results/delta_family_cpu.json
    python experiments/delta_family_bench.py --out /tmp/x.json --T 256 --rounds 1   # smoke

At B=1, T=2048, H=4, K=Dv=64, float32, chunk 64, in one process: the gradient of
<o, g> with respect to every input (q, k, v, β or a/b, the log decay) for

  - KDA (`delta_rule` with a log decay per key channel [B,T,H,K]), method "chunk" vs "scan";
  - DPLR (`dplr_delta_rule`, RWKV-7 style a = −κ̂, b = κ̂ ⊙ rate, decay per key), "chunk" vs "scan";
  - Gated DeltaNet (`delta_rule`, a decay per head [B,T,H]), "chunk": the per-channel decay's
    cost is KDA chunk over this, forward and gradient.

Each point is compiled first; its temporary memory is XLA's compiled `temp_size_in_bytes`
(`memory_analysis()`); then `benchmarks.timing.interleaved` times a warm-up round and R rounds,
every point once per round in a fresh random order, wall time. Ratios are medians over rounds of the
ratio within a round (the machine is shared and loaded: its load average is recorded), in wall
time and in process CPU time (user + system, all threads: what the process itself spent, less
sensitive to the load, which stretches a multi-threaded XLA program's wall time more than a
single-threaded token scan's). Targets:
chunk gradient ≥ 4× faster and ≥ 4× less temporary memory than autodiff through the scan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention import kernels as K
from linear_attention.benchmarks.timing import interleaved
from linear_attention.training.machine import machine_info


def make_inputs(T, B=1, H=4, D=64, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    kappa = unit(f(B, T, H, D))
    return dict(
        q=f(B, T, H, D) / 8.0,
        k=unit(f(B, T, H, D)),
        v=f(B, T, H, D),
        beta=jax.nn.sigmoid(f(B, T, H)),
        a_key=-0.5 * jax.nn.sigmoid(f(B, T, H, D)),
        a_head=-0.5 * jax.nn.sigmoid(f(B, T, H)),
        dplr_k=0.5 * f(B, T, H, D),
        dplr_a=-kappa,
        dplr_b=kappa * jax.nn.sigmoid(f(B, T, H, D)),
        g=f(B, T, H, D),
    )


def kernels(chunk_size):
    """name -> (function of the input dict, the input names it differentiates)."""

    def delta(method, decay):
        def f(x):
            return K.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x[decay],
                                method=method, chunk_size=chunk_size)  # fmt: skip

        return f, ("q", "k", "v", "beta", decay)

    def dplr(method):
        def f(x):
            return K.dplr_delta_rule(x["q"], x["dplr_k"], x["v"], x["dplr_a"], x["dplr_b"],
                                     log_decay=x["a_key"], method=method,
                                     chunk_size=chunk_size)  # fmt: skip

        return f, ("q", "dplr_k", "v", "dplr_a", "dplr_b", "a_key")

    return {
        "kda/chunk": delta("chunk", "a_key"),
        "kda/scan": delta("scan", "a_key"),
        "dplr/chunk": dplr("chunk"),
        "dplr/scan": dplr("scan"),
        "gated_delta/chunk": delta("chunk", "a_head"),
    }


# (name, numerator point, denominator point, mode): ratios of time and of temporary memory
COMPARISONS = [
    ("kda_grad_scan_over_chunk", "kda/scan", "kda/chunk", "grad"),
    ("dplr_grad_scan_over_chunk", "dplr/scan", "dplr/chunk", "grad"),
    ("per_key_over_per_head_fwd", "kda/chunk", "gated_delta/chunk", "fwd"),
    ("per_key_over_per_head_grad", "kda/chunk", "gated_delta/chunk", "grad"),
]


def compile_point(fn, names, mode, x):
    args = {n: x[n] for n in names}
    rest = {n: v for n, v in x.items() if n not in names}
    if mode == "fwd":
        compiled = jax.jit(lambda a, r: fn({**a, **r})).lower(args, rest).compile()
    else:

        def loss(a, r):
            return jnp.vdot(fn({**a, **r}), r["g"])

        compiled = jax.jit(jax.grad(loss)).lower(args, rest).compile()
    mem = compiled.memory_analysis()
    temp = None if mem is None else int(mem.temp_size_in_bytes)
    return compiled, (args, rest), temp


def ratio(times, a, b):
    """Median over rounds of t_a / t_b within a round (the warm-up round excluded if timed)."""
    pairs = list(zip(times[a], times[b], strict=False))
    pairs = pairs[1:] or pairs
    return statistics.median(x / y for x, y in pairs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--chunk_size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    info = machine_info()
    x = make_inputs(args.T)
    points, temps = {}, {}
    for name, (fn, names) in kernels(args.chunk_size).items():
        modes = ("fwd", "grad") if name.startswith(("kda/chunk", "gated")) else ("grad",)
        for mode in modes:
            compiled, call_args, temp = compile_point(fn, names, mode, x)
            points[name, mode] = (compiled, call_args)
            temps[f"{name}/{mode}"] = temp
            print(f"compiled {name}/{mode}: temp {temp / 2**20:.1f} MiB", flush=True)
    cpu = {}
    times = interleaved(points, rounds=args.rounds, slow_s=60.0, cpu_times=cpu)
    median = {f"{n}/{m}": statistics.median(ts[1:] or ts) for (n, m), ts in times.items()}
    median_cpu = {f"{n}/{m}": statistics.median(ts[1:] or ts) for (n, m), ts in cpu.items()}
    results = {
        "machine": {**info, "load_avg_end": os.getloadavg()},
        "shape": dict(B=1, T=args.T, H=4, K=64, Dv=64, chunk_size=args.chunk_size),
        "rounds": args.rounds,
        "temp_bytes": temps,
        "median_s": median,
        "times_s": {f"{n}/{m}": ts for (n, m), ts in times.items()},
        "median_cpu_s": median_cpu,
        "cpu_times_s": {f"{n}/{m}": ts for (n, m), ts in cpu.items()},
        "ratios": {
            f"{name}_{what}": (
                ratio(times, (a, mode), (b, mode))
                if what == "time"
                else ratio(cpu, (a, mode), (b, mode))
                if what == "cpu_time"
                else temps[f"{a}/{mode}"] / temps[f"{b}/{mode}"]
            )
            for name, a, b, mode in COMPARISONS
            for what in ("time", "cpu_time", "temp")
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    for key, value in results["ratios"].items():
        print(f"{key}: {value:.2f}")
    for key, value in median.items():
        print(
            f"{key}: {value * 1e3:.1f} ms wall, {median_cpu[key] * 1e3:.1f} ms cpu, "
            f"temp {temps[key] / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()

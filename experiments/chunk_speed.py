"""The chunk kernel's CPU speed before and after a change, in one process, against the baselines.

    python experiments/chunk_speed.py --out runs/chunk_speed --before d5babeb   # ~2 min here
    python experiments/chunk_speed.py --out /tmp/cs --T 256 --repeats 1         # smoke test

Loads `kernels/chunked.py` of the working tree ("after") and, with `--before REV`, the same file
at a git revision ("before") as a second module, and times both, `naive_chunked_causal` of
`baselines.py` and a float32 N×N matmul (the machine's matmul peak), forward and
forward+backward, in interleaved rounds that each start one point later (B=1, H=4, d=64,
chunk 64, elu+1 features, normalised, no decay: the issue's headline shape at T=16384). Each run
is timed in wall time and in process CPU time (user + system, all threads): on a machine shared
with other jobs, the CPU time is what the run itself cost. Reported per round and as medians:
ms, speedups over the naive form (median over rounds of t_naive / t), the forward's fraction of
the matmul peak (forward FLOPs 4·T·H·(C·d + d²) per second over the matmul's), and XLA's
temporary memory. Writes `results.json` and `speed.png`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from linear_attention import kernels as K

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from baselines import naive_chunked_causal  # noqa: E402
from machine import machine_info  # noqa: E402

B, H, D, C = 1, 4, 64, 64
KERNEL = "linear_attention/kernels/chunked.py"


def load_kernel(rev: str | None):
    """`causal_chunked` of the working tree (rev None) or of KERNEL at git revision `rev`."""
    path = ROOT / KERNEL
    if rev is not None:
        source = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{KERNEL}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        path = Path(tempfile.mkdtemp()) / f"chunked_{rev}.py"
        path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"chunked_{rev or 'tree'}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def fn(q, k, v):
        kv0, z0 = jnp.zeros((B, H, D, D)), jnp.zeros((B, H, D))
        return module.causal_chunked(
            q, k, v, None, kv0, z0, chunk_size=C, normalize=True, eps=1e-6
        )[0]

    return fn


def compile_points(fns: dict, T: int, matmul_n: int) -> dict:
    q, k, v, g = (
        jax.random.normal(key, (B, T, H, D), jnp.float32)
        for key in jax.random.split(jax.random.key(0), 4)
    )
    q, k = K.feature_maps.elu_plus_one(q), K.feature_maps.elu_plus_one(k)
    points = {}
    for name, fn in fns.items():
        points[name, "fwd"] = (jax.jit(fn).lower(q, k, v).compile(), (q, k, v))
        grad = jax.grad(lambda q, k, v, g, fn=fn: jnp.vdot(fn(q, k, v), g), argnums=(0, 1, 2))
        points[name, "grad"] = (jax.jit(grad).lower(q, k, v, g).compile(), (q, k, v, g))
    a = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), jnp.float32)
    points["matmul", "fwd"] = (jax.jit(jnp.matmul).lower(a, a).compile(), (a, a))
    return points


def time_rounds(points: dict, rounds: int) -> dict:
    """{key: {"wall": [s], "cpu": [s]}} over `rounds` rounds after one warm-up round.

    Each round starts one point later than the previous: what runs right after the naive form
    (which frees ~150 MiB of temporaries) pays for fresh pages, so no point may always be there.
    """
    times = {key: {"wall": [], "cpu": []} for key in points}
    keys = list(points)
    for r in range(rounds + 1):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            compiled, args = points[key]
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(compiled(*args))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if r:
                times[key]["wall"].append(wall)
                times[key]["cpu"].append(cpu)
    return times


def summarize(times: dict, points: dict, T: int, matmul_n: int) -> list[dict]:
    flops = 4.0 * B * T * H * (C * D + D * D)
    records = []
    for (name, mode), ts in times.items():
        if name == "matmul":
            continue
        rec = dict(
            name=name,
            mode=mode,
            T=T,
            temp_MiB=points[name, mode][0].memory_analysis().temp_size_in_bytes / 2**20,
        )
        for clock in ("wall", "cpu"):
            own, naive = ts[clock], times["naive", mode][clock]
            rec[f"{clock}_ms"] = statistics.median(own) * 1e3
            rec[f"{clock}_times_s"] = own
            rec[f"{clock}_speedup_vs_naive"] = statistics.median(
                n / t for n, t in zip(naive, own, strict=True)
            )
            if mode == "fwd":
                peak = [2.0 * matmul_n**3 / t for t in times["matmul", "fwd"][clock]]
                rec[f"{clock}_matmul_gflops"] = statistics.median(peak) / 1e9
                rec[f"{clock}_fraction_of_peak"] = statistics.median(
                    flops / t / p for t, p in zip(own, peak, strict=True)
                )
        records.append(rec)
    return records


def plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, clock in zip(axes, ("wall", "cpu"), strict=True):
        names = list(dict.fromkeys(r["name"] for r in records))
        for i, mode in enumerate(("fwd", "grad")):
            ys = [
                next(r[f"{clock}_ms"] for r in records if (r["name"], r["mode"]) == (n, mode))
                for n in names
            ]
            ax.bar([j + 0.4 * i for j in range(len(names))], ys, 0.4, label=mode)
        ax.set_xticks([j + 0.2 for j in range(len(names))], names)
        ax.set(title=f"{clock} time, median (ms)", ylabel="ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out, before=None, T=16384, repeats=9, matmul_n=2048, log=print):
    """Time the kernels into `out`; returns the results dict (also written as results.json)."""
    if T < C or T % C or repeats < 1:
        raise ValueError(f"T must be a multiple of {C} and repeats >= 1, got {T=}, {repeats=}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fns = {"naive": naive_chunked_causal, "chunk": load_kernel(None)}
    if before is not None:
        fns[f"chunk@{before}"] = load_kernel(before)
    start = time.time()
    results = dict(
        machine=machine_info(),
        config=dict(T=T, B=B, H=H, d=D, chunk_size=C, repeats=repeats, matmul_n=matmul_n),
        before=before,
    )
    points = compile_points(fns, T, matmul_n)
    times = time_rounds(points, repeats)
    results["records"] = summarize(times, points, T, matmul_n)
    results["machine"].update(load_avg_end=os.getloadavg(), wall_s=time.time() - start)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results["records"], out / "speed.png")
    for r in results["records"]:
        log(
            f"{r['name']:>16} {r['mode']:4}: wall {r['wall_ms']:7.1f} ms "
            f"({r['wall_speedup_vs_naive']:.2f}x naive), cpu {r['cpu_ms']:7.1f} ms "
            f"({r['cpu_speedup_vs_naive']:.2f}x naive)"
            + (
                f", peak fraction wall {r['wall_fraction_of_peak']:.2f} "
                f"cpu {r['cpu_fraction_of_peak']:.2f}"
                if r["mode"] == "fwd"
                else ""
            )
            + f", temp {r['temp_MiB']:.1f} MiB"
        )
    log(f"load average {results['machine']['load_avg_start']} -> {os.getloadavg()}")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/chunk_speed")
    p.add_argument("--before", help="git revision whose kernels/chunked.py is timed as well")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--matmul_n", type=int, default=2048)
    a = p.parse_args(argv)
    run(a.out, a.before, a.T, a.repeats, a.matmul_n)


if __name__ == "__main__":
    main()

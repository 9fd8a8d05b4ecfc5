"""The chunk kernel of another commit against the working tree's, interleaved in one process.

    python experiments/chunk_ab.py --base b4e42a8 --out runs/chunk_ab --T 16384 --repeats 15

Loads `linear_attention/kernels` of `--base` (via `git archive`, renamed so both import side by
side), then times `causal_linear_attention(method="chunk")` forward and forward+backward (the
gradient of <o, g> w.r.t. q, k, v) for each decay kind — none, per head ([B, T, H]) and, in the
working tree only, per key dimension ([B, T, H, d]) — at B=1, H=4, d=64, float32, elu+1 features.
Every round times every variant once; ratios are medians over rounds of new/base in the same
round (the machine is shared). Writes `results.json` and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from linear_attention import kernels as K  # noqa: E402

B, H, D = 1, 4, 64


def load_base(commit: str, into: Path):
    """The `kernels` package of `commit`, importable as `la_base.kernels`."""
    tar = subprocess.run(
        [
            "git",
            "-C",
            str(ROOT),
            "archive",
            commit,
            "linear_attention/kernels",
            "linear_attention/__init__.py",
        ],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    pkg = into / "la_base"
    (into / "linear_attention").rename(pkg)
    (pkg / "__init__.py").write_text("")
    for f in pkg.rglob("*.py"):
        f.write_text(f.read_text().replace("linear_attention.", "la_base."))
    sys.path.insert(0, str(into))
    return importlib.import_module("la_base.kernels")


def variant(kernels, decay):
    def f(q, k, v):
        a = None
        if decay == "head":
            a = -0.1 * jax.nn.sigmoid(q[..., 0])
        elif decay == "key":
            a = -0.1 * jax.nn.sigmoid(q)
        return kernels.causal_linear_attention(q, k, v, log_decay=a, method="chunk")

    return f


def run(base: str, out: Path, T: int, repeats: int, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()  # records the load average at the start
    with tempfile.TemporaryDirectory() as tmp:
        old = load_base(base, Path(tmp))
        q, k, v, g = (
            jax.random.normal(key, (B, T, H, D)) for key in jax.random.split(jax.random.key(0), 4)
        )
        q, k = K.feature_maps.elu_plus_one(q), K.feature_maps.elu_plus_one(k)
        compiled = {}
        for decay in ("none", "head", "key"):
            for name, kern in (("base", old), ("new", K)):
                if name == "base" and decay == "key":
                    continue  # per key dimension is new
                f = variant(kern, None if decay == "none" else decay)
                grad = jax.grad(lambda q, k, v, g, f=f: jnp.vdot(f(q, k, v), g), (0, 1, 2))
                compiled[name, decay, "fwd"] = (jax.jit(f).lower(q, k, v).compile(), (q, k, v))
                compiled[name, decay, "grad"] = (
                    jax.jit(grad).lower(q, k, v, g).compile(),
                    (q, k, v, g),
                )
        times = {key: [] for key in compiled}
        for _ in range(repeats + 1):  # the first round is a warm-up
            for key, (c, args) in compiled.items():
                t0 = time.perf_counter()
                jax.block_until_ready(c(*args))
                times[key].append(time.perf_counter() - t0)
    rows = []
    for (name, decay, mode), ts in times.items():
        row = dict(
            kernel=name,
            decay=decay,
            mode=mode,
            median_ms=1e3 * statistics.median(ts[1:]),
            times_s=ts,
        )
        if name == "new" and ("base", decay, mode) in times:
            base_ts = times["base", decay, mode]
            row["new_over_base"] = statistics.median(
                n / b for n, b in zip(ts[1:], base_ts[1:], strict=True)
            )
        if name == "new" and decay == "key":
            head_ts = times["new", "head", mode]
            row["over_per_head"] = statistics.median(
                n / h for n, h in zip(ts[1:], head_ts[1:], strict=True)
            )
        rows.append(row)
    machine["load_avg_end"] = os.getloadavg()
    results = dict(
        machine=machine, config=dict(base=base, T=T, B=B, H=H, d=D, repeats=repeats), rows=rows
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    log(f"T={T}, {repeats} rounds, load {machine['load_avg_end']}")
    log("| kernel | decay | mode | median ms | new / base | vs per head |")
    log("|---|---|---|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['new_over_base']:.3f}" if "new_over_base" in r else ""
        head = f"{r['over_per_head']:.2f}" if "over_per_head" in r else ""
        log(
            f"| {r['kernel']} | {r['decay']} | {r['mode']} | {r['median_ms']:.1f} | {ratio} "
            f"| {head} |"
        )
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="commit whose chunk kernel is the baseline")
    p.add_argument("--out", default="runs/chunk_ab")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    run(a.base, Path(a.out), a.T, a.repeats)


if __name__ == "__main__":
    main()

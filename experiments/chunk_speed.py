"""The chunk kernel's CPU speed against the issue-13 targets, and against another revision.

    python experiments/chunk_speed.py --out runs/chunk_speed                    # ~1 min here
    python experiments/chunk_speed.py --out runs/cs --before d5babeb --decays none head key
    python experiments/chunk_speed.py --out /tmp/cs --T 256 --repeats 1 --matmul_n 64  # smoke

Times, in one process, `causal_linear_attention(method="chunk")` (the library call, as in
`benchmark.py`: B=1, H=4, d=64, float32, chunk 64, elu+1 features computed outside, normalised)
for each decay kind asked for — none, per head ([B, T, H]) and per key dimension ([B, T, H, d]),
both −0.1·sigmoid(q) inside the timed function — with `--before REV` the same calls into the
`linear_attention/kernels` package of git revision REV (loaded beside the tree's), the
baseline `naive_chunked_causal` of `linear_attention.benchmarks.baselines` (no decay) and a
float32 N×N matmul (the machine's matmul peak). Forward `f(q, k, v)` and forward+backward (the
gradient of <f(q, k, v), g> w.r.t. q, k, v), compiled first, then timed by `timing.interleaved`: a
warm-up round and R rounds, each in a fresh random order, in wall time and in process CPU time
(user + system, all threads: on a shared machine what the run itself cost). Ratios are medians
over rounds of the ratio within a round.

Reports the issue's targets at the headline shape (T=16384, no decay): forward ≥ 3.5× and
forward+backward ≥ 3× faster than the naive chunked form, forward at ≥ 0.40 of the matmul peak
(forward FLOPs 4·T·H·(C·d + d²) per second over the matmul's, per round), gradient temporaries
(XLA's compiled `temp_size_in_bytes`) ≤ 64 MiB; each in wall and CPU time. Also timed: `stream`,
one elementwise pass over the same arrays (the memory traffic no kernel avoids), and each
kernel's time over it; a forward as fast as `stream` would reach `fraction_of_peak_at_stream` of
the matmul peak, the most the peak-fraction target can show on the machine. Writes
`results.json` and `speed.png`; prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
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

from linear_attention.benchmarks.baselines import naive_chunked_causal
from linear_attention.benchmarks.timing import (
    DEFAULT_CHUNK,
    B,
    D,
    H,
    chunk_flops,
    compile_point,
    interleaved,
    linear_fn,
    make_inputs,
    matmul_point,
)
from linear_attention.training.machine import machine_info

ROOT = Path(__file__).resolve().parents[1]

DECAYS = ("none", "head", "key")
MODES = ("fwd", "grad")
CLOCKS = ("wall", "cpu")
# the issue's targets: (record field, comparison, bound)
TARGETS = {
    "fwd_speedup_vs_naive": (">=", 3.5),
    "grad_speedup_vs_naive": (">=", 3.0),
    "fwd_fraction_of_peak": (">=", 0.40),
    "grad_temp_MiB": ("<=", 64.0),
}


def load_kernels(rev: str, into: Path):
    """The `linear_attention/kernels` package of git revision `rev`, importable beside the tree's
    (extracted under `into` as `la_<rev>`, its imports renamed), with the package-level modules
    the kernels import where `rev` has them (`fields.py`, the field checker)."""
    paths = ["linear_attention/kernels"]
    for extra in ("linear_attention/fields.py",):
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, extra],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        paths += [extra] if listed.strip() else []
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, *paths],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    name = f"la_{rev}".replace("-", "_").replace("~", "_").replace("^", "_")
    pkg = into / name
    (into / "linear_attention").rename(pkg)
    (pkg / "__init__.py").write_text("")
    for f in pkg.rglob("*.py"):
        f.write_text(f.read_text().replace("linear_attention.", f"{name}."))
    # registered as a top-level package of its own folder (sys.path untouched): its renamed
    # absolute imports resolve inside it
    spec = importlib.util.spec_from_file_location(
        name, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
    return importlib.import_module(f"{name}.kernels")


def compile_points(kernels: dict, decays, T: int, matmul_n: int, log) -> tuple[dict, dict]:
    """{(name, decay, mode): (compiled, args)} and {(name, decay, mode): reason} for the skipped."""
    inputs = make_inputs(T)["feat"]
    points, skipped = {}, {}
    for mode in MODES:
        points["naive", "none", mode] = compile_point(naive_chunked_causal, mode, inputs)
        for name, kern in kernels.items():
            for decay in decays:
                fn = linear_fn("chunk", DEFAULT_CHUNK, None if decay == "none" else decay, kern)
                try:
                    points[name, decay, mode] = compile_point(fn, mode, inputs)
                except (ValueError, TypeError) as e:  # an old revision without that decay kind
                    skipped[name, decay, mode] = f"{type(e).__name__}: {e}"
                    log(f"skip {name} {decay} {mode}: {e}")
    points["matmul", "none", "fwd"] = matmul_point(matmul_n)
    # the memory traffic no kernel avoids (see `stream`)
    points["stream", "none", "fwd"] = jax.jit(stream).lower(*inputs[:3]).compile(), inputs[:3]
    points["stream", "none", "grad"] = jax.jit(stream_grad).lower(*inputs).compile(), inputs
    return points, skipped


def stream(q, k, v):
    """One elementwise pass that reads q, k, v and writes an array of v's shape: the forward's
    unavoidable memory traffic. On a machine with little memory bandwidth this, not the matmul
    peak, bounds the kernel."""
    return q + k + v


def stream_grad(q, k, v, g):
    """The gradient's unavoidable traffic: reads q, k, v and the cotangent g, writes three
    arrays (autodiff of `stream` would only forward g)."""
    return q * g, k * g, v * g


def _ratio(num, den):
    """Median over rounds of num / den within a round (index 0, the warm-up, left out)."""
    return statistics.median(n / d for n, d in zip(num[1:], den[1:], strict=True))


def summarize(points: dict, times: dict, T: int, matmul_n: int, before: str | None) -> list:
    flops = chunk_flops(T, DEFAULT_CHUNK)
    records = []
    for key, (compiled, _) in points.items():
        name, decay, mode = key
        if name in ("matmul", "stream"):
            continue
        rec = dict(
            name=name,
            decay=decay,
            mode=mode,
            T=T,
            temp_MiB=compiled.memory_analysis().temp_size_in_bytes / 2**20,
        )
        for clock in CLOCKS:
            own = times[clock][key]
            rec[f"{clock}_times_s"] = own
            rec[f"{clock}_ms"] = statistics.median(own[1:]) * 1e3
            rec[f"{clock}_min_ms"] = min(own[1:]) * 1e3
            if decay == "none":
                rec[f"{clock}_speedup_vs_naive"] = _ratio(times[clock]["naive", "none", mode], own)
            if before is not None and name == "chunk" and (f"@{before}", decay, mode) in points:
                rec[f"{clock}_over_before"] = _ratio(own, times[clock][f"@{before}", decay, mode])
            st = times[clock]["stream", "none", mode]
            rec[f"{clock}_stream_ms"] = statistics.median(st[1:]) * 1e3
            rec[f"{clock}_over_stream"] = _ratio(own, st)
            if mode == "fwd" and decay == "none":
                mm = times[clock]["matmul", "none", "fwd"]
                peak = [2.0 * matmul_n**3 / t for t in mm[1:]]
                rec[f"{clock}_matmul_gflops"] = statistics.median(peak) / 1e9
                rec[f"{clock}_fraction_of_peak"] = statistics.median(
                    flops / t / p for t, p in zip(own[1:], peak, strict=True)
                )
                # the fraction a kernel as fast as its memory traffic alone would reach
                rec[f"{clock}_fraction_of_peak_at_stream"] = statistics.median(
                    flops / t / p for t, p in zip(st[1:], peak, strict=True)
                )
        records.append(rec)
    return records


def targets(records: list, name: str = "chunk") -> dict:
    """The issue's four targets for `name` (no decay), per clock: value and whether it is met."""
    rec = {r["mode"]: r for r in records if r["name"] == name and r["decay"] == "none"}
    out = {}
    for clock in CLOCKS:
        values = {
            "fwd_speedup_vs_naive": rec["fwd"][f"{clock}_speedup_vs_naive"],
            "grad_speedup_vs_naive": rec["grad"][f"{clock}_speedup_vs_naive"],
            "fwd_fraction_of_peak": rec["fwd"][f"{clock}_fraction_of_peak"],
            "grad_temp_MiB": rec["grad"]["temp_MiB"],
        }
        out[clock] = {
            field: dict(value=v, bound=b, met=(v >= b) if op == ">=" else (v <= b))
            for field, v in values.items()
            for op, b in [TARGETS[field]]
        }
    return out


def plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(f"{r['name']}\n{r['decay']}" for r in records))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(labels)), 4))
    for ax, clock in zip(axes, CLOCKS, strict=True):
        for i, mode in enumerate(MODES):
            ys = {
                f"{r['name']}\n{r['decay']}": r[f"{clock}_ms"] for r in records if r["mode"] == mode
            }
            ax.bar([j + 0.4 * i for j in range(len(labels))], [ys.get(l, 0) for l in labels], 0.4,
                   label=mode)  # fmt: skip
        ax.set_xticks([j + 0.2 for j in range(len(labels))], labels, fontsize=8)
        ax.set(title=f"{clock} time, median (ms)", ylabel="ms", yscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results) -> str:
    lines = [
        "| kernel | decay | pass | wall ms (min) | CPU ms (min) | × naive wall / CPU "
        "| over before wall / CPU | peak fraction wall / CPU | × stream wall / CPU | temp MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def pair(r, field, fmt):
        if f"wall_{field}" not in r:
            return ""
        return f"{r[f'wall_{field}']:{fmt}} / {r[f'cpu_{field}']:{fmt}}"

    for r in results["records"]:
        lines.append(
            f"| {r['name']} | {r['decay']} | {r['mode']} "
            f"| {r['wall_ms']:.1f} ({r['wall_min_ms']:.1f}) | {r['cpu_ms']:.1f} "
            f"({r['cpu_min_ms']:.1f}) | {pair(r, 'speedup_vs_naive', '.2f')} "
            f"| {pair(r, 'over_before', '.3f')} | {pair(r, 'fraction_of_peak', '.2f')} "
            f"| {pair(r, 'over_stream', '.2f')} | {r['temp_MiB']:.1f} |"
        )
    lines.append("")
    for name, per_clock in results["targets"].items():
        for clock, ts in per_clock.items():
            lines.append(
                f"{name}, {clock}: "
                + ", ".join(
                    f"{f} {t['value']:.2f} ({'met' if t['met'] else 'NOT met'}, bound {t['bound']})"
                    for f, t in ts.items()
                )
            )
    for r in results["records"]:
        if r["name"] == "chunk" and r["decay"] == "none":
            lines.append(
                f"stream ({r['mode']}): {r['wall_stream_ms']:.1f} ms wall / "
                f"{r['cpu_stream_ms']:.1f} ms CPU"
                + (
                    "; a forward that fast would be at "
                    f"{pair(r, 'fraction_of_peak_at_stream', '.2f')} of the matmul peak"
                    " (wall / CPU)"
                    if r["mode"] == "fwd"
                    else ""
                )
            )
    m = results["machine"]
    lines.append(f"load average {m['load_avg_start']} -> {m['load_avg_end']}")
    return "\n".join(lines)


def run(out, before=None, T=16384, repeats=9, matmul_n=2048, decays=("none",), log=print):
    """Time the kernels into `out`; returns the results dict (also written as results.json)."""
    if T < DEFAULT_CHUNK or T % DEFAULT_CHUNK or repeats < 1 or not set(decays) <= set(DECAYS):
        raise ValueError(
            f"T must be a multiple of {DEFAULT_CHUNK} (the naive form's chunk), repeats >= 1 and "
            f"decays in {DECAYS}; got {T=}, {repeats=}, {decays=}"
        )
    if "none" not in decays:
        decays = ("none", *decays)  # the targets are stated without decay
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = dict(
        machine=machine_info(),
        config=dict(
            T=T,
            B=B,
            H=H,
            d=D,
            chunk_size=DEFAULT_CHUNK,
            repeats=repeats,
            matmul_n=matmul_n,
            decays=list(decays),
        ),  # fmt: skip
        before=before,
    )
    with tempfile.TemporaryDirectory() as tmp:
        from linear_attention import kernels as K

        kernels = {"chunk": K}
        if before is not None:
            kernels[f"@{before}"] = load_kernels(before, Path(tmp))
        points, skipped = compile_points(kernels, decays, T, matmul_n, log)
        cpu = {}
        wall = interleaved(points, repeats, slow_s=float("inf"), cpu_times=cpu)
    results["machine"].update(load_avg_end=os.getloadavg(), wall_s=time.time() - start)
    results["records"] = summarize(points, {"wall": wall, "cpu": cpu}, T, matmul_n, before)
    results["stream_times_s"] = {
        mode: dict(wall=wall["stream", "none", mode], cpu=cpu["stream", "none", mode])
        for mode in MODES
    }
    results["skipped"] = [
        dict(name=n, decay=d, mode=m, reason=r) for (n, d, m), r in skipped.items()
    ]
    results["targets"] = {name: targets(results["records"], name) for name in kernels}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results["records"], out / "speed.png")
    log(table(results))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/chunk_speed")
    p.add_argument("--before", help="git revision whose kernels are timed as well")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--matmul_n", type=int, default=2048)
    p.add_argument("--decays", nargs="+", default=["none"], choices=DECAYS)
    a = p.parse_args(argv)
    run(a.out, a.before, a.T, a.repeats, a.matmul_n, tuple(a.decays))


if __name__ == "__main__":
    main()

"""Time and compiled memory of the attention kernels against sequence length.

    python experiments/benchmark.py --out runs/benchmark --preset full    # 10-20 min on 2 cores
    python experiments/benchmark.py --out /tmp/bench --preset quick      # ~30 s, compiling

Shape B=1, H=4, d=64, float32, T = 256 … 65536 (full). Linear methods and the baselines get keys
and queries featurised with elu+1 (featurisation is outside the timed function); the softmax
methods get the raw ones. "fwd" times `f(q, k, v)`, "grad" times the gradient of the scalar
`<f(q, k, v), g>` (fixed random g) w.r.t. q, k and v. "chunk_decay" and "chunk_gla" are the chunk
method with a data-dependent log decay per head ([B, T, H]) and per key dimension ([B, T, H, d]).

Method: for each T, everything is compiled first (which also gives XLA's temporary memory,
`memory_analysis().temp_size_in_bytes`, without running), then a warm-up round, then R rounds
that each time every implementation once. The machine is shared, so times are medians over the
R rounds and speedups are medians over rounds of `t_baseline / t_method` within the same round.
A point whose warm-up run took over `--slow_s` is not run again: that one post-compilation run
is its measurement (blockwise softmax at large T). A point is skipped (recorded with the reason)
when its temporaries exceed `--mem_budget_gb` (predicted from the growth over the two previous T
before compiling, then checked on the compiled program) or when the same method and pass took
longer than `--time_budget_s` at a smaller T; once skipped, a method and pass stays skipped at
every larger T.

Also: a chunk-size sweep of the chunk method at the headline T, and the headline itself (chunk
vs the baselines, gradient memory, fraction of the matmul peak, a 2048² float32 matmul timed in
the same rounds). Writes `results.json`, `time_vs_T.png`, `memory_vs_T.png`; prints tables.

The delta rule (`--parts delta`, Gated DeltaNet: L2-normalised keys, β = sigmoid, a data-dependent
log decay): `K.delta_rule` "chunk" (WY form, remat gradient) against "scan" (autodiff through a
plain `lax.scan` over tokens: the baseline), gradient w.r.t. q, k, v, β and the log decay, with
the same interleaved rounds and memory budget; headline at T=2048 (target: chunk gradient ≥ 5×
faster, ≥ 4× less temporary memory). Writes `delta_vs_T.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from linear_attention import kernels as K
from linear_attention.benchmarks.baselines import naive_chunked_causal, performer_causal
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
    timing_stats,
)
from linear_attention.training.machine import machine_info

MODES = ("fwd", "grad")
BASELINES = ("naive_chunked_causal", "performer_causal")
CHUNK_SIZES = (16, 32, 64, 128, 256)
HEADLINE_T = 16384
DELTA_METHODS = ("delta_chunk", "delta_scan")  # delta_scan: autodiff through lax.scan
DELTA_HEADLINE_T = 2048
PARTS = ("linear", "delta")
PRESETS = {
    "quick": dict(T=(64, 128), repeats=2, chunk_sizes=(16, 64), matmul_n=256, delta_T=(64, 128)),
    "full": dict(
        T=tuple(256 * 2**i for i in range(9)),
        repeats=5,
        chunk_sizes=CHUNK_SIZES,
        matmul_n=2048,
        delta_T=tuple(256 * 2**i for i in range(6)),
    ),
}


# name -> (function of (q, k, v), whether it takes featurised q and k)
METHODS = {
    "chunk": (linear_fn("chunk"), True),
    "chunk_decay": (linear_fn("chunk", decay="head"), True),
    "chunk_gla": (linear_fn("chunk", decay="key"), True),
    "scan": (linear_fn("scan"), True),
    "associative_scan": (linear_fn("associative_scan"), True),
    "quadratic": (linear_fn("quadratic"), True),
    "softmax": (lambda q, k, v: K.softmax_attention(q, k, v, causal=True), False),
    "blockwise_softmax": (
        lambda q, k, v: K.blockwise_softmax_attention(q, k, v, causal=True),
        False,
    ),
    "naive_chunked_causal": (naive_chunked_causal, True),
    "performer_causal": (performer_causal, True),
}


def summarize(times: dict, records: dict) -> None:
    """Fill medians and speedups vs the baselines: median over the rounds both were timed in of
    t_baseline / t_method (the warm-up round when one of them was timed only there)."""
    for (name, mode), ts in times.items():
        rec = records[name, mode]
        rec.update(timing_stats(ts))
        for base in BASELINES:
            if (base, mode) in times and base != name:
                pairs = list(zip(times[base, mode], ts, strict=False))  # to the shorter
                pairs = pairs[1:] or pairs
                rec[f"speedup_vs_{base}"] = statistics.median(b / t for b, t in pairs)


def run_T_sweep(T_list, methods, repeats, budgets, headline_T, matmul_n, log):
    """Every method and pass at every T. Returns (records, matmul timing at headline_T).

    A method and pass skipped at some T (over a budget) stays skipped at every larger T."""
    mem_budget, time_budget, slow_s = budgets
    records, temps, blocked, matmul = [], {}, {}, None
    for T in T_list:
        inputs = make_inputs(T)
        points, recs = {}, {}
        for name in methods:
            fn, featurised = METHODS[name]
            for mode in MODES:
                key = name, mode
                rec = recs[key] = dict(method=name, mode=mode, T=T, temp_bytes=None)
                records.append(rec)
                past = temps.setdefault(key, [])  # temp_bytes at the previous T
                if len(past) >= 2 and past[-1] and past[-2]:
                    predicted = past[-1] ** 2 / past[-2]  # same growth as the last doubling
                    if predicted > mem_budget:
                        blocked.setdefault(
                            key, f"predicted temp {predicted / 2**30:.2g} GiB at T={T}"
                        )
                if key not in blocked:
                    compiled, args = compile_point(
                        fn, mode, inputs["feat" if featurised else "raw"]
                    )
                    rec["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
                    past.append(rec["temp_bytes"])
                    if rec["temp_bytes"] > mem_budget:
                        blocked[key] = f"temp {rec['temp_bytes'] / 2**30:.2g} GiB at T={T}"
                if key in blocked:
                    rec["skipped"] = f"over budget: {blocked[key]}"
                    continue
                points[key] = (compiled, args)
        if T == headline_T:
            points["matmul", "fwd"] = matmul_point(matmul_n)
        times = interleaved(points, repeats, slow_s)
        if T == headline_T:
            matmul = dict(n=matmul_n, **timing_stats(times.pop(("matmul", "fwd"))))
        summarize(times, recs)
        for key, rec in recs.items():
            if rec.get("median_s", 0) > time_budget:
                blocked[key] = f"took {rec['median_s']:.3g} s at T={T}"
        log(
            f"T={T}: "
            + ", ".join(
                f"{n}/{m} {r['median_s'] * 1e3:.1f} ms"
                for (n, m), r in recs.items()
                if "median_s" in r
            )
        )
    return records, matmul


def run_chunk_sweep(T, chunk_sizes, repeats, slow_s):
    """The chunk method at each chunk size, both passes, interleaved in the same rounds."""
    inputs = make_inputs(T)["feat"]
    points, recs = {}, {}
    for C in chunk_sizes:
        for mode in MODES:
            compiled, args = compile_point(linear_fn("chunk", C), mode, inputs)
            points[C, mode] = (compiled, args)
            recs[C, mode] = dict(
                chunk_size=C,
                mode=mode,
                T=T,
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
            )
    for (C, mode), ts in interleaved(points, repeats, slow_s).items():
        recs[C, mode].update(timing_stats(ts))
    records = list(recs.values())
    best = {
        mode: min((r for r in records if r["mode"] == mode), key=lambda r: r["median_s"])[
            "chunk_size"
        ]
        for mode in MODES
    }
    return dict(T=T, records=records, fastest=best)


# ---- the delta rule: chunk (WY form) vs autodiff through a plain lax.scan ----


def make_delta_inputs(T: int, seed: int = 0):
    """(q, k, v, beta, log_decay, g): unit-norm keys, β in (0, 1), log decay in (−1, 0)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    q, k, v, g = (jax.random.normal(keys[i], (B, T, H, D), jnp.float32) for i in range(4))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))
    log_decay = -jax.nn.sigmoid(jax.random.normal(keys[5], (B, T, H)))
    return q, k, v, beta, log_decay, g


def _delta(name):
    method = name.removeprefix("delta_")
    return lambda q, k, v, beta, a: K.delta_rule(
        q, k, v, beta, log_decay=a, method=method, chunk_size=DEFAULT_CHUNK
    )


def compile_delta(name: str, mode: str, args):
    """Compiled forward or gradient (w.r.t. q, k, v, β, log decay) of `<delta_rule(...), g>`."""
    fn = _delta(name)
    if mode == "fwd":
        return jax.jit(fn).lower(*args[:5]).compile(), args[:5]
    grad = jax.grad(lambda *a: jnp.vdot(fn(*a[:5]), a[5]), argnums=(0, 1, 2, 3, 4))
    return jax.jit(grad).lower(*args).compile(), args


def run_delta_sweep(T_list, repeats, mem_budget, slow_s, log):
    """Both delta-rule methods and passes at every T, interleaved; speedups of chunk vs scan
    (median over rounds of t_scan / t_chunk). Over the memory budget: skipped from then on."""
    records, blocked = [], {}
    for T in T_list:
        inputs = make_delta_inputs(T)
        points, recs = {}, {}
        for name in DELTA_METHODS:
            for mode in MODES:
                key = name, mode
                rec = recs[key] = dict(method=name, mode=mode, T=T, temp_bytes=None)
                records.append(rec)
                if key not in blocked:
                    compiled, args = compile_delta(name, mode, inputs)
                    rec["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
                    if rec["temp_bytes"] > mem_budget:
                        blocked[key] = f"temp {rec['temp_bytes'] / 2**30:.2g} GiB at T={T}"
                if key in blocked:
                    rec["skipped"] = f"over budget: {blocked[key]}"
                    continue
                points[key] = (compiled, args)
        times = interleaved(points, repeats, slow_s)
        for key, ts in times.items():
            recs[key].update(timing_stats(ts))
        for mode in MODES:
            chunk, scan = times.get(("delta_chunk", mode)), times.get(("delta_scan", mode))
            if chunk and scan:
                pairs = list(zip(scan, chunk, strict=False))
                pairs = pairs[1:] or pairs
                recs["delta_chunk", mode]["speedup_vs_delta_scan"] = statistics.median(
                    s / c for s, c in pairs
                )
        log(
            f"delta T={T}: "
            + ", ".join(
                f"{n}/{m} {r['median_s'] * 1e3:.1f} ms"
                for (n, m), r in recs.items()
                if "median_s" in r
            )
        )
    return records


def delta_headline(records, T):
    """Chunk vs scan at T: times, speedups, gradient temporaries, the issue's targets."""
    get = {(r["method"], r["mode"]): r for r in records if r["T"] == T}
    if not all("median_s" in get.get((n, m), {}) for n in DELTA_METHODS for m in MODES):
        return None
    out = dict(T=T, B=B, H=H, K=D, Dv=D, chunk_size=DEFAULT_CHUNK)
    for name in DELTA_METHODS:
        for mode in MODES:
            out[f"{name}_{mode}_ms"] = get[name, mode]["median_s"] * 1e3
            out[f"{name}_{mode}_temp_MB"] = get[name, mode]["temp_bytes"] / 2**20
    for mode in MODES:
        out[f"{mode}_speedup"] = get["delta_chunk", mode]["speedup_vs_delta_scan"]
    out["grad_memory_ratio"] = get["delta_scan", "grad"]["temp_bytes"] / max(
        get["delta_chunk", "grad"]["temp_bytes"], 1
    )
    out["meets_5x_grad_speed"] = out["grad_speedup"] >= 5.0
    out["meets_4x_grad_memory"] = out["grad_memory_ratio"] >= 4.0
    return out


def plot_delta(records, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, ylabel in (
        (axes[0], "median_s", "median time (s)"),
        (axes[1], "temp_bytes", "XLA temp memory (bytes)"),
    ):
        for name in DELTA_METHODS:
            for mode, style in (("fwd", "o--"), ("grad", "o-")):
                pts = [
                    (r["T"], r[key])
                    for r in records
                    if r["method"] == name and r["mode"] == mode and r.get(key)
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, label=f"{name} {mode}")
        ax.set(title=f"delta rule (Gated DeltaNet): {ylabel}", xlabel="T", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "delta_vs_T.png", dpi=110)
    plt.close(fig)


def headline(records, matmul, T):
    """Chunk at T: times, speedups, gradient memory, fraction of the matmul peak."""
    get = {(r["method"], r["mode"]): r for r in records if r["T"] == T}
    fwd, grad = get.get(("chunk", "fwd"), {}), get.get(("chunk", "grad"), {})
    if "median_s" not in fwd or "median_s" not in grad:
        return None
    out = dict(
        T=T,
        B=B,
        H=H,
        d=D,
        chunk_size=DEFAULT_CHUNK,
        fwd_ms=fwd["median_s"] * 1e3,
        grad_ms=grad["median_s"] * 1e3,
        grad_temp_MB=grad["temp_bytes"] / 2**20,
        fwd_temp_MB=fwd["temp_bytes"] / 2**20,
    )
    for base in BASELINES:
        for mode, rec in (("fwd", fwd), ("grad", grad)):
            out[f"{mode}_speedup_vs_{base}"] = rec.get(f"speedup_vs_{base}")
            if "median_s" in get.get((base, mode), {}):
                out[f"{base}_{mode}_ms"] = get[base, mode]["median_s"] * 1e3
                out[f"{base}_{mode}_temp_MB"] = get[base, mode]["temp_bytes"] / 2**20
    if matmul is not None:
        peak = 2.0 * matmul["n"] ** 3 / matmul["median_s"]
        achieved = chunk_flops(T) / fwd["median_s"]
        out.update(
            matmul_gflops=peak / 1e9,
            matmul_best_gflops=2.0 * matmul["n"] ** 3 / matmul["min_s"] / 1e9,
            chunk_fwd_gflops=achieved / 1e9,
            fraction_of_matmul_peak=achieved / peak,
        )
    naive = ("fwd_speedup_vs_naive_chunked_causal", "grad_speedup_vs_naive_chunked_causal")
    if all(out.get(k) is not None for k in naive):
        out["meets_3x_vs_naive"] = min(out[k] for k in naive) >= 3.0
    out["meets_64MB_grad_temp"] = out["grad_temp_MB"] <= 64.0
    return out


def plot(records, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, fname, ylabel in (
        ("median_s", "time_vs_T.png", "median time (s)"),
        ("temp_bytes", "memory_vs_T.png", "XLA temp memory (bytes)"),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, mode in zip(axes, MODES, strict=True):
            for name in dict.fromkeys(r["method"] for r in records):
                pts = [
                    (r["T"], r[key])
                    for r in records
                    if r["method"] == name and r["mode"] == mode and r.get(key)
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o-", label=name)
            ax.set(
                title={"fwd": "forward", "grad": "forward + backward"}[mode],
                xlabel="T",
                ylabel=ylabel,
            )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        if axes[0].get_legend_handles_labels()[0]:  # nothing to label if all were skipped
            axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


def tables(results) -> str:
    """Markdown tables: median ms per method and T, XLA temp MiB, speedups, chunk sweep."""
    records = results["records"]
    names = list(dict.fromkeys(r["method"] for r in records))
    Ts = list(dict.fromkeys(r["T"] for r in records))
    get = {(r["method"], r["mode"], r["T"]): r for r in records}
    lines = []

    def table(title, cell):
        lines.extend(
            [f"\n{title}\n", "| T | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        )
        for T in Ts:
            lines.append(f"| {T} | " + " | ".join(cell(get[n, mode, T]) for n in names) + " |")

    for mode in MODES if records else ():  # (no records: only the delta part was run)
        table(
            f"{mode}: median time (ms)",
            lambda r: f"{r['median_s'] * 1e3:.3g}" if "median_s" in r else "skip",
        )
        table(
            f"{mode}: XLA temp memory (MiB)",
            lambda r: "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.3g}",
        )
        for base in BASELINES:
            table(
                f"{mode}: speedup vs {base} (median over rounds)",
                lambda r, b=base: f"{r[f'speedup_vs_{b}']:.2f}" if f"speedup_vs_{b}" in r else "-",
            )
    sweep = results.get("chunk_sweep")
    if sweep:
        lines.extend(
            [
                f"\nchunk_size sweep at T={sweep['T']} (median ms; temp MiB)\n",
                "| chunk_size | fwd ms | grad ms | fwd MiB | grad MiB |",
                "|---:|---:|---:|---:|---:|",
            ]
        )
        rec = {(r["chunk_size"], r["mode"]): r for r in sweep["records"]}
        for C in dict.fromkeys(r["chunk_size"] for r in sweep["records"]):
            f, g = rec[C, "fwd"], rec[C, "grad"]
            lines.append(
                f"| {C} | {f['median_s'] * 1e3:.3g} | {g['median_s'] * 1e3:.3g} | "
                f"{f['temp_bytes'] / 2**20:.3g} | {g['temp_bytes'] / 2**20:.3g} |"
            )
        lines.append(f"\nfastest: {sweep['fastest']}")
    if results.get("headline"):
        lines.append("\nheadline: " + json.dumps(results["headline"], indent=1))
    delta = results.get("delta")
    if delta:
        lines.extend(
            [
                "\ndelta rule: median ms (temp MiB); speedup of chunk vs scan\n",
                "| T | chunk fwd | scan fwd | fwd speedup | chunk grad | scan grad | "
                "grad speedup |",
                "|---:|---:|---:|---:|---:|---:|---:|",
            ]
        )
        get = {(r["method"], r["mode"], r["T"]): r for r in delta["records"]}

        def cell(r):
            if "median_s" not in r:
                return "skip"
            return f"{r['median_s'] * 1e3:.3g} ({r['temp_bytes'] / 2**20:.3g})"

        for T in dict.fromkeys(r["T"] for r in delta["records"]):
            row = []
            for mode in MODES:
                c, s = get["delta_chunk", mode, T], get["delta_scan", mode, T]
                sp = c.get("speedup_vs_delta_scan")
                row += [cell(c), cell(s), "-" if sp is None else f"{sp:.2f}"]
            lines.append(f"| {T} | " + " | ".join(row) + " |")
        if delta.get("headline"):
            lines.append("\ndelta headline: " + json.dumps(delta["headline"], indent=1))
    return "\n".join(lines)


def run(
    out,
    preset="full",
    T=None,
    methods=None,
    repeats=None,
    *,
    mem_budget_gb=4.0,
    time_budget_s=150.0,
    slow_s=10.0,
    parts=PARTS,
    log=print,
):
    """Run the benchmark into `out`; returns the results dict (also written as results.json).

    `parts`: "linear" (every causal kernel and the baselines, T sweep, chunk sweep, headline)
    and/or "delta" (the delta rule, chunk vs scan)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = PRESETS[preset]
    T_list = tuple(sorted(set(cfg["T"] if T is None else T)))
    methods = tuple(METHODS if methods is None else methods)
    repeats = cfg["repeats"] if repeats is None else repeats
    if not T_list or any(t < DEFAULT_CHUNK or t % DEFAULT_CHUNK for t in T_list):
        raise ValueError(
            f"T must be multiples of {DEFAULT_CHUNK} (naive_chunked_causal's chunk), "
            f"got {list(T_list)}"
        )
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods must be a non-empty list from {list(METHODS)}, got {unknown}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    parts = tuple(parts)
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"parts must be a non-empty list from {list(PARTS)}, got {list(parts)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    headline_T = HEADLINE_T if HEADLINE_T in T_list else max(T_list)
    start = time.time()
    results = dict(
        machine=machine_info(),
        config=dict(
            preset=preset,
            T=T_list,
            methods=methods,
            repeats=repeats,
            B=B,
            H=H,
            d=D,
            dtype="float32",
            feature_map="elu_plus_one",
            mem_budget_gb=mem_budget_gb,
            time_budget_s=time_budget_s,
            slow_s=slow_s,
            headline_T=headline_T,
            parts=parts,
        ),
    )
    budgets = (mem_budget_gb * 2**30, time_budget_s, slow_s)
    records, matmul = [], None
    if "linear" in parts:
        records, matmul = run_T_sweep(
            T_list, methods, repeats, budgets, headline_T, cfg["matmul_n"], log
        )
    results.update(records=records, matmul=matmul)
    if "linear" in parts and "chunk" in methods:
        results["chunk_sweep"] = run_chunk_sweep(headline_T, cfg["chunk_sizes"], repeats, slow_s)
    results["headline"] = headline(records, matmul, headline_T)
    if "delta" in parts:
        delta_T = cfg["delta_T"] if T is None else T_list
        delta_records = run_delta_sweep(delta_T, repeats, budgets[0], slow_s, log)
        head_T = DELTA_HEADLINE_T if DELTA_HEADLINE_T in delta_T else max(delta_T)
        results["delta"] = dict(
            T=delta_T, records=delta_records, headline=delta_headline(delta_records, head_T)
        )
    results["machine"].update(load_avg_end=os.getloadavg(), wall_s=time.time() - start)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if "linear" in parts:
        plot(records, out)
    if "delta" in parts:
        plot_delta(results["delta"]["records"], out)
    log(tables(results))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/benchmark", help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--T", type=int, nargs="+", help="sequence lengths (default: the preset's)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), help="default: all")
    p.add_argument("--repeats", type=int, help="timed rounds (default: the preset's)")
    p.add_argument(
        "--mem_budget_gb",
        type=float,
        default=4.0,
        help="skip points whose XLA temporaries exceed this",
    )
    p.add_argument(
        "--time_budget_s",
        type=float,
        default=150.0,
        help="skip a method and pass at larger T once one run took longer than this",
    )
    p.add_argument(
        "--slow_s",
        type=float,
        default=10.0,
        help="time a point once (its warm-up run) when that run took longer than this",
    )
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="default: both")
    a = p.parse_args(argv)
    run(
        a.out,
        a.preset,
        a.T,
        a.methods,
        a.repeats,
        mem_budget_gb=a.mem_budget_gb,
        time_budget_s=a.time_budget_s,
        slow_s=a.slow_s,
        parts=a.parts,
    )


if __name__ == "__main__":
    main()

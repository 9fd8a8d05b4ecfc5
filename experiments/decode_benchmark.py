"""Decoding cost vs context length: per-token `step` latency, state bytes and prefill time for a
linear-attention model and a softmax model of the same size.

    python experiments/decode_benchmark.py --workdir runs/decode --preset cpu     # minutes, 2 cores
    python experiments/decode_benchmark.py --workdir runs/decode --preset full    # accelerator

Expected: the linear model's step latency and state bytes do not depend on the context (fitted
log-log slope of latency vs context ≈ 0), while the softmax model's KV cache grows linearly
and its step latency grows towards linearly once the cache dominates the step.

Models: `ModelConfig` with the same vocab, d_model, heads, layers, short conv and SwiGLU MLP for
every mixer of `--mixers` (default `gated` and `softmax`; parameter counts are reported).

Step latency. For each context length N a decoding state is made that holds N tokens, and the
step function from `models.step_fn` (compiled once per state shape) is timed one token at a time
(`block_until_ready` on the logits) with the new state fed back, after warm-up steps. Timing is
interleaved: every round runs a block at every (mixer, N) point, in a shuffled order, of 2
untimed tokens (the previous block evicted this point's state from the CPU caches) and `steps`
timed ones, so load on a shared machine hits all points alike; the figure is the median over
all rounds.

How the state "holds N tokens": each N gets its own KV cache, `init_state(B, max_length=N)`,
filled with random keys and values, with the position set to N − (steps to run), so that every
timed step attends to just under N real slots and never writes past the end: the work of
decoding at context N (the values in the slots do not change the cost). Linear states
(`LinearAttentionState`, fixed size) are filled with random non-negative numbers and the
position set the same way; for them N changes nothing but the position counter, which is the
point. The softmax step reads only the filled blocks of its cache
(`kernels.cached_softmax_attention`), so a cache longer than the context should cost nothing
extra: the points `softmax_maxcache` decode at the same positions in one cache of the largest N
to show it. `step_fn` donates the state, so a step updates the cache in place (no copy).

State bytes per sequence: counted from the arrays of the filled state (without the int32
position counters) and checked against `models.state_size_bytes` with `max_length` = N.

Prefill: `model.prefill(tokens[B, N], init_state(B, N))`, jitted (split/merge), a warm-up run
and `prefill_repeats` timed runs (median). A point is skipped (with the reason) when XLA's
temporary memory for it exceeds `--mem_budget_gb` or when the same mixer's previous length took
longer than `--time_budget_s` (softmax prefill is quadratic in time; its memory is blockwise).

Writes `results.json`, `decode_latency.png` (latency vs context, log x; state bytes; prefill
time) and prints a table with the softmax/linear latency ratio at the longest context and the
fitted slopes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.benchmarks import machine_info
from linear_attention.layers import MIXERS
from linear_attention.models import LanguageModel, ModelConfig, state_size_bytes, step_fn

PRESETS = {
    "tiny": dict(
        vocab_size=64,
        d_model=32,
        num_heads=2,
        num_layers=1,
        contexts=(64, 512, 4096),
        prefill_lengths=(64,),
        warmup=2,
        rounds=3,
        steps=4,
        prefill_repeats=1,
    ),
    "cpu": dict(
        vocab_size=256,
        d_model=256,
        num_heads=4,
        num_layers=2,
        contexts=tuple(1024 * 2**i for i in range(7)),  # 1k ... 64k
        prefill_lengths=tuple(1024 * 2**i for i in range(7)),
        warmup=5,
        rounds=5,
        steps=10,
        prefill_repeats=2,
    ),
    "full": dict(
        vocab_size=256,
        d_model=1024,
        num_heads=8,
        num_layers=4,
        contexts=tuple(1024 * 2**i for i in range(10)),  # 1k ... 512k
        prefill_lengths=tuple(1024 * 2**i for i in range(9)),
        warmup=10,
        rounds=10,
        steps=20,
        prefill_repeats=3,
    ),
}


def model_config(mixer: str, cfg: dict, max_length: int) -> ModelConfig:
    """The benchmark's model: same sizes for every mixer, short conv on q/k/v, SwiGLU MLP."""
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        d_model=cfg["d_model"],
        num_layers=cfg["num_layers"],
        num_heads=cfg["num_heads"],
        mixer=mixer,
        conv=4,
        mlp=True,
        max_length=max_length,
    )


def filled_state(model: LanguageModel, batch: int, context: int, position: int, key):
    """A decoding state for `context` tokens at `position`: softmax caches of length `context`,
    every core array (KV cache or linear state) random, conv tails zero."""
    state = model.init_state(batch, context if _has_softmax(model) else 1)
    return _fill(state, position, key)


def _fill(state, position: int, key):
    layers = []
    for i, layer in enumerate(state.layers):
        leaves, treedef = jax.tree.flatten(layer.core)
        keys = jax.random.split(jax.random.fold_in(key, i), len(leaves))
        # uniform in [0, 1): finite, and positive so a normalised state's denominator is too
        leaves = [
            jax.random.uniform(k, x.shape, jnp.float32).astype(x.dtype)
            for k, x in zip(keys, leaves, strict=True)
        ]
        pos = jnp.asarray(position, jnp.int32)  # one buffer each, so the state can be donated
        layers.append(layer._replace(core=jax.tree.unflatten(treedef, leaves), position=pos))
    return state._replace(layers=tuple(layers), position=jnp.asarray(position, jnp.int32))


def _has_softmax(model: LanguageModel) -> bool:
    return "softmax" in model.config.layer_mixers


def state_bytes(state) -> int:
    """Bytes of the arrays of a state, leaving out the int32 scalar position counters."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(state) if x.ndim > 0)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, params, tokens, state):
    logits, state = nnx.merge(graphdef, params).prefill(tokens, state)
    return logits[:, -1], state


REWARM = 2  # untimed steps at the start of each block: caches were just used by another point


def steps_needed(cfg: dict) -> int:
    """Tokens one point decodes: warm-up, every round's block, and the final finiteness check."""
    return cfg["warmup"] + cfg["rounds"] * (REWARM + cfg["steps"]) + 1


def time_steps(points: dict, warmup: int, rounds: int, steps: int) -> dict:
    """{key: (step, state, token)} -> {key: [seconds per step]}. Every round runs a block at
    each point, in a shuffled order, of `REWARM` untimed then `steps` timed tokens."""
    states = {key: p[1] for key, p in points.items()}

    def run(key, n, record):
        step, _, token = points[key]
        for _ in range(n):
            start = time.perf_counter()
            logits, states[key] = step(token, states[key])
            jax.block_until_ready(logits)
            if record is not None:
                record.append(time.perf_counter() - start)

    for key in points:
        run(key, warmup, None)
    times = {key: [] for key in points}
    order = list(points)
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for i in rng.permutation(len(order)):
            run(order[i], REWARM, None)
            run(order[i], steps, times[order[i]])
    for key in points:  # the last state must have stayed finite (no cache overflow)
        logits, _ = points[key][0](points[key][2], states[key])
        if not bool(jnp.all(jnp.isfinite(logits))):
            raise FloatingPointError(f"non-finite logits after decoding at {key}")
    return times


def fit_slope(xs, ys) -> float:
    """Least-squares slope of log y against log x."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


MAXCACHE = "softmax_maxcache"  # softmax decoding at N in one cache of the largest N


def run_decode(models, cfg, batch, log) -> list[dict]:
    warmup, rounds, steps = cfg["warmup"], cfg["rounds"], cfg["steps"]
    total = steps_needed(cfg)
    points, records = {}, {}
    token = jnp.zeros((batch,), jnp.int32)
    longest = max(cfg["contexts"])
    variants = [(m, m, False) for m in models]
    if "softmax" in models:
        variants.append((MAXCACHE, "softmax", True))
    for name, mixer, shared in variants:
        model = models[mixer]
        step = step_fn(model)
        for n in cfg["contexts"]:
            position, key = max(n - total, 0), jax.random.key(n)
            if shared:
                state = _fill(model.init_state(batch, longest), position, key)
            else:
                state = filled_state(model, batch, n, position, key)
            points[name, n] = (step, state, token)
            config_n = dataclasses.replace(model.config, max_length=longest if shared else n)
            records[name, n] = dict(
                mixer=name,
                context=n,
                cache_length=longest if shared else n,
                state_bytes=state_bytes(state) // batch,
                state_size_bytes=state_size_bytes(config_n),
            )
    times = time_steps(points, warmup, rounds, steps)
    for key, ts in times.items():
        records[key].update(
            median_s=statistics.median(ts),
            p10_s=float(np.percentile(ts, 10)),
            p90_s=float(np.percentile(ts, 90)),
            steps_timed=len(ts),
        )
    for n in cfg["contexts"]:
        log(
            f"context {n}: "
            + ", ".join(f"{m} {records[m, n]['median_s'] * 1e3:.3g} ms" for m, _, _ in variants)
        )
    return list(records.values())


def run_prefill(models, cfg, batch, budgets, log) -> list[dict]:
    mem_budget, time_budget = budgets
    records = []
    for mixer, model in models.items():
        graphdef, params = nnx.split(model)
        previous = None
        for n in cfg["prefill_lengths"]:
            rec = dict(mixer=mixer, length=n, temp_bytes=None)
            records.append(rec)
            if previous is not None and previous > time_budget:
                rec["skipped"] = f"took {previous:.1f} s > {time_budget} s at the previous length"
                continue
            tokens = jax.random.randint(jax.random.key(n), (batch, n), 0, model.config.vocab_size)
            state = model.init_state(batch, n)
            compiled = _prefill.lower(graphdef, params, tokens, state).compile()
            rec["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
            if rec["temp_bytes"] > mem_budget:
                rec["skipped"] = f"temp {rec['temp_bytes'] / 2**30:.1f} GiB > budget"
                previous = None
                continue
            ts = []
            for i in range(1 + cfg["prefill_repeats"]):
                start = time.perf_counter()
                jax.block_until_ready(compiled(params, tokens, state))
                if i:  # the first run is the warm-up
                    ts.append(time.perf_counter() - start)
            rec.update(median_s=statistics.median(ts), times_s=ts, tokens_per_s=n / min(ts))
            previous = rec["median_s"]
            log(f"prefill {mixer} {n}: {rec['median_s'] * 1e3:.4g} ms")
    return records


def headline(decode, prefill, linear_mixers) -> dict:
    """Slopes of log latency vs log context per mixer; softmax/linear ratio at the longest N."""
    out = {}
    by = {}
    for r in decode:
        by.setdefault(r["mixer"], []).append(r)
    for mixer, recs in by.items():
        recs = sorted(recs, key=lambda r: r["context"])
        xs = [r["context"] for r in recs]
        out[f"{mixer}_latency_slope"] = fit_slope(xs, [r["median_s"] for r in recs])
        if len(recs) > 1:  # between the two longest contexts: the asymptotic order
            last = [r["median_s"] for r in recs[-2:]]
            out[f"{mixer}_latency_slope_last"] = fit_slope(xs[-2:], last)
        out[f"{mixer}_state_bytes_slope"] = fit_slope(xs, [r["state_bytes"] for r in recs])
        out[f"{mixer}_longest_ms"] = recs[-1]["median_s"] * 1e3
    longest = max(r["context"] for r in decode)
    get = {(r["mixer"], r["context"]): r for r in decode}
    out["longest_context"] = longest
    if "softmax" in by:
        for m in linear_mixers:
            sm, lin = get["softmax", longest], get[m, longest]
            out[f"softmax_over_{m}_latency"] = sm["median_s"] / lin["median_s"]
            out[f"softmax_over_{m}_state_bytes"] = sm["state_bytes"] / lin["state_bytes"]
    if MAXCACHE in by:  # a short context in the longest cache vs in its own cache
        shortest = min(r["context"] for r in decode)
        own, big = get["softmax", shortest], get[MAXCACHE, shortest]
        out["maxcache_over_own_cache_latency_shortest"] = big["median_s"] / own["median_s"]
    done = [r for r in prefill if "median_s" in r]
    for m in dict.fromkeys(r["mixer"] for r in done):
        recs = sorted((r for r in done if r["mixer"] == m), key=lambda r: r["length"])
        if len(recs) > 1:
            out[f"{m}_prefill_slope"] = fit_slope(
                [r["length"] for r in recs], [r["median_s"] for r in recs]
            )
    return out


def plot(decode, prefill, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    mixers = list(dict.fromkeys(r["mixer"] for r in decode))
    for i, m in enumerate(mixers):
        recs = sorted((r for r in decode if r["mixer"] == m), key=lambda r: r["context"])
        x = [r["context"] for r in recs]
        med = np.asarray([r["median_s"] for r in recs]) * 1e3
        lo = np.asarray([r["p10_s"] for r in recs]) * 1e3
        hi = np.asarray([r["p90_s"] for r in recs]) * 1e3
        axes[0].plot(x, med, "o-", color=f"C{i}", label=m)
        axes[0].fill_between(x, lo, hi, color=f"C{i}", alpha=0.2)
        axes[1].plot(x, [r["state_bytes"] / 2**20 for r in recs], "o-", color=f"C{i}", label=m)
        pre = sorted(
            (r for r in prefill if r["mixer"] == m and "median_s" in r), key=lambda r: r["length"]
        )
        if pre:
            axes[2].plot(
                [r["length"] for r in pre],
                [r["median_s"] for r in pre],
                "o-",
                color=f"C{i}",
                label=m,
            )
    for ax, title, ylabel in (
        (axes[0], "per-token step latency (median, 10–90 %)", "ms / token"),
        (axes[1], "decoding state per sequence", "MiB"),
        (axes[2], "prefill time", "s"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(title=title, ylabel=ylabel, xlabel="context length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "decode_latency.png", dpi=110)
    plt.close(fig)


def table(results) -> str:
    decode, mixers = results["decode"], list(results["config"]["mixers"])
    if any(r["mixer"] == MAXCACHE for r in decode):
        mixers.append(MAXCACHE)
    get = {(r["mixer"], r["context"]): r for r in decode}
    contexts = sorted({r["context"] for r in decode})
    lines = [
        "| context | "
        + " | ".join(f"{m} ms/token" for m in mixers)
        + " | "
        + " | ".join(f"{m} state MiB" for m in mixers)
        + " |",
        "|---:|" + "---:|" * (2 * len(mixers)),
    ]
    for n in contexts:
        lines.append(
            f"| {n} | "
            + " | ".join(f"{get[m, n]['median_s'] * 1e3:.3g}" for m in mixers)
            + " | "
            + " | ".join(f"{get[m, n]['state_bytes'] / 2**20:.3g}" for m in mixers)
            + " |"
        )
    prefilled = [m for m in mixers if m != MAXCACHE]
    lines += ["", "| prefill length | " + " | ".join(f"{m} s" for m in prefilled) + " |"]
    lines.append("|---:|" + "---:|" * len(prefilled))
    pre = {(r["mixer"], r["length"]): r for r in results["prefill"]}
    for n in sorted({r["length"] for r in results["prefill"]}):
        cells = [
            f"{pre[m, n]['median_s']:.3g}" if "median_s" in pre[m, n] else "skip"
            for m in mixers
            if (m, n) in pre
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("\nheadline: " + json.dumps(results["headline"], indent=1))
    return "\n".join(lines)


def run(
    workdir,
    preset: str = "cpu",
    *,
    mixers=("gated", "softmax"),
    contexts=None,
    prefill_lengths=None,
    batch_size: int = 1,
    mem_budget_gb: float = 2.0,
    time_budget_s: float = 60.0,
    log=print,
):
    """Run the benchmark into `workdir`; returns the results dict (also `results.json`)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = dict(PRESETS[preset])
    if contexts is not None:
        cfg["contexts"] = contexts
    if prefill_lengths is not None:
        cfg["prefill_lengths"] = prefill_lengths
    mixers = tuple(dict.fromkeys(mixers))
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown or not mixers:
        raise ValueError(f"mixers must be a non-empty list from {list(MIXERS)}, got {unknown}")
    total = steps_needed(cfg)
    for name in ("contexts", "prefill_lengths"):
        values = tuple(sorted(set(cfg[name])))
        if not values or any(not isinstance(n, int) or n < 1 for n in values):
            raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {cfg[name]}")
        cfg[name] = values
    if cfg["contexts"][0] < total:
        raise ValueError(
            f"contexts must be >= {total} (the tokens the preset decodes: warm-up + "
            f"rounds·({REWARM} + steps) + 1), got {cfg['contexts'][0]}"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    start, machine = time.time(), machine_info()
    max_length = max(cfg["contexts"] + cfg["prefill_lengths"])
    models, params = {}, {}
    for m in mixers:
        models[m] = LanguageModel(model_config(m, cfg, max_length), rngs=nnx.Rngs(0))
        params[m] = sum(int(x.size) for x in jax.tree.leaves(nnx.state(models[m], nnx.Param)))
    decode = run_decode(models, cfg, batch_size, log)
    prefill = run_prefill(models, cfg, batch_size, (mem_budget_gb * 2**30, time_budget_s), log)
    linear = [m for m in mixers if m != "softmax"]
    results = dict(
        config=dict(
            preset=preset,
            mixers=mixers,
            batch_size=batch_size,
            param_counts=params,
            mem_budget_gb=mem_budget_gb,
            time_budget_s=time_budget_s,
            **{k: v for k, v in cfg.items()},
        ),
        machine=machine,
        decode=decode,
        prefill=prefill,
        headline=headline(decode, prefill, linear),
    )
    results["machine"].update(load_avg_end=os.getloadavg(), wall_s=time.time() - start)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(decode, prefill, out)
    log(table(results))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/decode", help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--mixers", nargs="+", default=["gated", "softmax"], choices=list(MIXERS))
    p.add_argument("--contexts", type=int, nargs="+", help="context lengths (default: preset's)")
    p.add_argument("--prefill_lengths", type=int, nargs="+", help="default: the preset's")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--mem_budget_gb", type=float, default=2.0, help="skip bigger prefills")
    p.add_argument("--time_budget_s", type=float, default=60.0, help="stop a mixer's prefill")
    a = p.parse_args(argv)
    run(
        a.workdir,
        a.preset,
        mixers=a.mixers,
        contexts=a.contexts,
        prefill_lengths=a.prefill_lengths,
        batch_size=a.batch_size,
        mem_budget_gb=a.mem_budget_gb,
        time_budget_s=a.time_budget_s,
    )


if __name__ == "__main__":
    main()

"""One command for a new backend (GPU, TPU, or the CPU): are the kernels right here, and how fast?

    python experiments/accelerator_check.py --out runs/accel           # < 5 min (--budget_s 270)
    python experiments/accelerator_check.py --out /tmp/a --preset tiny # smoke test, seconds

1. Checks, at `check_T` tokens (not a multiple of the chunk), with an initial state and
   normalisation: every method of `K.causal_linear_attention` against the quadratic form, for
   decays none / per head [H] / per token [B,T,H] / per key dimension [B,T,H,M] (a kind the
   library rejects is recorded as unsupported); the gradients of "chunk" and "chunk_parallel"
   against the quadratic form's; bfloat16 inputs against float32. Checks run at
   `jax.default_matmul_precision("highest")`: on GPUs XLA may otherwise run float32 matmuls in
   TF32, which is a precision choice, not a kernel error. Timings use the default precision.
2. Times, for T = 1K … 64K in bfloat16 and float32 (B=1, H=4, d=64, the shape of
   `benchmark.py`): `chunk` and `chunk_parallel` (elu+1 features computed outside, no decay,
   normalised) and softmax by `jax.nn.dot_product_attention(is_causal=True)`, forward and
   forward+backward (gradient of <f(q, k, v), g> w.r.t. q, k, v). Per T and dtype everything is
   compiled, run once to warm up, then timed in R interleaved rounds (`timing.interleaved`:
   a fresh random order each round, so that no point always follows one that freed large
   temporaries);
   `chunk_parallel_speedup` is the median over rounds of t_chunk / t_chunk_parallel (on a TPU
   also `method="pallas"`, checked and timed, and `pallas_speedup` = t_chunk / t_pallas). A point is
   skipped (with the reason) when its compiled temporaries exceed the memory budget, when the
   same method, dtype and pass took over `--time_budget_s` at a smaller T, or once the whole
   script has run `--budget_s` (sections 1 and 2; 3 and 4 run after it, unbounded).

3. Every other kernel family, forward and gradient (float32) and bfloat16 forward against the
   float32 reference, with an initial state where the family takes one: the delta rule with a
   per-token decay (Gated DeltaNet) and with a per-key decay (KDA), DPLR (RWKV-7's transition)
   and DeltaProduct (2 Householder steps) in "chunk" against "scan"; softmax blockwise against
   the quadratic form; the sliding window against the quadratic form with its band mask.
4. One training step (the loop's `train_step`: AdamW, float32 loss) of each paper preset of
   `configs/lm.py` at a reduced depth (`depth` layers; the `tiny` preset also narrows the model
   and shortens the rows), on one device: the step time (median of `repeats` after a warm-up),
   tokens/s, the model FLOPs per token of `training.flops` and, with `--peak_flops` (the
   device's peak FLOP/s for the compute dtype), the MFU = FLOPs per token · tokens/s / peak.

Writes `results.json` (machine, checks, every time, ratios, skips, train steps) and
`time_vs_T.png`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention import kernels as K
from linear_attention.benchmarks import machine_info
from linear_attention.benchmarks.timing import B, D, H, compile_point, interleaved, linear_fn
from linear_attention.training.cli import load_config_file
from linear_attention.training.config import experiment_config
from linear_attention.training.flops import flops_per_token
from linear_attention.training.mesh import make_mesh, shard_batch
from linear_attention.training.optim import make_optimizer
from linear_attention.training.sizing import abstract_batch
from linear_attention.training.trainer import build_model, train_step

MODES = ("fwd", "grad")
DECAYS = ("none", "per_head", "per_token", "per_key")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # relative to the largest reference entry
# step: the paper presets' training step at `depth` layers; "narrow" shrinks the model (d 64,
# 2 heads of 32) and the rows (`seq_len`, `batch`), for a CPU.
PRESETS = {
    "full": dict(
        T=tuple(1024 * 2**i for i in range(7)), repeats=5, check_T=300, decays=DECAYS,
        step=dict(depth=2, narrow=False, seq_len=None, batch=8, repeats=3),
    ),
    "tiny": dict(
        T=(128,), repeats=1, check_T=37, decays=("per_token", "per_key"),
        step=dict(depth=1, narrow=True, seq_len=32, batch=2, repeats=1),
    ),
}  # fmt: skip
FAMILIES = ("delta_rule", "kda", "dplr", "delta_product", "softmax", "sliding_window")
ROOT = Path(__file__).resolve().parents[1]


# name -> (function of (q, k, v), whether it takes featurised q and k)
TIMED = {
    "chunk": (linear_fn("chunk"), True),
    "chunk_parallel": (linear_fn("chunk_parallel"), True),
    "softmax": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), False),
}
# The Pallas kernels run on TPUs only (elsewhere they raise): checked and timed there, with
# `pallas_speedup` = t_chunk / t_pallas.
ON_TPU = jax.default_backend() == "tpu"
CHECKED_METHODS = K.METHODS + (K.PALLAS_METHODS if ON_TPU else ())
if ON_TPU:
    TIMED["pallas"] = (linear_fn("pallas"), True)


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


# ---- 1. correctness against the quadratic form ----


def run_checks(T: int, decay_kinds=DECAYS, chunk_size: int = 16) -> list[dict]:
    """Every method, decay kind and (for chunk, chunk_parallel) gradient vs "quadratic"."""
    M, Dv = 8, 8
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k = jnp.abs(arr(2, T, 2, M)) + 0.1, jnp.abs(arr(2, T, 2, M)) + 0.1
    v = arr(2, T, 2, Dv)
    state = K.LinearAttentionState(arr(2, 2, M, Dv), jnp.abs(arr(2, 2, M)) + 0.5)
    decays = {
        "none": None,
        "per_head": jnp.log(jnp.array([0.9, 0.6])),
        "per_token": jnp.asarray(-rng.uniform(0, 1.5, (2, T, 2)), jnp.float32),
        "per_key": jnp.asarray(-rng.uniform(0, 1.5, (2, T, 2, M)), jnp.float32),
    }

    def f(method, q, k, v, a):
        o, final = K.causal_linear_attention(
            q, k, v, log_decay=a, method=method, chunk_size=chunk_size, initial_state=state,
            return_state=True,
        )  # fmt: skip
        return o, final.kv

    def loss(method, q, k, v, a):
        o, kv = f(method, q, k, v, a)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(jnp.sin(kv))

    out = []
    with jax.default_matmul_precision("highest"):
        for kind in decay_kinds:
            a = decays[kind]
            try:
                ref = jax.jit(f, static_argnums=0)("quadratic", q, k, v, a)
            except ValueError as e:  # a decay kind this version does not accept
                out.append(dict(check="forward", decay=kind, unsupported=str(e)))
                continue
            grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
            ref_grads = grad("quadratic", q, k, v, a)
            for method in CHECKED_METHODS:
                if method == "quadratic":
                    continue
                for dtype in DTYPES if method in TIMED else ("float32",):
                    x = [t.astype(DTYPES[dtype]) for t in (q, k, v)]
                    o, kv = jax.jit(f, static_argnums=0)(method, *x, a)
                    err = max(rel_err(o, ref[0]), rel_err(kv, ref[1]))
                    out.append(
                        dict(check="forward", decay=kind, method=method, dtype=dtype, rel_err=err)
                    )
                if method in TIMED:
                    grads = grad(method, q, k, v, a)
                    err = max(rel_err(g, r) for g, r in zip(grads, ref_grads, strict=True))
                    out.append(
                        dict(check="gradient", decay=kind, method=method, dtype="float32",
                             rel_err=err)
                    )  # fmt: skip
    for c in out:
        if "rel_err" in c:
            c["ok"] = bool(np.isfinite(c["rel_err"]) and c["rel_err"] < TOLERANCE[c["dtype"]])
    return out


def _family_case(family: str, T: int, rng):
    """``(function of (variant, *arrays) -> outputs, arrays, reference variant, checked
    variants, how many leading arrays are cast to bfloat16)`` of a kernel family."""
    B, H, Kd, Dv, n = 2, 2, 8, 8, 2
    arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    beta = jnp.asarray(rng.uniform(0.1, 1.5, (B, T, H)), jnp.float32)
    per_token = jnp.asarray(-rng.uniform(0, 0.5, (B, T, H)), jnp.float32)
    per_key = jnp.asarray(-rng.uniform(0, 0.5, (B, T, H, Kd)), jnp.float32)
    state = K.LinearAttentionState(0.3 * arr(B, H, Kd, Dv), None)
    q, k, v = arr(B, T, H, Kd), unit(arr(B, T, H, Kd)), arr(B, T, H, Dv)

    def delta(method, q, k, v, beta, a):
        o, s = K.delta_rule(
            q, k, v, beta, log_decay=a, method=method, chunk_size=16, initial_state=state,
            return_state=True,
        )  # fmt: skip
        return o, s.kv

    def dplr(method, q, k, v, kk, beta, w):
        kk = unit(kk)
        o, s = K.dplr_delta_rule(
            q, k, v, -kk, beta[..., None] * kk, log_decay=w, method=method, chunk_size=16,
            initial_state=state, return_state=True,
        )  # fmt: skip
        return o, s.kv

    def product(method, q, k, v, beta, a):
        o, s = K.delta_product(
            q, k, v, beta, log_decay=a, method=method, chunk_size=16, initial_state=state,
            return_state=True,
        )  # fmt: skip
        return o, s.kv

    def softmax(method, q, k, v):
        if method == "quadratic":
            return K.softmax_attention(q, k, v, causal=True)
        return K.blockwise_softmax_attention(q, k, v, causal=True, block_size=16)

    window = 7

    def sliding(method, q, k, v):
        if method == "quadratic":  # causal softmax over the band j in (i - window, i]
            s = jnp.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
            i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
            s = jnp.where((j <= i) & (j > i - window), s, -jnp.inf)
            return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, axis=-1), v)
        return K.sliding_window_attention(q, k, v, window=window, block_size=16)

    match family:
        case "delta_rule":
            return delta, (q, k, v, beta, per_token), "scan", ("chunk",), 3
        case "kda":
            return delta, (q, k, v, beta, per_key), "scan", ("chunk",), 3
        case "dplr":
            return dplr, (q, 0.5 * k, v, arr(B, T, H, Kd), beta, per_key), "scan", ("chunk",), 4
        case "delta_product":
            ks = unit(arr(B, T, H, n, Kd))
            betas = jnp.asarray(rng.uniform(0.1, 1.5, (B, T, H, n)), jnp.float32)
            args = (q, ks, arr(B, T, H, n, Dv), betas, per_token)
            return product, args, "scan", ("chunk",), 3
        case "softmax":
            return softmax, (q, k, v), "quadratic", ("blockwise",), 3
        case "sliding_window":
            return sliding, (q, k, v), "quadratic", ("blockwise",), 3
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def run_family_checks(T: int, families=FAMILIES) -> list[dict]:
    """For each family: every checked variant against the reference, forward and gradient in
    float32, and its forward on bfloat16 inputs against the float32 reference."""
    rng = np.random.default_rng(1)
    out = []
    with jax.default_matmul_precision("highest"):
        for family in families:
            f, args, ref_variant, variants, n_cast = _family_case(family, T, rng)
            fwd = jax.jit(f, static_argnums=0)

            def loss(variant, *args, f=f):
                leaves = jax.tree.leaves(f(variant, *args))
                return sum(
                    jnp.sum(x.astype(jnp.float32) * jnp.cos(jnp.arange(x.size).reshape(x.shape)))
                    for x in leaves
                )

            grad = jax.jit(jax.grad(loss, argnums=tuple(range(1, len(args) + 1))), static_argnums=0)
            ref, ref_grads = fwd(ref_variant, *args), grad(ref_variant, *args)
            low = [x.astype(jnp.bfloat16) if i < n_cast else x for i, x in enumerate(args)]
            for variant in variants:
                errs = {
                    ("forward", "float32"): fwd(variant, *args),
                    ("gradient", "float32"): grad(variant, *args),
                    ("forward", "bfloat16"): fwd(variant, *low),
                }
                for (check, dtype), got in errs.items():
                    want = ref_grads if check == "gradient" else ref
                    err = max(
                        rel_err(g, r)
                        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
                    )
                    out.append(
                        dict(check=check, family=family, method=variant, reference=ref_variant,
                             dtype=dtype, rel_err=err,
                             ok=bool(np.isfinite(err) and err < TOLERANCE[dtype]))
                    )  # fmt: skip
    return out


# ---- 2. timings ----


def memory_budget() -> float:
    """80 % of the device's memory where JAX reports it, else 8 GiB (the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return 0.8 * stats["bytes_limit"] if "bytes_limit" in stats else 8.0 * 2**30


def make_inputs(T: int, dtype):
    q, k, v, g = (
        jax.random.normal(key, (B, T, H, D), jnp.float32)
        for key in jax.random.split(jax.random.key(0), 4)
    )
    phi = K.feature_maps.elu_plus_one
    cast = lambda *xs: tuple(x.astype(dtype) for x in xs)  # noqa: E731
    return {"raw": cast(q, k, v, g), "feat": cast(phi(q), phi(k), v, g)}


def run_timings(T_list, dtypes, repeats, budget_s, time_budget_s, mem_budget, log):
    start, records, blocked = time.time(), [], {}
    for T in T_list:
        for dname in dtypes:
            inputs = make_inputs(T, DTYPES[dname])
            points, recs = {}, {}
            for name, (fn, featurised) in TIMED.items():
                for mode in MODES:
                    key = name, dname, mode
                    rec = recs[key] = dict(method=name, dtype=dname, mode=mode, T=T)
                    records.append(rec)
                    if time.time() - start > budget_s:
                        blocked.setdefault(key, f"script time budget {budget_s:g} s spent")
                    if key not in blocked:
                        try:
                            compiled, args = compile_point(
                                fn, mode, inputs["feat" if featurised else "raw"]
                            )
                        except Exception as e:  # e.g. out of memory while compiling
                            blocked[key] = f"failed to compile at T={T}: {type(e).__name__}"
                        else:
                            rec["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
                            if rec["temp_bytes"] > mem_budget:
                                blocked[key] = f"temp {rec['temp_bytes'] / 2**30:.3g} GiB at T={T}"
                    if key in blocked:
                        rec["skipped"] = blocked[key]
                        continue
                    points[key] = (compiled, args)
            times = interleaved(points, repeats, slow_s=time_budget_s)
            for key, ts in times.items():
                timed = ts[1:] or ts
                recs[key].update(times_s=ts, median_s=statistics.median(timed), min_s=min(timed))
                if recs[key]["median_s"] > time_budget_s:
                    blocked[key] = f"took {recs[key]['median_s']:.3g} s at T={T}"
            for mode in MODES:
                for other in ("chunk_parallel", "pallas"):
                    a, b = times.get(("chunk", dname, mode)), times.get((other, dname, mode))
                    if a and b:
                        pairs = list(zip(a, b, strict=False))
                        pairs = pairs[1:] or pairs
                        recs[other, dname, mode][f"{other}_speedup"] = statistics.median(
                            x / y for x, y in pairs
                        )
            log(
                f"T={T} {dname}: "
                + ", ".join(
                    f"{n}/{m} {r['median_s'] * 1e3:.2f} ms"
                    for (n, _, m), r in recs.items()
                    if "median_s" in r
                )
            )
    return records


# ---- 4. a training step of each paper preset ----


def paper_presets() -> tuple[str, ...]:
    """The paper-size presets of `configs/lm.py` (its ``PAPER_SIZES``)."""
    spec = importlib.util.spec_from_file_location("configs_lm", ROOT / "configs" / "lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.PAPER_SIZES)


def step_config(preset: str, depth: int, narrow: bool, seq_len: int | None, batch: int):
    """The preset's config at ``depth`` layers, ``batch`` rows of ``seq_len`` tokens (None:
    the preset's) in one step; ``narrow``: d 64 and 2 heads of 32 (the vocabulary kept)."""
    config = load_config_file(f"{ROOT / 'configs' / 'lm.py'}:{preset}")
    config.model.num_layers = depth
    if narrow:
        config.model.d_model, config.model.num_heads = 64, 2
        if config.model.head_dim is not None:
            config.model.head_dim = 32
    if seq_len:
        config.data.seq_len = seq_len
    config.train.batch_size, config.train.grad_accum_steps = batch, 1
    return experiment_config(config)


def run_train_step(cfg, repeats: int, peak_flops: float | None) -> dict:
    """One device: the loop's `train_step` compiled, run once to warm up, then ``repeats``
    timed steps on random tokens (one document per row)."""
    mesh = make_mesh(1, 1)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    model, optimizer = build_model(cfg, tx)
    flops = flops_per_token(model, cfg.data.seq_len)["total"]
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    graphdef, state = nnx.split((model, optimizer))
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.data.seq_len)
    batch = {
        name: np.ones(shape, np.int32)
        if name == "segment_ids"
        else rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32)
        for name in abstract_batch(cfg, mesh)
    }
    batch = shard_batch(batch, mesh)
    kwargs = dict(graphdef=graphdef, mesh=mesh, fsdp=False, accum=1, loss_chunks=cfg.loss_chunks)
    start = time.perf_counter()
    compiled = train_step.lower(state, batch, **kwargs).compile()
    compile_s = time.perf_counter() - start
    state, metrics = compiled(state, batch)
    first_loss = float(metrics["train/loss"])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_sec = shape[0] * shape[1] / step_s
    return dict(
        parameters=int(params), d_model=cfg.model.d_model, num_layers=cfg.model.num_layers,
        seq_len=shape[1], batch=shape[0], dtype=cfg.model.dtype, compile_s=compile_s,
        first_loss=first_loss, times_s=times, step_s=step_s, tokens_per_sec=tokens_per_sec,
        flops_per_token=flops,
        mfu=None if not peak_flops else flops * tokens_per_sec / peak_flops,
    )  # fmt: skip


def run_train_steps(presets, depth, narrow, seq_len, batch, repeats, peak_flops, log):
    records = []
    for preset in presets:
        cfg = step_config(preset, depth, narrow, seq_len, batch)
        try:
            rec = dict(preset=preset, **run_train_step(cfg, repeats, peak_flops))
        except Exception as e:  # e.g. out of memory on a small device: said, not fatal
            rec = dict(preset=preset, skipped=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        records.append(rec)
        if "skipped" in rec:
            log(f"train step {preset}: skipped ({rec['skipped']})")
            continue
        mfu = "" if rec["mfu"] is None else f", MFU {rec['mfu']:.3f}"
        log(
            f"train step {preset} ({rec['num_layers']} layers, d {rec['d_model']}, "
            f"{rec['batch']} x {rec['seq_len']}): {rec['step_s'] * 1e3:.1f} ms, "
            f"{rec['tokens_per_sec']:.0f} tokens/s{mfu}"
        )
    return records


def plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, mode in zip(axes, MODES, strict=True):
        for i, name in enumerate(TIMED):
            for dname, style in (("float32", "o-"), ("bfloat16", "s--")):
                pts = [
                    (r["T"], r["median_s"])
                    for r in records
                    if (r["method"], r["dtype"], r["mode"]) == (name, dname, mode)
                    and "median_s" in r
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=f"C{i}", label=f"{name} {dname}")
        ax.set(title={"fwd": "forward", "grad": "forward + backward"}[mode], xlabel="T")
        ax.set(ylabel="median time (s)", xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), B={B} H={H} d={D}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    out,
    preset="full",
    T=None,
    dtypes=tuple(DTYPES),
    repeats=None,
    *,
    budget_s=270.0,
    time_budget_s=20.0,
    mem_budget_gb=None,
    peak_flops=None,
    log=print,
):
    """Checks and timings into `out`; returns the results dict (also written as results.json)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if peak_flops is not None and not peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0 (the device's FLOP/s), got {peak_flops}")
    cfg = PRESETS[preset]
    T_list = tuple(sorted(set(cfg["T"] if T is None else T)))
    repeats = cfg["repeats"] if repeats is None else repeats
    if not T_list or min(T_list) < 1 or repeats < 1:
        raise ValueError(f"T must be positive and repeats >= 1, got T={T_list}, {repeats=}")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"dtypes must be a non-empty list from {list(DTYPES)}, got {dtypes}")
    mem_budget = memory_budget() if mem_budget_gb is None else mem_budget_gb * 2**30
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = dict(
        machine=dict(machine_info(), backend=jax.default_backend()),
        config=dict(
            preset=preset, T=T_list, dtypes=tuple(dtypes), repeats=repeats, B=B, H=H, d=D,
            chunk_size=64, check_T=cfg["check_T"], check_decays=cfg["decays"], budget_s=budget_s,
            time_budget_s=time_budget_s, mem_budget_bytes=mem_budget,
        ),
    )  # fmt: skip
    results["checks"] = run_checks(cfg["check_T"], cfg["decays"])
    failed = [c for c in results["checks"] if c.get("ok") is False]
    results["checks_passed"] = not failed
    log(f"checks: {len(results['checks']) - len(failed)} ok, failed: {failed or 'none'}")
    remaining = budget_s - (time.time() - start)
    results["records"] = run_timings(
        T_list, dtypes, repeats, remaining, time_budget_s, mem_budget, log
    )
    # (after the timings: `budget_s` bounds the linear checks and the timings, as before)
    results["family_checks"] = run_family_checks(cfg["check_T"])
    failed = [c for c in results["family_checks"] if not c["ok"]]
    results["checks_passed"] = results["checks_passed"] and not failed
    passed = len(results["family_checks"]) - len(failed)
    log(f"family checks: {passed} ok, failed: {failed or 'none'}")
    step = cfg["step"]
    results["config"]["train_step"] = dict(step, peak_flops=peak_flops)
    results["train_steps"] = run_train_steps(
        paper_presets(), step["depth"], step["narrow"], step["seq_len"], step["batch"],
        step["repeats"], peak_flops, log,
    )  # fmt: skip
    results["machine"].update(load_avg_end=os.getloadavg(), wall_s=time.time() - start)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results["records"], out / "time_vs_T.png")
    log(table(results["records"]))
    return results


def table(records) -> str:
    """Markdown: median ms per T, method, dtype and pass, and the chunk_parallel speedup."""
    cols = [(n, d, m) for d in DTYPES for m in MODES for n in TIMED]
    get = {(r["method"], r["dtype"], r["mode"], r["T"]): r for r in records}
    lines = [
        "| T | " + " | ".join(f"{n} {d} {m}" for n, d, m in cols) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for T in sorted({r["T"] for r in records}):
        cells = []
        for n, d, m in cols:
            r = get.get((n, d, m, T), {})
            cell = f"{r['median_s'] * 1e3:.3g}" if "median_s" in r else "—"
            for other in ("chunk_parallel", "pallas"):
                if f"{other}_speedup" in r:
                    cell += f" ({r[f'{other}_speedup']:.2f}×)"
            cells.append(cell)
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/accelerator_check", help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--T", type=int, nargs="+", help="sequence lengths (default: the preset's)")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--repeats", type=int, help="timed rounds (default: the preset's)")
    p.add_argument("--budget_s", type=float, default=270.0, help="stop timing after this")
    p.add_argument(
        "--time_budget_s", type=float, default=20.0, help="skip larger T once a run took this"
    )
    p.add_argument("--mem_budget_gb", type=float, help="default: 80%% of the device's memory")
    p.add_argument(
        "--peak_flops", type=float, help="the device's peak FLOP/s (bfloat16), for the MFU"
    )
    a = p.parse_args(argv)
    run(
        a.out, a.preset, a.T, tuple(a.dtypes), a.repeats, budget_s=a.budget_s,
        time_budget_s=a.time_budget_s, mem_budget_gb=a.mem_budget_gb, peak_flops=a.peak_flops,
    )  # fmt: skip


if __name__ == "__main__":
    main()

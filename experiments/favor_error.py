"""How well FAVOR+ random features approximate softmax attention, vs the number of features m.

    python experiments/favor_error.py --workdir runs/favor_error --preset cpu    # ~1 min, 2 cores
    python experiments/favor_error.py --workdir runs/favor_error --preset full   # accelerator

Expected: every error falls like m^(-1/2) (log-log slope ≈ −0.5); orthogonal projections are
below iid ones (most at m ≤ d, where the rows of a block are exactly orthogonal); errors grow
quickly with the query/key norm, since the estimator's variance grows like exp(|q'+k'|²).

Setup, per scaled norm r and seed s: queries and keys `[T, d]` with random directions and norm
r·d^{1/4}, so that x' = x·d^{-1/4} has norm r and the logits q·k/√d = q'·k' lie in [−r², r²]
(their spread, std ≈ r²/√d, is printed: small r is diffuse attention, large r sharp); values
`[T, d]` standard normal. The projection W `[m, d]` is `random_projection(key, m, d,
orthogonal=...)`; data and W are drawn from `fold_in(key(seed), r-index)`.

Three relative Frobenius errors against float64 NumPy references (non-causal, all T×T pairs):

- `kernel`:  ‖φ(Q)φ(K)ᵀ − exp(QKᵀ/√d)‖ / ‖exp(QKᵀ/√d)‖ with `favor_plus(stabilize=False)`, the
  unbiased estimator itself;
- `weights`: ‖Â − A‖ / ‖A‖, A = softmax(QKᵀ/√d) row-wise, Â = the row-normalised estimate;
- `output`:  ‖Ô − O‖ / ‖O‖, O = A V exact, Ô = `kernels.linear_attention(φ(Q), φ(K), V)` with the
  stabilized features the `favor` mixer uses (`is_query=True` for queries).

Writes `results.json` (config, machine, one record per point, a summary per (r, orthogonal, m,
metric) with mean, std, 10th/90th percentiles over seeds, and the fitted log-log slopes),
`results.csv` and `favor_error.png` (rows: metric, columns: norm; mean line and 10–90 % band);
prints a table.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention import kernels as K
from linear_attention.benchmarks import machine_info

FM = K.feature_maps
METRICS = ("kernel", "weights", "output")
PRESETS = {
    "tiny": dict(T=16, d=8, m=(4, 16, 64), norms=(1.0, 2.0), seeds=3),
    "cpu": dict(T=256, d=64, m=(16, 32, 64, 128, 256, 512), norms=(1.0, 1.5, 2.0, 3.0), seeds=8),
    "full": dict(
        T=1024,
        d=64,
        m=(16, 32, 64, 128, 256, 512, 1024, 2048),
        norms=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
        seeds=32,
    ),
}


def make_data(key, T: int, d: int, norm: float):
    """q, k `[T, d]` with random directions and norm `norm·d^{1/4}`; v `[T, d]` ~ N(0, 1)."""
    kq, kk, kv = jax.random.split(key, 3)

    def directions(k):
        x = jax.random.normal(k, (T, d), jnp.float32)
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    scale = norm * d**0.25
    return directions(kq) * scale, directions(kk) * scale, jax.random.normal(kv, (T, d))


def exact(q, k, v):
    """float64 NumPy references: kernel exp(QKᵀ/√d), softmax weights A and outputs A V."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = q @ k.T / np.sqrt(q.shape[-1])
    kernel = np.exp(logits)
    # the softmax subtracts the row max (it cancels); the kernel itself is needed unshifted
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights = p / p.sum(axis=-1, keepdims=True)
    return kernel, weights, weights @ v


@jax.jit
def favor_estimates(q, k, v, projection):
    """The library's estimates for one projection: (kernel φ(Q)φ(K)ᵀ unstabilized, row-normalised
    weights, attention output) — the last from stabilized features through the kernel."""
    kernel = (
        FM.favor_plus(q, projection, stabilize=False)
        @ FM.favor_plus(k, projection, stabilize=False).T
    )
    phi_q = FM.favor_plus(q, projection, stabilize=True, is_query=True)
    phi_k = FM.favor_plus(k, projection, stabilize=True, is_query=False)
    scores = phi_q @ phi_k.T  # each row rescaled by a constant, which row-normalising removes
    weights = scores / jnp.sum(scores, axis=-1, keepdims=True)
    out = K.linear_attention(phi_q[None, :, None], phi_k[None, :, None], v[None, :, None])
    return kernel, weights, out[0, :, 0]


def rel_err(approx, ref) -> float:
    approx = np.asarray(approx, np.float64)
    return float(np.linalg.norm(approx - ref) / np.linalg.norm(ref))


def point_errors(q, k, v, projection, refs) -> dict[str, float]:
    """{metric: relative error} of one projection against the `exact` references."""
    return {
        name: rel_err(est, ref)
        for name, est, ref in zip(METRICS, favor_estimates(q, k, v, projection), refs, strict=True)
    }


def projection_key(seed: int, norm_index: int, m: int, orthogonal: bool):
    """The key of W for one point (independent of the data's key)."""
    key = jax.random.fold_in(jax.random.key(seed), norm_index)
    return jax.random.fold_in(jax.random.fold_in(key, 1 + m), int(orthogonal))


def data_key(seed: int, norm_index: int):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), norm_index), 0)


def summarize(records) -> list[dict]:
    """Mean, std, 10th and 90th percentiles over seeds per (norm, orthogonal, m, metric)."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        for metric in METRICS:
            groups.setdefault((r["norm"], r["orthogonal"], r["m"], metric), []).append(r[metric])
    out = []
    for (norm, orth, m, metric), errs in groups.items():
        e = np.asarray(errs)
        out.append(
            dict(
                norm=norm,
                orthogonal=orth,
                m=m,
                metric=metric,
                mean=float(e.mean()),
                std=float(e.std()),
                p10=float(np.percentile(e, 10)),
                p90=float(np.percentile(e, 90)),
                seeds=len(errs),
            )
        )
    return out


def fit_slopes(summary) -> list[dict]:
    """Least-squares slope of log(mean error) against log(m) per (norm, orthogonal, metric)."""
    groups: dict[tuple, list[tuple[int, float]]] = {}
    for s in summary:
        groups.setdefault((s["norm"], s["orthogonal"], s["metric"]), []).append((s["m"], s["mean"]))
    out = []
    for (norm, orth, metric), pts in groups.items():
        m, err = np.asarray(sorted(pts)).T
        slope = float(np.polyfit(np.log(m), np.log(err), 1)[0]) if len(m) > 1 else float("nan")
        out.append(dict(norm=norm, orthogonal=orth, metric=metric, slope=slope))
    return out


def plot(summary, norms, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(METRICS), len(norms), figsize=(3.6 * len(norms), 3.0 * len(METRICS)), squeeze=False
    )
    titles = {
        "kernel": "kernel exp(q·k/√d)",
        "weights": "softmax weights",
        "output": "attention output",
    }
    for i, metric in enumerate(METRICS):
        for j, norm in enumerate(norms):
            ax = axes[i, j]
            for orth, color in ((True, "C0"), (False, "C3")):
                pts = sorted(
                    (s["m"], s["mean"], s["p10"], s["p90"])
                    for s in summary
                    if s["metric"] == metric and s["norm"] == norm and s["orthogonal"] == orth
                )
                m, mean, lo, hi = (np.asarray(c) for c in zip(*pts, strict=True))
                label = "orthogonal" if orth else "iid"
                ax.loglog(m, mean, "o-", color=color, label=label, base=2)
                ax.fill_between(m, lo, hi, color=color, alpha=0.2)
            ref = mean[0] * (m / m[0]) ** -0.5  # m^(-1/2) through the first iid point
            ax.loglog(m, ref, "k:", lw=1, label="∝ m^(-1/2)", base=2)
            ax.set_title(f"{titles[metric]}, |x'| = {norm:g}", fontsize=9)
            ax.set_xlabel("random features m")
            if j == 0:
                ax.set_ylabel("relative error")
            ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "favor_error.png", dpi=110)
    plt.close(fig)


def table(summary, slopes, norms, ms) -> str:
    get = {(s["norm"], s["orthogonal"], s["m"], s["metric"]): s for s in summary}
    lines = [
        "| |x'| | m | kernel orth | kernel iid | weights orth | weights iid | output orth "
        "| output iid |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for norm in norms:
        for m in ms:
            cells = [
                f"{get[norm, orth, m, metric]['mean']:.3g}"
                for metric in METRICS
                for orth in (True, False)
            ]
            lines.append(f"| {norm:g} | {m} | " + " | ".join(cells) + " |")
    lines += ["", "log-log slope of the mean error vs m:", "| |x'| | metric | orth | iid |"]
    lines.append("|---:|---|---:|---:|")
    sl = {(s["norm"], s["orthogonal"], s["metric"]): s["slope"] for s in slopes}
    for norm in norms:
        for metric in METRICS:
            lines.append(
                f"| {norm:g} | {metric} | {sl[norm, True, metric]:.2f} | "
                f"{sl[norm, False, metric]:.2f} |"
            )
    return "\n".join(lines)


def run(workdir, preset: str = "cpu", *, T=None, d=None, m=None, norms=None, seeds=None, log=print):
    """Run the experiment into `workdir`; returns the results dict (also `results.json`)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = dict(PRESETS[preset])
    for name, value in (("T", T), ("d", d), ("m", m), ("norms", norms), ("seeds", seeds)):
        if value is not None:
            cfg[name] = value
    for name in ("T", "d", "seeds"):
        if not isinstance(cfg[name], int) or cfg[name] < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {cfg[name]!r}")
    ms = tuple(sorted(set(cfg["m"])))
    if not ms or any(not isinstance(x, int) or x < 1 for x in ms):
        raise ValueError(f"m must be a non-empty list of integers >= 1, got {cfg['m']!r}")
    norms_ = tuple(float(x) for x in cfg["norms"])
    if not norms_ or any(not x > 0 for x in norms_):
        raise ValueError(f"norms must be a non-empty list of numbers > 0, got {cfg['norms']!r}")
    T, d, n_seeds = cfg["T"], cfg["d"], cfg["seeds"]
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    records = []
    for ni, norm in enumerate(norms_):
        spreads = []
        for seed in range(n_seeds):
            q, k, v = make_data(data_key(seed, ni), T, d, norm)
            refs = exact(q, k, v)
            spreads.append(float(np.std(np.log(refs[0]))))
            for mm in ms:
                for orth in (True, False):
                    w = FM.random_projection(
                        projection_key(seed, ni, mm, orth), mm, d, orthogonal=orth
                    )
                    errs = point_errors(q, k, v, w, refs)
                    records.append(dict(norm=norm, seed=seed, m=mm, orthogonal=orth, **errs))
        log(f"|x'| = {norm:g}: logit std {np.mean(spreads):.3g} ({time.time() - start:.0f} s)")

    summary = summarize(records)
    slopes = fit_slopes(summary)
    bad = [r for r in records if not all(np.isfinite(r[m]) for m in METRICS)]
    results = dict(
        config=dict(preset=preset, T=T, d=d, m=ms, norms=norms_, seeds=n_seeds),
        machine=dict(machine_info(), wall_s=time.time() - start),
        records=records,
        summary=summary,
        slopes=slopes,
        non_finite=len(bad),
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    plot(summary, norms_, out)
    log(table(summary, slopes, norms_, ms))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/favor_error", help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--T", type=int, help="tokens (queries = keys)")
    p.add_argument("--d", type=int, help="head dimension")
    p.add_argument("--m", type=int, nargs="+", help="numbers of random features")
    p.add_argument("--norms", type=float, nargs="+", help="scaled norms |x'| = |x|/d^(1/4)")
    p.add_argument("--seeds", type=int, help="seeds per point")
    a = p.parse_args(argv)
    run(a.workdir, a.preset, T=a.T, d=a.d, m=a.m, norms=a.norms, seeds=a.seeds)


if __name__ == "__main__":
    main()

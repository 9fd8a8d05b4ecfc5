"""Is `gated`'s seed-to-seed spread on MQAR its decay initialisation? Swap it between seeds.

    python experiments/decay_init_swap.py --out runs/decay_swap        # 4 runs, ~5 min on 2 cores

The MQAR study (docs/studies/mqar.md) trains `gated` (a Mamba-2-like scalar decay per
head, log γ = −softplus(x·w + b)·exp(A)) with 2 seeds: at d_model 64 and 128 and every
learning rate, seed 0 solves and seed 1 stays on the plateau. A seed sets every initial weight
and the batch order. This script trains the study's point (``configs/sweeps/mqar.py:cpu``,
``--d_model``, ``--lr``) for each ``SEED:DECAY_SEED`` pair: all weights and the data of
SEED, but the decay parameters (A and the softplus bias b of every layer, ``a_log`` and
``dt_bias``) as DECAY_SEED initialises them. Pairs with SEED = DECAY_SEED are the study's own
runs. With 2 heads per layer, A ~ U[1, 16] and softplus(b) ~ logU[1e-3, 1e-1] can give a layer
only short-memory heads (A·softplus(b) ≈ 0.5–1: the state forgets within a few tokens), which
the printed per-layer A·softplus(b) shows. Writes ``results.json``; prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.layers.linear import GatedMixer
from linear_attention.models import LanguageModel
from linear_attention.training import experiment_config, train
from linear_attention.training.sweep import load_sweep, prepare

ROOT = Path(__file__).resolve().parents[1]
SWEEP = str(ROOT / "configs/sweeps/mqar.py")


def point_config(preset: str, d_model: int, lr: float, seed: int):
    """The study's `gated` run at (d_model, lr, seed) as an `ExperimentConfig`."""
    _, points = prepare(
        load_sweep(f"{SWEEP}:{preset}"),
        ["mixer=gated", f"d_model={d_model}", f"lr={lr:g}", f"seed={seed}"],
    )
    if len(points) != 1:
        raise ValueError(f"no single gated point at d_model={d_model}, lr={lr}, seed={seed}")
    return experiment_config(points[0].config)


def decay_params(model) -> list[tuple[np.ndarray, np.ndarray]]:
    """(a_log, dt_bias) of every layer's `gated` mixer, in layer order."""
    return [
        (np.asarray(b.mixer.decay.a_log[...]), np.asarray(b.mixer.decay.dt_bias[...]))
        for b in model.blocks
    ]


def memory_rates(params) -> list[list[float]]:
    """A·softplus(b) per layer and head: −log γ per token at x·w = 0."""
    rates = (np.exp(np.float64(a)) * np.asarray(jax.nn.softplus(b), np.float64) for a, b in params)
    return [[round(float(r), 4) for r in layer] for layer in rates]


@contextlib.contextmanager
def decays_from(params):
    """While active, every `GatedMixer` built takes its (a_log, dt_bias) from ``params``, layer
    by layer in construction order (cycling: a model built twice gets them twice)."""
    original = GatedMixer._build
    built = [0]

    def build(self, rngs):
        original(self, rngs)  # draws as usual, so every other weight is the seed's own
        a_log, dt_bias = params[built[0] % len(params)]
        built[0] += 1
        decay = self.decay
        decay.a_log = nnx.Param(jnp.asarray(a_log, decay.a_log[...].dtype))
        decay.dt_bias = nnx.Param(jnp.asarray(dt_bias, decay.dt_bias[...].dtype))

    GatedMixer._build = build
    try:
        yield
    finally:
        GatedMixer._build = original


def initial_decays(cfg):
    return decay_params(LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed)))


def run(out, pairs, *, d_model=64, lr=1e-2, preset="cpu", log=print) -> list[dict]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for seed, decay_seed in pairs:
        cfg = point_config(preset, d_model, lr, seed)
        donor = initial_decays(point_config(preset, d_model, lr, decay_seed))
        with decays_from(donor):
            summary = train(cfg, str(out / f"seed{seed}_decays{decay_seed}"))
        rec = dict(
            seed=seed,
            decay_seed=decay_seed,
            d_model=d_model,
            lr=lr,
            init_rate_per_layer=memory_rates(donor),
            eval_accuracy=summary["eval/accuracy"],
            step=summary["step"],
        )
        records.append(rec)
        log(f"seed {seed}, decays of seed {decay_seed}: eval accuracy {rec['eval_accuracy']:.3f}")
    (out / "results.json").write_text(json.dumps(records, indent=1))
    log("| weights and data | decays | A·softplus(b) at init, per layer | eval accuracy |")
    log("|---|---|---|---:|")
    for r in records:
        log(
            f"| seed {r['seed']} | seed {r['decay_seed']} | {r['init_rate_per_layer']} "
            f"| {r['eval_accuracy']:.3f} |"
        )
    return records


def _pair(text: str) -> tuple[int, int]:
    seed, sep, decay_seed = text.partition(":")
    if not sep or not seed.isdigit() or not decay_seed.isdigit():
        raise argparse.ArgumentTypeError(f"expected SEED:DECAY_SEED (e.g. 1:0), got {text!r}")
    return int(seed), int(decay_seed)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/decay_swap")
    p.add_argument("--pairs", nargs="+", type=_pair, default=[(0, 0), (1, 1), (1, 0), (0, 1)])
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--preset", default="cpu", help="preset of configs/sweeps/mqar.py")
    a = p.parse_args(argv)
    try:
        point_config(a.preset, a.d_model, a.lr, a.pairs[0][0])
    except ValueError as e:
        p.error(str(e))
    run(a.out, a.pairs, d_model=a.d_model, lr=a.lr, preset=a.preset)


if __name__ == "__main__":
    main()

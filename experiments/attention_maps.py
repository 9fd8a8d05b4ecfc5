"""Effective attention maps of trained MQAR models: sharp vs diffuse, full rank vs rank-M, measured.

    python experiments/attention_maps.py --workdir runs/attention_maps --preset cpu   # minutes
    python experiments/attention_maps.py --workdir runs/attention_maps --preset full  # accelerator

For every mixer of the preset, the MQAR run in `<workdir>/runs/<mixer>` is trained first when
`--train` is given or it has no checkpoint yet (`linear_attention.training.train` with
`configs/mqar.py` and the preset's overrides; rerunning resumes), then loaded from its latest
checkpoint (`training.load_run`). On `num_examples` test sequences, each layer's mixer input is
computed with the model's public modules, from it the mixer's own featurised q, k, v and log
decays (`layers.attention_inputs`: projection, short conv, rotary, feature map, as the layer
computes them), and the effective T×T matrix A with o = A v:

    softmax             A_ts = softmax_s(q_t·k_s / √Dk) over s ≤ t
    linear, favor,      A_ts = φ(q_t)·φ(k_s) / (Σ_{s'≤t} φ(q_t)·φ(k_s') + eps)      (s ≤ t)
    taylor, hedgehog
    retnet, gated       A_ts = φ(q_t)·φ(k_s) · Π_{r=s+1..t} γ_r   (no denominator; φ = identity,
                        k scaled by Dk^-½; γ fixed per head (retnet) or per token (gated))

(computed in float64; decay products as exp(L_t − L_s) of cumulative log decays, masked first).
The check `recon_rel_err` pushes A v through the mixer's output norm, gate and projection and
compares with the mixer's own output: it stays ~1e-6 unless this script and the layer disagree.

The maps shown and measured are P = |A| row-normalised. For softmax and the normalised mixers
this is A itself (rows sum to 1 up to eps); for retnet and gated, which have no denominator, the
weights are signed and unnormalised, so P shows their absolute values row-normalised.

Per head and example, averaged: row entropy of P at the query positions (nats, and divided by
log(t+1), 1 = uniform); `rank` of P (singular values above `rtol`·σ_max; a causal map with a
positive diagonal is triangular, hence full rank) and its effective rank exp(H(σ/Σσ));
`kernel_rank`, the same count for the unmasked score matrix (exp(QKᵀ/√d) for softmax,
φ(Q)φ(K)ᵀ for linear mixers: at most M, the feature width). At each query position t (key k_i
asked again; the generator puts pair i at positions 2i, 2i+1): the weight on the key, on the
value, on both (`pair_weight`), and on the pair's window [2i, 2i+1+(K−1)] (`window_weight`),
K being the short conv's kernel size: with the conv, the keys and values of the K−1 positions
after the value also carry the pair (trained softmax models typically retrieve from 2i+2,
whose convolved key holds k_i and value holds v_i); chance levels are the weights a uniform
row gives; `*_argmax`: how often the row's largest weight lands there.

The layer shown is each model's retrieval layer (the one whose best head puts the most weight
on the window) unless `--layer` is given; the JSON holds every layer and head.

Writes `results.json`, `results.md`, `attention_maps.png` (heatmaps: one column per mixer, one
row per head, example 0, the queried pairs' windows boxed) and `attention_summary.png` (best
head of each model: window weight, entropy, ranks, and the run's eval accuracy); prints the
table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.data import IGNORE_INDEX
from linear_attention.layers import LinearMixer, SoftmaxMixer, attention_inputs
from linear_attention.training import build_data, experiment_config, load_run, train
from linear_attention.training.cli import load_config_file

ROOT = Path(__file__).resolve().parents[1]
ALL_MIXERS = ("softmax", "linear", "favor", "taylor", "hedgehog", "retnet", "gated")

PRESETS = {
    # a few seconds of training per mixer: for tests; learns nothing
    "tiny": dict(
        base="smoke",
        mixers=("softmax", "gated"),
        overrides={"train.num_steps": 2, "train.checkpoint_every": 2},
        num_examples=2,
    ),
    # minutes on 2 cores: a short MQAR (T=32, 4 pairs) every mixer can be trained on quickly
    "cpu": dict(
        base="cpu",
        mixers=ALL_MIXERS,
        overrides={
            "data.vocab_size": 64,
            "data.seq_len": 32,
            "data.num_kv_pairs": 4,
            "data.num_train_examples": 10_000,
            "data.num_test_examples": 256,
            "model.num_heads": 4,
            "optimizer.learning_rate": 1e-2,
            "optimizer.warmup_steps": 30,
            "train.num_steps": 300,
            "train.eval_every": 300,
            "train.log_every": 50,
            "train.checkpoint_every": 300,
        },
        num_examples=16,
    ),
    # the Zoology setting of configs/mqar.py (T=256, 16 pairs, 20k steps): for an accelerator
    "full": dict(base="default", mixers=ALL_MIXERS, overrides={}, num_examples=64),
}


# ----------------------------------------------------------------------------- runs
def run_config(preset: dict, mixer: str, steps: int | None):
    """The ConfigDict of one mixer's MQAR run."""
    config = load_config_file(f"{ROOT / 'configs' / 'mqar.py'}:{preset['base']}")
    for path, value in preset["overrides"].items():
        section, field = path.split(".")
        config[section][field] = value
    config.model.mixer = mixer
    if steps is not None:
        config.train.num_steps = steps
        config.train.eval_every = config.train.checkpoint_every = steps
        config.train.log_every = min(config.train.log_every, steps)
        config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, steps)
    return config


def has_checkpoint(run_dir: Path) -> bool:
    ckpt = run_dir / "checkpoints"
    return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())


def eval_accuracy(run_dir: Path) -> float | None:
    summary = run_dir / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text()).get("eval/accuracy")
    return None


# ----------------------------------------------------------------------------- the maps
def layer_input(model, tokens_BT, layer: int):
    """The (normalised) input of layer `layer`'s mixer (`LanguageModel.hidden_states`), and
    the mixer."""
    return model.hidden_states(tokens_BT).mixer_inputs[layer], model.blocks[layer].mixer


def effective_maps(mixer, x_BTD):
    """For one mixer input: `A [B, H, T, T]` (o = A v), the unmasked score matrix for the kernel
    rank, v, the kind of weights, and M (feature width; None for softmax). float64, from the
    mixer's own `attention_inputs` (featurised q, k, v and log decay)."""
    if not isinstance(mixer, SoftmaxMixer | LinearMixer):
        raise ValueError(
            f"no effective-matrix rule for mixer class {type(mixer).__name__}; known: "
            "SoftmaxMixer and the LinearMixer family"
        )
    inputs = attention_inputs(mixer, x_BTD)
    f64 = lambda a: np.asarray(a, np.float64).transpose(0, 2, 1, 3)  # noqa: E731 -> [B, H, T, .]
    q, k, v = f64(inputs.q), f64(inputs.k), f64(inputs.v)
    t = q.shape[2]
    causal = np.tril(np.ones((t, t), bool))
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mixer, SoftmaxMixer):  # q is already scaled: the logits are q·k
        logits = np.where(causal, scores, -np.inf)  # mask before exp
        p = np.exp(logits - logits.max(-1, keepdims=True))
        scores = np.exp(scores - scores.max(-1, keepdims=True))  # unmasked, for the rank
        return p / p.sum(-1, keepdims=True), scores, v, "softmax", None
    a = np.where(causal, scores, 0.0)
    if inputs.log_decay is not None:
        cum = np.cumsum(np.asarray(inputs.log_decay, np.float64), axis=1)  # L_t = Σ_{r≤t} log γ_r
        if cum.ndim == 3:  # one decay per head: A_ts *= exp(L_t − L_s)
            cum = cum.transpose(0, 2, 1)
            a = a * np.exp(np.where(causal, cum[..., :, None] - cum[..., None, :], -np.inf))
        else:  # per key dimension (GLA): A_ts = Σ_m q_tm k_sm exp(L_tm − L_sm)
            gap = np.where(causal[:, :, None, None], cum[:, :, None] - cum[:, None, :], -np.inf)
            a = np.einsum("bhtm,bhsm,btshm->bhts", q, k, np.exp(gap))
    if mixer.NORMALIZE:
        a = a / (a.sum(-1, keepdims=True) + mixer.eps)
        kind = "normalized"
    else:
        kind = "abs_row_normalized"
    return a, scores, v, kind, q.shape[-1]


def reconstruct(mixer, x_BTD, a_BHTT, v_BHTD) -> float:
    """Relative error between the mixer's output and A v pushed through its output layers."""
    o = np.einsum("bhts,bhsd->bthd", a_BHTT, v_BHTD).astype(np.float32)
    o = jnp.asarray(o)
    ours = np.asarray(mixer.output(x_BTD, o), np.float64)
    ref = np.asarray(mixer(x_BTD), np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def row_normalized(a):
    w = np.abs(a)
    return w / np.maximum(w.sum(-1, keepdims=True), 1e-300)


def numerical_rank(m, rtol: float) -> tuple[int, float]:
    """(#σ > rtol·σ_max, effective rank exp(H(σ/Σσ)))."""
    s = np.linalg.svd(m, compute_uv=False)
    if s[0] == 0:
        return 0, 0.0
    p = s / s.sum()
    p = p[p > 0]
    return int(np.sum(s > rtol * s[0])), float(np.exp(-np.sum(p * np.log(p))))


def recall_positions(inputs_T, labels_T, num_kv_pairs: int):
    """[(query t, key position, value position)] from the MQAR layout: pair i at 2i, 2i+1."""
    out = []
    keys = inputs_T[: 2 * num_kv_pairs : 2]
    for t in np.flatnonzero(labels_T != IGNORE_INDEX):
        (i,) = np.flatnonzero(keys == inputs_T[t])
        if inputs_T[2 * i + 1] != labels_T[t]:
            raise ValueError(f"query at {t}: value at {2 * i + 1} is not the label")
        out.append((int(t), 2 * int(i), 2 * int(i) + 1))
    return out


def head_metrics(p_TT, scores_TT, positions, rtol: float, window: int = 0) -> dict:
    """Metrics of one row-normalised map P (one example, one head); `window` is the number of
    positions after each value that also carry the pair (the short conv's kernel size − 1)."""
    rows = np.asarray([t for t, _, _ in positions])
    logp = np.log(np.where(p_TT > 0, p_TT, 1.0))
    entropy_T = -np.sum(p_TT * logp, axis=-1)
    t_idx = np.arange(p_TT.shape[0])
    norm_T = entropy_T / np.log(np.maximum(t_idx + 1, 2))
    q = {k: [] for k in ("key", "value", "window", "pair_top", "window_top", "window_chance")}
    for t, kp, vp in positions:
        stop = min(vp + window, t) + 1  # the window is [kp, stop)
        top = int(np.argmax(p_TT[t]))
        q["key"].append(p_TT[t, kp])
        q["value"].append(p_TT[t, vp])
        q["window"].append(p_TT[t, kp:stop].sum())
        q["pair_top"].append(top in (kp, vp))
        q["window_top"].append(kp <= top < stop)
        q["window_chance"].append((stop - kp) / (t + 1))
    mean = {k: float(np.mean(v)) for k, v in q.items()}
    rank, eff_rank = numerical_rank(p_TT, rtol)
    kernel_rank, _ = numerical_rank(scores_TT, rtol)
    return dict(
        entropy=float(entropy_T[rows].mean()),
        entropy_normalized=float(norm_T[rows].mean()),
        entropy_all_rows=float(entropy_T.mean()),
        rank=rank,
        effective_rank=eff_rank,
        kernel_rank=kernel_rank,
        key_weight=mean["key"],
        value_weight=mean["value"],
        pair_weight=mean["key"] + mean["value"],
        pair_argmax=mean["pair_top"],
        chance_pair_weight=float(np.mean(2.0 / (rows + 1))),
        window_weight=mean["window"],
        window_argmax=mean["window_top"],
        chance_window_weight=mean["window_chance"],
    )


def analyse(cfg, model, inputs, labels, rtol: float):
    """Metrics of every layer and head of one model on the examples, and example 0's maps."""
    tokens = jnp.asarray(inputs)
    positions = [
        recall_positions(i, l, cfg.data.num_kv_pairs) for i, l in zip(inputs, labels, strict=True)
    ]
    layers, maps = [], []
    for layer in range(cfg.model.num_layers):
        x, mixer = layer_input(model, tokens, layer)
        a, scores, v, kind, m = effective_maps(mixer, x)
        recon = reconstruct(mixer, x, a, v)
        p = row_normalized(a)
        conv = mixer.inputs.conv
        window = 0 if conv is None else conv.kernel_size - 1
        heads = []
        for h in range(a.shape[1]):
            per_ex = [
                head_metrics(p[e, h], scores[e, h], positions[e], rtol, window)
                for e in range(len(inputs))
            ]
            heads.append({key: float(np.mean([d[key] for d in per_ex])) for key in per_ex[0]})
        layers.append(
            dict(
                layer=layer,
                mixer_class=type(mixer).__name__,
                weights=kind,
                feature_dim=m,
                window=window,
                recon_rel_err=recon,
                row_sum_max_dev=float(np.abs(p.sum(-1) - 1).max()),
                heads=heads,
                mean={key: float(np.mean([hd[key] for hd in heads])) for key in heads[0]},
                best_head=int(np.argmax([hd["window_weight"] for hd in heads])),
            )
        )
        maps.append(p[0])
    return layers, maps, positions[0]


def retrieval_layer(layers) -> int:
    """The layer whose best head puts the most weight on the correct pair's window."""
    return int(np.argmax([lay["heads"][lay["best_head"]]["window_weight"] for lay in layers]))


# ----------------------------------------------------------------------------- output
def plot_maps(results, maps, positions, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm
    from matplotlib.patches import Rectangle

    mixers = list(results)
    heads = max(maps[m].shape[0] for m in mixers)
    fig, axes = plt.subplots(
        heads, len(mixers), figsize=(2.6 * len(mixers), 2.75 * heads), squeeze=False
    )
    for j, m in enumerate(mixers):
        res = results[m]
        lay = res["layers"][res["shown_layer"]]
        for h in range(heads):
            ax = axes[h, j]
            ax.set_xticks([])
            ax.set_yticks([])
            if h >= maps[m].shape[0]:
                ax.axis("off")
                continue
            ax.imshow(maps[m][h], cmap="viridis", norm=PowerNorm(0.5, vmin=0, vmax=1))
            for t, kp, vp in positions:  # the pair's window (red box), key and value (circles)
                stop = min(vp + lay["window"], t) + 1
                ax.add_patch(
                    Rectangle((kp - 0.5, t - 0.5), stop - kp, 1, fill=False, ec="red", lw=0.8)
                )
            hd = lay["heads"][h]
            first = f"{m} L{res['shown_layer']} h{h}"
            if h == 0 and res["eval_accuracy"] is not None:
                first += f" acc {res['eval_accuracy']:.2f}"
            ax.set_title(
                f"{first}\nwin {hd['window_weight']:.2f} H {hd['entropy_normalized']:.2f} "
                f"krank {hd['kernel_rank']:.0f}",
                fontsize=7,
            )
    fig.suptitle(
        "example 0: P = |A| row-normalised (γ=0.5 colour), red: the queried pair's window",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out / "attention_maps.png", dpi=110)
    plt.close(fig)


def plot_summary(results, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixers = list(results)
    best = []
    for m in mixers:
        lay = results[m]["layers"][results[m]["shown_layer"]]
        best.append(
            dict(lay["heads"][lay["best_head"]], layer_kernel_rank=lay["mean"]["kernel_rank"])
        )
    panels = (
        ("window_weight", "weight on the pair's window"),
        ("entropy_normalized", "row entropy / log(t+1)"),
        ("effective_rank", "effective rank of P"),
        ("kernel_rank", "rank of unmasked scores"),
    )
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(3.2 * (len(panels) + 1), 3.4))
    x = np.arange(len(mixers))
    for ax, (key, title) in zip(axes, panels, strict=False):
        ax.bar(x, [d[key] for d in best], color="C0")
        if key == "window_weight":
            ax.plot(x, [d["chance_window_weight"] for d in best], "k_", ms=14, label="uniform")
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(x, mixers, rotation=45, fontsize=8)
    axes[-1].bar(x, [results[m]["eval_accuracy"] or 0.0 for m in mixers], color="C2")
    axes[-1].set_title("MQAR eval accuracy", fontsize=9)
    axes[-1].set_xticks(x, mixers, rotation=45, fontsize=8)
    fig.suptitle("best head of each model's retrieval layer, mean over examples", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "attention_summary.png", dpi=110)
    plt.close(fig)


def table(results) -> str:
    lines = [
        "| mixer | acc | layer | weights | M | window weight | uniform | argmax in window | "
        "pair weight | entropy / log(t+1) | eff. rank | kernel rank (layer mean) | recon err |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, res in results.items():
        lay = res["layers"][res["shown_layer"]]
        b = lay["heads"][lay["best_head"]]
        acc = "-" if res["eval_accuracy"] is None else f"{res['eval_accuracy']:.3f}"
        lines.append(
            f"| {m} | {acc} | {lay['layer']} h{lay['best_head']} | {lay['weights']} | "
            f"{lay['feature_dim'] or '-'} | {b['window_weight']:.3f} | "
            f"{b['chance_window_weight']:.3f} | {b['window_argmax']:.2f} | "
            f"{b['pair_weight']:.3f} | {b['entropy_normalized']:.3f} | "
            f"{b['effective_rank']:.1f} | {b['kernel_rank']:.1f} ({lay['mean']['kernel_rank']:.1f})"
            f" | {lay['recon_rel_err']:.1e} |"
        )
    return "\n".join(lines)


def run(
    workdir,
    preset: str = "cpu",
    *,
    mixers=None,
    steps: int | None = None,
    layer: int | None = None,
    num_examples: int | None = None,
    rtol: float = 1e-3,
    force_train: bool = False,
    log=print,
):
    """Train (if needed) and analyse every mixer into `workdir`; returns the results dict."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg_preset = PRESETS[preset]
    mixers = tuple(dict.fromkeys(mixers or cfg_preset["mixers"]))
    unknown = [m for m in mixers if m not in ALL_MIXERS]
    if unknown or not mixers:
        raise ValueError(f"mixers must be a non-empty list from {list(ALL_MIXERS)}, got {unknown}")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    num_examples = num_examples or cfg_preset["num_examples"]
    if not isinstance(num_examples, int) or num_examples < 1:
        raise ValueError(f"num_examples must be an integer >= 1, got {num_examples!r}")
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must be in (0, 1), got {rtol!r}")
    configs = {m: run_config(cfg_preset, m, steps) for m in mixers}
    num_layers = next(iter(configs.values())).model.num_layers
    if layer is not None:
        if not -num_layers <= layer < num_layers:
            raise ValueError(f"layer must be in [{-num_layers}, {num_layers - 1}], got {layer}")
        layer %= num_layers
    for config in configs.values():  # every config is valid before anything trains
        experiment_config(config)
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    results, maps, positions = {}, {}, None
    for m in mixers:
        run_dir = out / "runs" / m
        if force_train or not has_checkpoint(run_dir):
            log(f"training {m} in {run_dir}")
            train(configs[m], str(run_dir))
        step = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
        model, cfg = load_run(str(run_dir), step=step)
        data = build_data(cfg)
        n = min(num_examples, data.test_inputs.shape[0])
        inputs, labels = data.test_inputs[:n], data.test_labels[:n]
        layers, layer_maps, positions = analyse(cfg, model, inputs, labels, rtol)
        shown = retrieval_layer(layers) if layer is None else layer
        results[m] = dict(
            run_dir=str(run_dir),
            checkpoint_step=step,
            eval_accuracy=eval_accuracy(run_dir),
            shown_layer=shown,
            layers=layers,
        )
        maps[m] = layer_maps[shown]
        lay = layers[shown]
        log(
            f"{m}: acc {results[m]['eval_accuracy']}, layer {shown} head {lay['best_head']}: "
            f"window weight {lay['heads'][lay['best_head']]['window_weight']:.3f}, "
            f"recon err {lay['recon_rel_err']:.1e} ({time.time() - start:.0f} s)"
        )
    data_cfg = experiment_config(next(iter(configs.values()))).data
    summary = dict(
        config=dict(
            preset=preset,
            mixers=mixers,
            layer="auto" if layer is None else layer,
            num_examples=num_examples,
            rtol=rtol,
            seq_len=data_cfg.seq_len,
            num_kv_pairs=data_cfg.num_kv_pairs,
            vocab_size=data_cfg.vocab_size,
        ),
        machine=dict(platform=jax.devices()[0].platform, cpu_count=os.cpu_count()),
        wall_s=time.time() - start,
        mixers=results,
    )
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    text = table(results)
    (out / "results.md").write_text(text + "\n")
    plot_maps(results, maps, positions, out)
    plot_summary(results, out)
    log(text)
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/attention_maps", help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--mixers", nargs="+", choices=ALL_MIXERS, help="default: the preset's")
    p.add_argument("--train", action="store_true", help="train (resume) even if a run exists")
    p.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    p.add_argument(
        "--layer", type=int, help="layer to show (default: each model's retrieval layer)"
    )
    p.add_argument("--num_examples", type=int, help="test sequences to average over")
    p.add_argument("--rtol", type=float, default=1e-3, help="singular values > rtol·σ_max count")
    a = p.parse_args(argv)
    run(
        a.workdir,
        a.preset,
        mixers=a.mixers,
        steps=a.steps,
        layer=a.layer,
        num_examples=a.num_examples,
        rtol=a.rtol,
        force_train=a.train,
    )


if __name__ == "__main__":
    main()

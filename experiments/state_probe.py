"""Where a trained state-tracking model loses its answer past the training lengths: in its
recurrent states, in the layer's output, or in the layers that read it.

    python experiments/state_probe.py --workdir runs/s5_swaps_kda_neg \
        --out docs/results/s5_swaps_state_probe.json

Why: a model trained on lengths 3–40 that is right at 40 and wrong now and then at 256 has
either let its state drift (a decay short of 1 compounding, channels filling up, a scale the
later layers never saw) or still holds the answer in the state and reads it less sharply. The
two predict different things for a linear probe fitted on training-length sequences only: if
the state at position 200 holds the running product in the code it used at position 20, the
probe reads it there as well as it does at 20; if the state drifted, the probe fails with the
model.

Three kinds of features per position, one probe each (`ridge_fit`: least squares onto the
one-hot labels, float64, fitted on ``fit_batches`` fresh training batches, i.e. steps after
the run's last, lengths ``min_len``–``max_len``, scored positions only):

- ``state_{l}``: layer l's recurrent state after the position's token (every head's
  ``[M, Dv]`` matrix, flattened), from `LanguageModel.step` run over the sequence, so the
  decoding path, which equals the full pass;
- ``residual_{l}``: the residual stream after block l (what block l + 1, or the head, reads);
- the model itself (its argmax), for comparison.

Per evaluation length: each probe's and the model's accuracy, sequence accuracy (every scored
position right) and accuracy by position bucket (`BUCKETS`), and per layer the state's
Frobenius norm per head by bucket (has the state's scale moved past the training lengths?).
A state probe that stays right where the model fails says the state holds the answer and the
reading blurs; a residual probe after the last block that fails with the model says the
blur is already in the features, not in the head. Layers whose state is not a
`LinearAttentionState` (softmax's KV cache) have no state probe.

And one intervention (`capped_accuracy`, ``--cap_scales``): decode again with every head's
state held to a multiple of the largest norm it reached on the fitting batches. At 1 the cap
never acts on training-length data, so past those lengths it removes the states' growth and
nothing else: if the growth is what the model fails on, accuracy there comes back.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.data.batches import IGNORE_INDEX
from linear_attention.kernels.state import LinearAttentionState
from linear_attention.training import build_data
from linear_attention.training.load import restore_run, run_header

BUCKETS = (0, 4, 16, 40, 64, 128, 256)  # position buckets [a, b): 40 is the longest trained


def decode(graphdef, params, tokens_BT, caps):
    """`LanguageModel.step` scanned over ``tokens[B, T]`` (the decoding path, equal to the full
    pass). After each token, layer l's recurrent state is scaled, head by head, down to a
    Frobenius norm of at most ``caps[l][h]`` (``caps[l]`` a ``[H]`` array, or None: left as it
    is; a tracked normaliser ``k_sum`` is scaled with it). Returns the step logits
    ``[B, T, V]``, each layer's state after each position as the next token reads it
    ``[B, T, H, M·Dv]`` and its norm per head before the cap ``[B, T, H]`` (both None for a
    layer without a `LinearAttentionState`)."""
    b, t = tokens_BT.shape

    def body(state, tokens_B):
        logits_BV, state = nnx.merge(graphdef, params).step(tokens_B, state)
        layers, kv, norms = [], [], []
        for layer, cap_H in zip(state.layers, caps, strict=True):
            if not isinstance(layer.core, LinearAttentionState):
                layers.append(layer)
                kv.append(None)
                norms.append(None)
                continue
            kv_BHMD = layer.core.kv
            norm_BH = jnp.sqrt(jnp.sum(jnp.square(kv_BHMD), axis=(2, 3)))
            if cap_H is not None:
                scale_BH = jnp.where(norm_BH > cap_H, cap_H / norm_BH, 1.0)
                kv_BHMD = kv_BHMD * scale_BH[:, :, None, None]
                # a normaliser, where tracked, scales with its state: the output is unchanged
                k_sum = layer.core.k_sum
                k_sum = None if k_sum is None else k_sum * scale_BH[:, :, None]
                layer = layer._replace(core=LinearAttentionState(kv_BHMD, k_sum))
            layers.append(layer)
            kv.append(kv_BHMD.reshape(b, kv_BHMD.shape[1], -1))
            norms.append(norm_BH)
        return state._replace(layers=tuple(layers)), (logits_BV, kv, norms)

    init = nnx.merge(graphdef, params).init_state(b, t)
    _, (logits_TBV, kv_TBF, norms_TBH) = jax.lax.scan(body, init, tokens_BT.T)

    def batch_major(xs):
        return [None if x is None else jnp.swapaxes(x, 0, 1) for x in xs]

    return jnp.swapaxes(logits_TBV, 0, 1), batch_major(kv_TBF), batch_major(norms_TBH)


def make_decoder(model):
    """A jitted ``(tokens[B, T], caps) -> (logits, norms)``: `decode` on ``model``, without
    returning the states (``[B, T, H, M·Dv]`` per layer, the bulk of the output)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def logits_and_norms(params, tokens_BT, caps):
        logits, _, norms = decode(graphdef, params, tokens_BT, caps)
        return logits, norms

    return lambda tokens, caps: logits_and_norms(params, jnp.asarray(tokens), caps)


def make_features(model):
    """A jitted ``tokens[B, T] -> (logits [B, T, V], residuals, states)``: ``residuals`` the
    residual stream after each block ``[B, T, D]``, ``states`` each layer's recurrent state
    after each position ``[B, T, H, M·Dv]`` float32 (None for a layer without a
    `LinearAttentionState`)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def features(params, tokens_BT):
        model = nnx.merge(graphdef, params)
        hidden = model.hidden_states(tokens_BT)
        _, states, _ = decode(graphdef, params, tokens_BT, (None,) * len(model.blocks))
        return hidden.logits, list(hidden.residuals[1:]), states

    return lambda tokens: features(params, jnp.asarray(tokens))


def ridge_fit(batches, num_classes: int, ridge: float) -> np.ndarray:
    """Least squares from features (with a bias column) onto one-hot labels, ridge-regularised
    by ``ridge`` times the mean diagonal of XᵀX, accumulated over ``batches`` of
    ``(features [N, F], labels [N])`` in float64. Returns ``W [F + 1, num_classes]``: the probe's
    answer for features x is argmax([x, 1] W)."""
    xtx = xty = None
    for x_NF, y_N in batches:
        x = np.concatenate([np.asarray(x_NF, np.float64), np.ones((len(x_NF), 1))], axis=1)
        if xtx is None:
            xtx = np.zeros((x.shape[1], x.shape[1]))
            xty = np.zeros((x.shape[1], num_classes))
        xtx += x.T @ x
        np.add.at(xty.T, np.asarray(y_N), x)  # Xᵀ onehot(y), one row per class
    if xtx is None:
        raise ValueError("ridge_fit needs at least one batch of features")
    lam = ridge * np.trace(xtx) / len(xtx)
    return np.linalg.solve(xtx + lam * np.eye(len(xtx)), xty)


def probe_predict(w, x_NF) -> np.ndarray:
    x = np.asarray(x_NF, np.float64)
    return (x @ w[:-1] + w[-1]).argmax(-1)


def accuracy_figures(right_BT, scored_BT) -> dict:
    """Accuracy over the scored positions, sequence accuracy (every scored position right) and
    accuracy by position bucket (buckets with no scored position are left out)."""
    out = dict(
        accuracy=float(right_BT[scored_BT].mean()),
        sequence_accuracy=float((right_BT | ~scored_BT).all(axis=1).mean()),
    )
    by_position = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:], strict=False):
        cols = slice(lo, min(hi, right_BT.shape[1]))
        if lo >= right_BT.shape[1] or not scored_BT[:, cols].any():
            continue
        acc = right_BT[:, cols][scored_BT[:, cols]].mean()
        by_position.append(dict(positions=[lo, min(hi, right_BT.shape[1])], accuracy=float(acc)))
    out["by_position"] = by_position
    return out


def feature_sets(residuals, states) -> dict:
    """``{name: [B, T, F]}`` for every probe: ``state_{l}`` (every head's state, flattened) and
    ``residual_{l}``."""
    sets = {
        f"state_{i}": s.reshape(*s.shape[:2], -1) for i, s in enumerate(states) if s is not None
    }
    sets.update({f"residual_{i}": r for i, r in enumerate(residuals)})
    return sets


def state_norms(norms, length: int) -> list:
    """Per layer with a state (``norms``: per layer, each head's Frobenius norm ``[B, T, H]``,
    or None), the mean norm of each head's state by position bucket."""
    out = []
    for i, n_BTH in enumerate(norms):
        if n_BTH is None:
            continue
        rows = []
        for lo, hi in zip(BUCKETS, BUCKETS[1:], strict=False):
            if lo >= length:
                break
            cols = slice(lo, min(hi, length))
            rows.append(
                dict(positions=[lo, min(hi, length)], norm=n_BTH[:, cols].mean((0, 1)).tolist())
            )
        out.append(dict(layer=i, by_position=rows))
    return out


def state_probe(
    workdir: str, step, fit_batches: int, batch_size: int, ridge: float, cap_scales=(1.0,)
) -> dict:
    run = restore_run(workdir, step=step)
    model, _ = nnx.merge(run.graphdef, run.state)  # (model, optimizer)
    config = run.config
    if config.data.kind != "state_tracking":
        raise ValueError(
            f"state_probe reads state-tracking runs, got data.kind={config.data.kind!r}"
        )
    data = build_data(config)
    features = make_features(model)
    num_classes = config.model.vocab_size

    max_norms = [None] * len(model.blocks)  # per layer, each head's largest state norm

    def training_features():
        first = run.step  # steps the run never trained on
        for s in range(first, first + fit_batches):
            batch = data.train_batch(s, batch_size)
            scored = batch["labels"] != IGNORE_INDEX
            logits, residuals, states = jax.device_get(features(batch["inputs"]))
            for layer, st in enumerate(states):
                if st is not None:
                    top = np.linalg.norm(st[scored], axis=-1).max(0)
                    max_norms[layer] = (
                        top if max_norms[layer] is None else np.maximum(max_norms[layer], top)
                    )
            sets = feature_sets(residuals, states)
            yield {k: (v[scored], batch["labels"][scored]) for k, v in sets.items()}

    batches = list(training_features())
    names = list(batches[0])
    probes = {name: ridge_fit((b[name] for b in batches), num_classes, ridge) for name in names}
    fit_accuracy = {
        name: float(
            np.concatenate([probe_predict(w, b[name][0]) == b[name][1] for b in batches]).mean()
        )
        for name, w in probes.items()
    }
    del batches

    lengths = {}
    for length in data.eval_lengths:
        inputs, labels = data.eval_sets[length]
        scored = labels != IGNORE_INDEX
        right = {name: [] for name in ["model", *names]}
        norms = [[] for _ in model.blocks]
        for s in range(0, len(inputs), batch_size):
            logits, residuals, states = jax.device_get(features(inputs[s : s + batch_size]))
            y = labels[s : s + batch_size]
            right["model"].append(logits.argmax(-1) == y)
            for name, x_BTF in feature_sets(residuals, states).items():
                pred = probe_predict(probes[name], x_BTF.reshape(-1, x_BTF.shape[-1]))
                right[name].append(pred.reshape(y.shape) == y)
            for layer, st in enumerate(states):
                if st is not None:
                    norms[layer].append(np.linalg.norm(st, axis=-1))
        lengths[str(length)] = dict(
            {name: accuracy_figures(np.concatenate(r), scored) for name, r in right.items()},
            state_norms=state_norms([np.concatenate(n) if n else None for n in norms], length),
        )
    return dict(
        run_header(workdir, run),
        caps=capped_accuracy(model, data, max_norms, cap_scales, batch_size),
        fit=dict(
            batches=fit_batches,
            batch_size=batch_size,
            first_step=run.step,
            lengths=[data.min_len, data.max_len],
            ridge=ridge,
            accuracy=fit_accuracy,
        ),
        lengths=lengths,
    )


def capped_accuracy(model, data, max_norms, scales, batch_size: int) -> dict:
    """The model's accuracy when every layer's state is held, head by head, to ``scale`` times
    the largest norm that head reached on the fitting batches (``max_norms``: per layer ``[H]``,
    or None), for each scale: at 1 the cap never acts at training lengths on the fitting data,
    and past them it takes away the growth alone. ``binds``: per layer, the fraction of scored
    (position, head) pairs at which the cap acted."""
    decoder = make_decoder(model)
    out = dict(max_norm=[None if m is None else m.tolist() for m in max_norms], scales={})
    for scale in scales:
        limits = [
            None if m is None else np.float32(scale) * np.asarray(m, np.float32) for m in max_norms
        ]
        caps = tuple(None if m is None else jnp.asarray(m) for m in limits)
        per_length = {}
        for length in data.eval_lengths:
            inputs, labels = data.eval_sets[length]
            scored = labels != IGNORE_INDEX
            right, binds = [], [[] for _ in max_norms]
            for s in range(0, len(inputs), batch_size):
                logits, norms = jax.device_get(decoder(inputs[s : s + batch_size], caps))
                right.append(logits.argmax(-1) == labels[s : s + batch_size])
                for layer, n_BTH in enumerate(norms):
                    if n_BTH is not None:
                        binds[layer].append(n_BTH[scored[s : s + batch_size]] > limits[layer])
            per_length[str(length)] = dict(
                accuracy_figures(np.concatenate(right), scored),
                binds=[float(np.concatenate(b).mean()) if b else None for b in binds],
            )
        out["scales"][f"{scale:g}"] = per_length
    return out


def positive_floats(text: str) -> list:
    """``--cap_scales``: comma-separated positive numbers (``inf``: no cap) or empty."""
    message = f"positive numbers separated by commas, got {text!r}"
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(message) from None
    if not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(message)
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a state-tracking run")
    parser.add_argument("--step", type=int, default=None, help="checkpoint (default: latest)")
    parser.add_argument("--fit_batches", type=int, default=32, help="training batches to fit on")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--ridge", type=float, default=1e-4, help="× mean diagonal of XᵀX")
    parser.add_argument(
        "--cap_scales",
        type=positive_floats,
        default="1",
        help="comma-separated multiples of each head's largest state norm on the fitting batches "
        "to hold the states to (`capped_accuracy`); empty: none",
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    for name in ("fit_batches", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.ridge >= 0:
        parser.error(f"--ridge must be >= 0, got {args.ridge}")
    try:
        result = state_probe(
            args.workdir, args.step, args.fit_batches, args.batch_size, args.ridge, args.cap_scales
        )
    except ValueError as e:
        parser.error(str(e))
    argv = sys.argv[1:] if argv is None else argv
    result["command"] = shlex.join(["python", "experiments/state_probe.py", *argv])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.workdir} (step {result['step']}); probe fit accuracy {result['fit']['accuracy']}")
    for length, figs in result["lengths"].items():
        cells = ", ".join(
            f"{name} {fig['accuracy']:.3f}/{fig['sequence_accuracy']:.3f}"
            for name, fig in figs.items()
            if name != "state_norms"
        )
        print(f"  L={length} (accuracy/sequences): {cells}")
        for layer in figs["state_norms"]:
            rows = "; ".join(
                f"[{r['positions'][0]},{r['positions'][1]}) "
                + " ".join(f"{n:.2f}" for n in r["norm"])
                for r in layer["by_position"]
            )
            print(f"    state norm per head, layer {layer['layer']}: {rows}")
    for scale, per_length in result["caps"]["scales"].items():
        cells = ", ".join(
            f"L={length} {fig['accuracy']:.3f}/{fig['sequence_accuracy']:.3f} (binds "
            + " ".join("-" if b is None else f"{b:.3f}" for b in fig["binds"])
            + ")"
            for length, fig in per_length.items()
        )
        print(f"  states held to {scale} x the fitting batches' largest norm: {cells}")


if __name__ == "__main__":
    main()

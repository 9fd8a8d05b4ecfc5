"""β and the decay γ of a trained delta-rule model, read per token on its evaluation sequences.

    python experiments/gate_stats.py --workdir runs/parity_neg [--step 2000] \
        [--lengths 256] --out docs/results/parity_gate_stats.json

Why: the gated delta rule's transition S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ
multiplies the state's component along k_t by γ_t(1 − β_t) and the rest by γ_t. Carrying a
parity bit over T tokens by reflection needs |γ(1 − β)| = 1 at the tokens that flip it
(γ = 1, β = 2) and γ = 1 at the others; a shortfall ε per token leaves ~(1 − ε)^T of the
difference between the two parities, so the longest sequences fail first. This script measures
those factors on the model instead of assuming them.

For every layer and head, grouped by the input token at the position (for parity: the bit),
over every position of the ``num_eval_examples`` evaluation sequences of each length: β, γ and
γ(1 − β) (mean, min, max, quantiles), and per sequence log10 Π_t γ_t and
log10 Π_t |γ_t(1 − β_t)| (the whole sequence's shrinkage of a component orthogonal to, or
along, every k_t). Also the sequence accuracy (the trainer's argmax at the scored positions),
the readout's margin (label logit minus the best other, at the scored positions) and, for
parity, the accuracy by the number of ones in the sequence (do the errors follow the count of
flips?) and at every prefix length (the running parity at each position: where along the
sequence do the errors start?). With ``--keys``, also the geometry of the keys the
transition reflects along (`key_geometry`): per token, how constant its key is across
positions and contexts, the cosines between the tokens' mean keys and their singular values
(a group word problem solved by reflections should show the group's representation: S5's
transpositions, for one, as e_i − e_j in a 4-dimensional subspace). The mixer's input is read
as `Block` builds it (``mixer_norm`` of the residual stream), so the figures are those of the
trained forward pass. Delta-rule mixers only (`DeltaNetMixer` and its subclasses).

KDA's decay is per key channel: S_t = (I − β_t k_t k_tᵀ) Diag(γ_t) S_{t−1} + …, so there is
no single γ per token. What the transition does to its own key is still one number,
k_tᵀ (I − β_t k_t k_tᵀ) Diag(γ_t) k_t = (1 − β_t) · k_tᵀ Diag(γ_t) k_t, so for such layers
``gamma`` is the decay seen along the token's key, kᵀ Diag(γ) k = Σ_c k_c² γ_c (γ itself for a
scalar decay), ``gamma_times_one_minus_beta`` is that factor, ``gamma_min_over_channels`` is the
most forgetful channel, and ``log10_prod_gamma_per_sequence`` summarises log10 Π_t γ_{t,c} over
every (sequence, channel): Diag(γ) products commute, so that is each channel's exact
whole-sequence shrinkage.
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
from linear_attention.layers import delta_keys
from linear_attention.layers.delta import DeltaNetMixer
from linear_attention.training import build_data
from linear_attention.training.load import restore_run, run_header

QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
EXACT_A_LOG = -1e4  # exp(A) = 0 in float32: log γ = −softplus(z)·0 = 0, so γ = 1 exactly
EXACT_BETA_SCALE = 1e3  # β's logit ×1e3: sigmoid reaches 1 (or 0) exactly in float32
ONES_BINS = 8  # accuracy by number of ones: this many equal-width bins per length
PREFIX_EVERY = 16  # parity's prefix accuracy: at every this many positions (and the last)


def check_model(model) -> None:
    """ValueError unless every layer is a delta-rule mixer."""
    for i, block in enumerate(model.blocks):
        mixer = block.mixer
        if not isinstance(mixer, DeltaNetMixer):
            raise ValueError(
                f"layer {i} has mixer {type(mixer).__name__}; gate_stats reads delta-rule "
                "mixers (deltanet, gated_deltanet, gated_deltaproduct) only"
            )


def exact_reflection(model, layer: int, head: int) -> None:
    """Edit ``model`` in place so that head ``head`` of layer ``layer`` has γ = 1 and β at its
    saturation at every token: its decay's A → exp(EXACT_A_LOG) = 0, and its β logits scaled by
    EXACT_BETA_SCALE, so 2·sigmoid gives exactly 2 where the logit is > 0 (0 where < 0). This
    is the transition the reading says parity needs (|γ(1 − β)| = 1); evaluating the edited
    model tells whether the trained model's shortfall from it is what fails the long lengths."""
    if not 0 <= layer < len(model.blocks):
        raise ValueError(f"layer must be in [0, {len(model.blocks)}), got {layer}")
    mixer = model.blocks[layer].mixer
    if not 0 <= head < mixer.num_value_heads:
        raise ValueError(f"head must be in [0, {mixer.num_value_heads}), got {head}")
    if mixer.decay is not None:
        a_log = mixer.decay.a_log
        a_log[...] = a_log[...].at[head].set(EXACT_A_LOG)
    n = mixer.beta_proj.kernel.shape[-1] // mixer.num_value_heads  # keys per head
    kernel = mixer.beta_proj.kernel
    cols = slice(head * n, (head + 1) * n)
    kernel[...] = kernel[...].at[:, cols].multiply(EXACT_BETA_SCALE)


def make_forward(model, keys: bool = False):
    """A jitted ``tokens[B, T] -> (logits, [β [B,T,H·n]], [log γ], [k [B,T,H·n,K]], [k_γ])``
    per layer. log γ is ``[B,T,H]``, or ``[B,T,H,K]`` for a per-channel decay (kda), whose
    layers also give k_γ, their unit keys per value head ``[B,T,H,K]`` (None elsewhere). k is
    `delta_keys`, the unit keys, only with ``keys``, else an empty list: they are the largest
    outputs, brought to the host for every batch."""
    graphdef, state = nnx.split(model)
    want_keys = keys

    @jax.jit
    def forward(state, tokens_BT):
        model = nnx.merge(graphdef, state)
        hidden = model.hidden_states(tokens_BT)
        betas, log_decays, keys, decay_keys = [], [], [], []
        for block, xn_BTD in zip(model.blocks, hidden.mixer_inputs, strict=True):
            betas.append(block.mixer.beta(xn_BTD))
            if want_keys:
                k = delta_keys(block.mixer, xn_BTD)
                keys.append(k.reshape(*k.shape[:2], -1, k.shape[-1]))  # [B, T, H·n, K]
            decay = block.mixer.decay
            log_decay_BTH = (
                jnp.zeros(betas[-1].shape, jnp.float32) if decay is None else decay(xn_BTD)
            )
            log_decays.append(log_decay_BTH)
            if log_decay_BTH.ndim == 4:  # per channel: the decay along a key needs the key
                k_BTHK = delta_keys(block.mixer, xn_BTD)
                # value head j reads key head j // (HV / H)
                group = log_decay_BTH.shape[2] // k_BTHK.shape[2]
                decay_keys.append(jnp.repeat(k_BTHK, group, axis=2))
            else:
                decay_keys.append(None)
        return hidden.logits, betas, log_decays, keys, decay_keys

    return lambda tokens: forward(state, tokens)


def summary(values) -> dict:
    """mean, min, max and `QUANTILES` of a 1-D array, as floats (None where empty)."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return None
    out = dict(mean=float(v.mean()), min=float(v.min()), max=float(v.max()))
    out.update(
        {f"q{q:g}": float(x) for q, x in zip(QUANTILES, np.quantile(v, QUANTILES), strict=True)}
    )
    return out


def gate_figures(beta_BTH, log_decay_BTH, tokens_BT, keys_BTHK=None) -> list[dict]:
    """Per head: β, γ, γ(1−β) by input token, and the per-sequence log10 products. A
    per-channel log decay ``[B,T,H,K]`` takes the unit keys ``keys_BTHK`` of the same shape,
    and γ is then the decay along the token's key (the module docstring)."""
    per_channel = log_decay_BTH.ndim == 4
    if per_channel and (keys_BTHK is None or keys_BTHK.shape != log_decay_BTH.shape):
        raise ValueError(
            f"a per-channel log decay {log_decay_BTH.shape} needs keys of the same shape, got "
            f"{None if keys_BTHK is None else keys_BTHK.shape}"
        )
    heads = []
    num_keys = beta_BTH.shape[-1] // log_decay_BTH.shape[2]
    # β has H·n columns (n Householder keys per head, gated_deltaproduct); its key j of head h
    # is column h·n + j, and shares the head's decay
    for h in range(beta_BTH.shape[-1]):
        beta = beta_BTH[..., h].astype(np.float64)
        if per_channel:
            log_gamma_BTK = log_decay_BTH[..., h, :].astype(np.float64)
            k_BTK = keys_BTHK[..., h, :].astype(np.float64)
            gamma = (k_BTK**2 * np.exp(log_gamma_BTK)).sum(-1)  # log γ ≤ 0: no overflow
            with np.errstate(divide="ignore"):
                log_gamma = np.log(gamma)
        else:
            log_gamma = log_decay_BTH[..., h // num_keys].astype(np.float64)
            gamma = np.exp(log_gamma)
        along_k = gamma * (1.0 - beta)
        with np.errstate(divide="ignore"):
            log10_along = (log_gamma + np.log(np.abs(1.0 - beta))) / np.log(10.0)
        head = dict(head=h // num_keys, key=h % num_keys, by_token={})
        for token in np.unique(tokens_BT):
            at = tokens_BT == token
            head["by_token"][str(int(token))] = dict(
                count=int(at.sum()),
                beta=summary(beta[at]),
                gamma=summary(gamma[at]),
                gamma_times_one_minus_beta=summary(along_k[at]),
            )
            if per_channel:
                head["by_token"][str(int(token))]["gamma_min_over_channels"] = summary(
                    np.exp(log_gamma_BTK.min(-1))[at]
                )
        prod_log_gamma = log_gamma_BTK.sum(1).ravel() if per_channel else log_gamma.sum(-1)
        head["log10_prod_gamma_per_sequence"] = summary(prod_log_gamma / np.log(10.0))
        head["log10_prod_abs_along_k_per_sequence"] = summary(log10_along.sum(-1))
        heads.append(head)
    return heads


def key_geometry(keys_BTHK, tokens_BT) -> list[dict]:
    """Per head (and Householder key, as β's columns): for every input token, its mean unit key
    m over the positions it is at, and ``consistency`` = |m| (1: the same key at every position,
    whatever the conv reads of the context; less: the key varies); ``cosines`` between the
    tokens' mean key directions m/|m| (rows and columns in ``tokens`` order); and the singular
    values of the matrix of those directions, divided by the largest (how many dimensions the
    tokens' keys span)."""
    heads = []
    tokens = np.unique(tokens_BT)
    for h in range(keys_BTHK.shape[2]):
        k_NK = keys_BTHK[:, :, h].reshape(-1, keys_BTHK.shape[-1]).astype(np.float64)
        k_NK = k_NK / np.linalg.norm(k_NK, axis=-1, keepdims=True)
        means = np.stack([k_NK[tokens_BT.reshape(-1) == t].mean(0) for t in tokens])
        norms = np.linalg.norm(means, axis=-1)
        directions = means / norms[:, None]
        singular = np.linalg.svd(directions, compute_uv=False)
        heads.append(
            dict(
                tokens=[int(t) for t in tokens],
                consistency=norms.tolist(),
                cosines=(directions @ directions.T).tolist(),
                singular_values=(singular / singular[0]).tolist(),
            )
        )
    return heads


def length_figures(forward, inputs, labels, task: str, batch_size: int, keys: bool = False) -> dict:
    """Gate figures and accuracy for one evaluation length (all its sequences); with ``keys``,
    each layer's `key_geometry` too."""
    parts = [
        jax.device_get(forward(jnp.asarray(inputs[s : s + batch_size])))
        for s in range(0, len(inputs), batch_size)
    ]
    logits = np.concatenate([p[0] for p in parts])
    # per layer: β and log γ of every batch, joined along the batch axis
    betas = [np.concatenate(layer) for layer in zip(*(p[1] for p in parts), strict=True)]
    log_decays = [np.concatenate(layer) for layer in zip(*(p[2] for p in parts), strict=True)]
    key_layers = (
        [np.concatenate(layer) for layer in zip(*(p[3] for p in parts), strict=True)]
        if keys
        else [None] * len(betas)
    )
    decay_keys = [
        None if layer[0] is None else np.concatenate(layer)
        for layer in zip(*(p[4] for p in parts), strict=True)
    ]
    scored = labels != IGNORE_INDEX
    correct_BT = (logits.argmax(-1) == labels) & scored
    # sequence-level: a sequence is right when every scored position is
    seq_correct = correct_BT.sum(-1) == scored.sum(-1)
    # the readout's margin at the scored positions: logit of the label minus the best other
    # logit (> 0 where right); whether errors are small margins (a faded signal) or confident
    logits_NV, labels_N = logits[scored], labels[scored]
    label_logit = np.take_along_axis(logits_NV, labels_N[:, None], -1)[:, 0]
    np.put_along_axis(logits_NV, labels_N[:, None], -np.inf, -1)
    margin = label_logit - logits_NV.max(-1)
    out = dict(
        num_sequences=int(len(inputs)),
        sequence_accuracy=float(seq_correct.mean()),
        margin=summary(margin),
        abs_margin_right=summary(np.abs(margin[margin > 0])),
        abs_margin_wrong=summary(np.abs(margin[margin <= 0])),
        layers=[
            dict(layer=i, heads=gate_figures(b, d, inputs, dk))
            | ({} if k is None else dict(keys=key_geometry(k, inputs)))
            for i, (b, d, k, dk) in enumerate(
                zip(betas, log_decays, key_layers, decay_keys, strict=True)
            )
        ],
    )
    if task == "parity":
        ones = inputs.sum(-1)
        edges = np.linspace(ones.min(), ones.max() + 1, ONES_BINS + 1).round().astype(int)
        out["accuracy_by_number_of_ones"] = [
            dict(
                ones_from=int(lo),
                ones_to=int(hi - 1),
                count=int(sel.sum()),
                accuracy=float(seq_correct[sel].mean()),
            )
            for lo, hi in zip(edges[:-1], edges[1:], strict=True)
            if (sel := (ones >= lo) & (ones < hi)).any()
        ]
        # the model is causal, so its answer at position t is its answer for the prefix of
        # length t + 1: accuracy at every prefix length, from the same forward pass
        right_BT = logits.argmax(-1) == np.cumsum(inputs, -1) % 2
        at = sorted({*range(PREFIX_EVERY - 1, inputs.shape[1], PREFIX_EVERY), inputs.shape[1] - 1})
        out["prefix_accuracy"] = dict(
            prefix_length=[t + 1 for t in at], accuracy=[float(right_BT[:, t].mean()) for t in at]
        )
    return out


def gate_stats(
    workdir: str, step: int | None, lengths, batch_size: int, exact=(), keys: bool = False
) -> dict:
    """The figures of every length in ``lengths`` (with ``keys``, the key geometry too); with
    ``exact`` (``(layer, head)`` pairs), also those of the model edited by `exact_reflection`
    at each pair."""
    run = restore_run(workdir, step=step)
    model, _ = nnx.merge(run.graphdef, run.state)  # (model, optimizer)
    config = run.config
    check_model(model)
    if config.data.kind != "state_tracking":
        raise ValueError(
            f"gate_stats reads state-tracking runs, got data.kind={config.data.kind!r}"
        )
    data = build_data(config)
    lengths = tuple(data.eval_lengths) if not lengths else tuple(lengths)
    missing = [L for L in lengths if L not in data.eval_sets]
    if missing:
        raise ValueError(f"lengths {missing} are not evaluation lengths {data.eval_lengths}")
    task = config.data.task

    def figures(forward):
        return {
            str(L): length_figures(forward, *data.eval_sets[L], task, batch_size, keys)
            for L in lengths
        }

    measured = figures(make_forward(model, keys))
    edited = None
    if exact:
        for layer, head in exact:
            exact_reflection(model, layer, head)
        edited = dict(
            heads=[list(pair) for pair in exact], lengths=figures(make_forward(model, keys))
        )
    return dict(
        run_header(workdir, run),
        lengths=measured,
        exact_reflection=edited,
    )


def print_figures(lengths: dict, title: str) -> None:
    print(title)
    for L, fig in lengths.items():
        print(f"length {L}: sequence accuracy {fig['sequence_accuracy']:.3f}")
        for layer in fig["layers"]:
            for head in layer["heads"]:
                parts = []
                for tok, s in head["by_token"].items():
                    parts.append(
                        f"tok {tok}: β {s['beta']['mean']:.4f} γ {s['gamma']['mean']:.5f} "
                        f"γ(1−β) {s['gamma_times_one_minus_beta']['mean']:+.5f}"
                    )
                print(f"  layer {layer['layer']} head {head['head']}: " + "; ".join(parts))
            for h, geometry in enumerate(layer.get("keys", ())):
                singular = ", ".join(f"{v:.3f}" for v in geometry["singular_values"])
                print(f"  layer {layer['layer']} key column {h}: singular values {singular}")
        if "accuracy_by_number_of_ones" in fig:
            print(
                "  by ones:",
                [
                    (b["ones_from"], b["ones_to"], round(b["accuracy"], 3))
                    for b in fig["accuracy_by_number_of_ones"]
                ],
            )


def layer_head(text: str) -> tuple[int, int]:
    """``"LAYER:HEAD"`` -> (layer, head)."""
    try:
        layer, head = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYER:HEAD (e.g. 0:1), got {text!r}") from None
    return layer, head


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a run written by experiments/train.py")
    parser.add_argument("--step", type=int, default=None, help="checkpoint (default: latest)")
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        default=None,
        help="evaluation lengths (default: all of the run's)",
    )
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument(
        "--exact",
        type=layer_head,
        nargs="*",
        default=(),
        metavar="LAYER:HEAD",
        help="also evaluate with these heads edited to γ = 1 and β saturated (exact_reflection)",
    )
    parser.add_argument(
        "--keys", action="store_true", help="also the keys' geometry by token (key_geometry)"
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {args.batch_size}")
    result = gate_stats(
        args.workdir, args.step, args.lengths, args.batch_size, args.exact, args.keys
    )
    argv = sys.argv[1:] if argv is None else argv
    result = dict(command=shlex.join(["python", "experiments/gate_stats.py", *argv]), **result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_figures(result["lengths"], "measured")
    if result["exact_reflection"] is not None:
        edited = result["exact_reflection"]
        print_figures(edited["lengths"], f"exact reflection at (layer, head) {edited['heads']}")


if __name__ == "__main__":
    main()

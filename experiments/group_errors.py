"""What a trained model gets right on a group word problem: the running product's sign against
the whole element, by evaluation length and by position.

    python experiments/group_errors.py --workdir runs/s3_n2 [--workdir runs/s3_n1 ...] \
        --out docs/results/s3_group_errors.json

Why: the sign of a permutation is a homomorphism onto {±1}, so the sign of the running product
is the parity of the number of odd tokens so far: a parity problem inside the group problem.
A model that carries only that bit (one reflection per token can) and guesses the rest gets the
sign right everywhere and the element right 1/(|G|/2) of the time (1/3 for S3, loss ln 3);
one that carries nothing past the short convolution gets the first few positions right and
chance after. The two read differently in ``eval/accuracy`` only as a level; this script
separates them. A5 has only even elements (its sign is always +1), so its sign figures are
omitted.

Per run and evaluation length: the element accuracy over every position (the trainer's
``eval/length_{L}/accuracy``), the sign accuracy, the element accuracy where the sign is right,
the element and sign accuracy by position bucket (`BUCKETS`; the model is causal, so
position t is the prefix of length t + 1), and whether errors are a lost state or a misread one
(`error_structure`: the sequence accuracy, where the first error falls, the accuracy after it,
how often a wrong position is followed by a right one), how often a wrong answer is the
previous position's label (the newest token not applied) and how many transpositions separate
each wrong answer from the right one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import jax
import numpy as np
from flax import nnx

from linear_attention.data.batches import IGNORE_INDEX
from linear_attention.data.state_tracking import (
    group_elements,
    multiplication_table,
    permutation_sign,
)
from linear_attention.training import build_data
from linear_attention.training.load import restore_run, run_header

# Position buckets [a, b): positions 0 and 1 alone (the first element and the first product,
# both within the short convolution's reach: the floor's reading), 40 the longest trained.
BUCKETS = (0, 1, 2, 4, 16, 40, 64, 128, 256)


def make_forward(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens_BT):
        return nnx.merge(graphdef, state)(tokens_BT)

    return lambda tokens: np.asarray(forward(state, tokens))


def transposition_distances(elements) -> np.ndarray:
    """[G, G]: the fewest transpositions that turn element a into element b (n minus the
    number of cycles of a⁻¹b): 1 is a right answer off by one swap."""
    elements = np.asarray(elements)
    n = elements.shape[1]
    cycles = np.zeros(len(elements), np.int32)
    for g, perm in enumerate(elements):
        seen = np.zeros(n, bool)
        for start in range(n):
            cycles[g] += not seen[start]
            while not seen[start]:
                seen[start], start = True, perm[start]
    table = multiplication_table(elements)
    identity = int(np.flatnonzero((elements == np.arange(n)).all(axis=1))[0])
    inverse = np.argmax(table == identity, axis=1)
    return (n - cycles[table[inverse]]).astype(np.int32)  # [a, b]: cycles of a⁻¹ ∘ b


def length_figures(forward, inputs, labels, signs, batch_size: int, distances=None) -> dict:
    """The figures of one evaluation length (every sequence has that length); with
    ``distances`` (`transposition_distances`), how far the wrong answers are from the right
    ones: the share of errors at each distance."""
    if (labels == IGNORE_INDEX).any():  # a padded position would count as wrong and index signs
        raise ValueError("labels must score every position (evaluation sets of one length)")
    preds = np.concatenate(
        [forward(inputs[i : i + batch_size]).argmax(-1) for i in range(0, len(inputs), batch_size)]
    )
    right = preds == labels
    out = dict(accuracy=float(right.mean()))
    if signs is not None:
        sign_right = signs[preds] == signs[labels]
        out["sign_accuracy"] = float(sign_right.mean())
        out["accuracy_where_sign_right"] = float(right[sign_right].mean())
    out.update(error_structure(right))
    # a wrong answer equal to the previous position's label: the newest token not applied
    lagging = preds[:, 1:][~right[:, 1:]] == labels[:, :-1][~right[:, 1:]]
    out["wrong_is_previous_label"] = float(lagging.mean()) if lagging.size else None
    if distances is not None and (~right).any():
        d = distances[preds[~right], labels[~right]]
        out["error_distances"] = {
            str(k): float((d == k).mean()) for k in range(1, int(distances.max()) + 1)
        }
    by_position = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:], strict=False):
        if lo >= labels.shape[1]:
            break
        cols = slice(lo, min(hi, labels.shape[1]))
        row = dict(positions=[lo, min(hi, labels.shape[1])], accuracy=float(right[:, cols].mean()))
        if signs is not None:
            row["sign_accuracy"] = float(sign_right[:, cols].mean())
        by_position.append(row)
    out["by_position"] = by_position
    return out


def error_structure(right) -> dict:
    """Whether a model's errors are a lost state or a misread one, from ``right`` [N, T].

    The label at every position is the running product, so a model whose state went wrong at
    its first error stays wrong after it (at the level of a guess); one that misreads a right
    state now and then is right again at the next position. ``accuracy_after_first_error`` is the
    accuracy over the positions after each sequence's first error, to set beside ``accuracy``;
    ``right_after_wrong`` is P(right at t + 1 | wrong at t). Both are None where nothing is
    wrong (or nothing follows an error).
    """
    wrong = ~right
    has_error = wrong.any(axis=1)
    first = wrong.argmax(axis=1)[has_error]
    after = np.arange(right.shape[1])[None, :] > first[:, None]
    after_right = right[has_error][after]
    follows_wrong = right[:, 1:][wrong[:, :-1]]
    return dict(
        sequence_accuracy=float(1.0 - has_error.mean()),
        first_error_median=float(np.median(first)) if first.size else None,
        accuracy_after_first_error=float(after_right.mean()) if after_right.size else None,
        right_after_wrong=float(follows_wrong.mean()) if follows_wrong.size else None,
    )


def group_errors(workdir: str, step: int | None, batch_size: int) -> dict:
    run = restore_run(workdir, step=step)
    model, _ = nnx.merge(run.graphdef, run.state)  # (model, optimizer)
    config = run.config
    task = config.data.task
    if config.data.kind != "state_tracking" or task in ("parity", "mod_arith"):
        raise ValueError(
            f"group_errors reads group word problems (s3, s5, s5_swaps, a5), got "
            f"data.kind={config.data.kind!r}, data.task={task!r}"
        )
    elements = group_elements(task)
    signs = np.array([permutation_sign(p) for p in elements])
    signs = None if task == "a5" else signs
    distances = transposition_distances(elements)
    data = build_data(config)
    forward = make_forward(model)
    return dict(
        run_header(workdir, run),
        lengths={
            str(L): length_figures(forward, *data.eval_sets[L], signs, batch_size, distances)
            for L in data.eval_lengths
        },
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", required=True, action="append", help="a group-task run (repeatable)"
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint (default: latest)")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {args.batch_size}")
    try:
        runs = [group_errors(w, args.step, args.batch_size) for w in args.workdir]
    except ValueError as e:
        parser.error(str(e))
    argv = sys.argv[1:] if argv is None else argv
    result = dict(command=shlex.join(["python", "experiments/group_errors.py", *argv]), runs=runs)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for run in runs:
        print(f"{run['workdir']} (step {run['step']})")
        for L, fig in run["lengths"].items():
            sign = (
                f" sign {fig['sign_accuracy']:.3f}, element where sign right "
                f"{fig['accuracy_where_sign_right']:.3f};"
                if "sign_accuracy" in fig
                else ""
            )
            buckets = ", ".join(
                f"[{b['positions'][0]},{b['positions'][1]}) {b['accuracy']:.3f}"
                for b in fig["by_position"]
            )
            recovery = "".join(
                f" {name} {fig[key]:.3f};"
                for name, key in (
                    ("after the first error", "accuracy_after_first_error"),
                    ("right after a wrong one", "right_after_wrong"),
                    ("wrong = the previous label", "wrong_is_previous_label"),
                )
                if fig[key] is not None  # (None where nothing is wrong, or nothing follows)
            )
            if "error_distances" in fig:
                recovery += " errors by swaps away " + " ".join(
                    f"{k}:{v:.3f}" for k, v in fig["error_distances"].items()
                )
                recovery += f"; first error at {fig['first_error_median']:.0f} (median);"
            print(
                f"  L={L}: accuracy {fig['accuracy']:.3f}, sequences "
                f"{fig['sequence_accuracy']:.3f};{sign}{recovery} by position: {buckets}"
            )


if __name__ == "__main__":
    main()

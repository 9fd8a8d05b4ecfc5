"""What MAD's recall tasks score without recall: the level a model reaches by counting values.

    python experiments/mad_baselines.py --out docs/results/mad_recall_baselines.json

Why: in in-context and noisy recall (`linear_attention.data.mad`) each sequence binds its 8
keys to values drawn with replacement from 8 value tokens, so some values serve several keys.
A model that predicts, at each query, the value token seen most often so far in the sequence
uses no key at all: it needs only a running count, which any mixer can keep. Its class-macro
accuracy is the plateau the MAD study's failed runs sit on (docs/studies/mad.md), which
this script measures on the presets' own test sets (``configs/mad.py:<task>``, seed 0).

Rules, each scored as the trainer scores MAD (class-macro accuracy over the scored positions):

- ``uniform``: the expected score of a uniform guess among the 8 value tokens (1/8);
- ``most_frequent_value``: the value token seen most often before the query (ties: the lowest
  id; no value seen yet: the lowest value id).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import numpy as np

from linear_attention.training import build_data, experiment_config
from linear_attention.training.cli import load_config_file
from linear_attention.training.scores import class_macro_accuracy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("in_context_recall", "noisy_recall")


def most_frequent_value(inputs_NT, values) -> np.ndarray:
    """``[N, T]`` the prediction of the counting rule at every position: the id in ``values``
    (sorted) that occurred most often in ``inputs`` strictly before the position."""
    values = np.asarray(sorted(values))
    onehot_NTV = (inputs_NT[..., None] == values).astype(np.int64)
    before_NTV = np.cumsum(onehot_NTV, axis=1) - onehot_NTV
    return values[np.argmax(before_NTV, axis=-1)]  # argmax: the first maximum, the lowest id


def macro(pred_NT, labels_NT, num_classes) -> float:
    scored = labels_NT >= 0
    correct_V = np.bincount(labels_NT[scored], pred_NT[scored] == labels_NT[scored], num_classes)
    count_V = np.bincount(labels_NT[scored], minlength=num_classes)
    return class_macro_accuracy(correct_V, count_V)


def task_baselines(task: str) -> dict:
    config = experiment_config(load_config_file(os.path.join(ROOT, "configs", f"mad.py:{task}")))
    data = build_data(config)
    inputs, labels = data.test_inputs, data.test_labels
    values = np.unique(labels[labels >= 0])
    pred = most_frequent_value(inputs, values)
    return {
        "task": task,
        "vocab_size": config.data.vocab_size,
        "seq_len": config.data.seq_len,
        "test_examples": int(inputs.shape[0]),
        "scored_positions": int((labels >= 0).sum()),
        "value_tokens": values.tolist(),
        "uniform": 1.0 / len(values),
        "most_frequent_value": macro(pred, labels, data.vocab_size),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    result = {
        "command": shlex.join(["python", "experiments/mad_baselines.py", *argv]),
        "tasks": [task_baselines(t) for t in TASKS],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for row in result["tasks"]:
        counting = row["most_frequent_value"]
        print(f"{row['task']}: uniform {row['uniform']:.3f}, counting {counting:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

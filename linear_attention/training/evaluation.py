"""Evaluation of a training state on a source's evaluation set (`evaluate`): loss, accuracy,
bits per byte for text, MAD's class-macro accuracy, state tracking's per-length accuracy."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from linear_attention.data.protocol import DataSource
from linear_attention.data.tokenizers import bits_per_byte, label_bytes
from linear_attention.training.config import ExperimentConfig
from linear_attention.training.mesh import shard_batch
from linear_attention.training.run_data import checked
from linear_attention.training.scores import (
    class_macro_accuracy,
    class_token_stats,
    length_metrics,
)
from linear_attention.training.steps import model_stats


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh", "loss_chunks"))
def eval_step(state, batch, *, graphdef, mesh=None, loss_chunks=None):
    """`steps.model_stats` (by the train step's ``loss_chunks``: the chunked loss gives the
    argmax of accuracy too, so evaluation never holds the ``[B, T, V]`` logits either)."""
    model, _ = nnx.merge(graphdef, state)
    # (evaluation is the cross-entropy's alone)
    return model_stats(model, batch, mesh, loss_chunks)[:3]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def class_eval_step(state, batch, *, graphdef):
    """`scores.class_token_stats` of the model on ``batch`` (for class-macro accuracy)."""
    model, _ = nnx.merge(graphdef, state)
    return class_token_stats(model(batch["inputs"]), batch["labels"])


def evaluate(state, data: DataSource, config: ExperimentConfig, graphdef, mesh) -> dict[str, float]:
    """Mean loss and accuracy over every labelled position of the evaluation set (for MQAR:
    the query positions only); bits per byte for text. A source scored ``class_macro`` (MAD)
    reports that as eval/accuracy; one with ``eval_groups`` (state tracking) reports each
    group's accuracy and their mean (`scores`)."""
    batch_size = config.train.eval_batch
    macro = data.score == "class_macro"
    groups = data.eval_groups(batch_size)
    token_bytes = data.token_bytes  # None: no text (or no tokenizer)
    totals, num_bytes = {}, 0
    chunks = config.loss_chunks
    for name, batches in groups.items():
        sums = []
        for b in batches:
            if token_bytes is not None:
                num_bytes += label_bytes(b["labels"], token_bytes)
            b = shard_batch(checked(b, config.model, "an eval batch"), mesh)
            if macro:
                sums.append(class_eval_step(state, b, graphdef=graphdef))
            else:
                sums.append(eval_step(state, b, graphdef=graphdef, mesh=mesh, loss_chunks=chunks))
        parts = zip(*jax.device_get(sums), strict=True)  # (loss sums, corrects, counts)
        totals[name] = [np.asarray(x, np.float64).sum(axis=0) for x in parts]
    if "" not in totals:
        return length_metrics(
            {name: [float(np.sum(x)) for x in t] for name, t in totals.items()}, data.chance
        )
    loss_sum, correct, count = totals[""]
    count_total = max(float(np.sum(count)), 1.0)
    out = {"eval/loss": float(loss_sum) / count_total}
    out["eval/accuracy"] = float(np.sum(correct)) / count_total
    if macro:  # MAD's score; the plain token accuracy is kept beside it
        out["eval/token_accuracy"] = out["eval/accuracy"]
        out["eval/accuracy"] = class_macro_accuracy(correct, count)
    if token_bytes is not None:  # over the bytes the predicted tokens cover
        out["eval/bits_per_byte"] = bits_per_byte(float(loss_sum), count_total, num_bytes)
    return out

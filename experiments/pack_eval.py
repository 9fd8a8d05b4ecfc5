"""Evaluate trained text runs with and without document boundaries, on the same bytes.

    python experiments/pack_eval.py runs/pack/gated-nopack runs/pack/gated-pack \
        --output runs/pack/pack_eval.json [--separator '' --separator '\n\n\n']

Each run's newest checkpoint is evaluated on its own validation windows (``config.data``) built
with ``pack=True``, twice: ``packed`` (the model gets the windows' ``segment_ids``: every
document on its own, states reset at each document start) and ``windows`` (no segment ids: a
window runs across document boundaries, as in unpacked training). Both score the same bytes:
the labels of the packed windows, where a label that crosses a boundary is ignored. So the gap
between the two columns is what seeing the previous document is worth to that model, and the
rows compare models trained with and without packing. ``--separator`` (repeatable; backslash
escapes decoded, ``''``: files) evaluates every run with those documents instead of its own.
Prints a table; writes JSON with the machine, each run's config and the figures in bits per
byte: the summed loss over the bytes the labelled tokens cover, as the trainer and ``la-eval``
compute it (`trainer.evaluate`, `tokenizers.bits_per_byte`), so runs with a BPE or
sentencepiece tokenizer are scored per byte too, not per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from flax import nnx

from linear_attention.benchmarks import machine_info
from linear_attention.data import IGNORE_INDEX
from linear_attention.data.protocol import DataSource
from linear_attention.data.tokenizers import label_bytes
from linear_attention.training import experiment_config, make_optimizer, trainer
from linear_attention.training.checkpoint import Checkpoints
from linear_attention.training.cli_args import config_from_json
from linear_attention.training.mesh import make_mesh


class _WithoutSegments(DataSource):
    """The same evaluation batches with the segment ids removed."""

    def __init__(self, data):
        self.data = data
        self.token_bytes = data.token_bytes  # bits per byte over the same bytes
        self.seq_len, self.vocab_size = data.seq_len, data.vocab_size

    def eval_batches(self, batch_size):
        for batch in self.data.eval_batches(batch_size):
            yield {k: v for k, v in batch.items() if k != "segment_ids"}


def evaluate_run(workdir: str, separators=None) -> list[dict]:
    with open(os.path.join(workdir, "config.json")) as f:
        cfg = experiment_config(config_from_json(json.load(f)))
    if cfg.data.kind != "text":
        raise ValueError(f"{workdir} is not a text run (data.kind = {cfg.data.kind!r})")
    trained_packed, trained_separator = cfg.data.pack, cfg.data.separator
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack=True))
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    abstract = nnx.split(nnx.eval_shape(lambda: trainer.build_model(cfg, tx)))
    graphdef, abstract_state = abstract
    checkpoints = Checkpoints(os.path.join(workdir, "checkpoints"), keep=1_000_000)
    try:
        step = checkpoints.latest_step()
        state = checkpoints.restore(step, abstract_state)
    finally:
        checkpoints.close()
    mesh = make_mesh(1)
    rows = []
    for separator in [trained_separator] if separators is None else separators:
        # (replace checks the data config again: a bad escape is named)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, separator=separator))
        data = trainer.build_data(cfg)
        labelled = int(np.sum(data.val_labels != IGNORE_INDEX))  # tokens
        out = dict(
            workdir=os.path.abspath(workdir),
            mixer=cfg.model.mixer,
            trained_packed=trained_packed,
            trained_separator=trained_separator,
            separator=separator,
            seed=cfg.seed,
            step=step,
            tokenizer=cfg.data.tokenizer,
            labelled_tokens=labelled,
            labelled_bytes=label_bytes(data.val_labels, data.token_bytes),
            boundaries=int(data.val_labels.size - labelled),
        )
        for name, source in (("packed", data), ("windows", _WithoutSegments(data))):
            metrics = trainer.evaluate(state, source, cfg, graphdef, mesh)
            out[f"{name}/bits_per_byte"] = metrics["eval/bits_per_byte"]
        rows.append(out)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--output", default=None, help="JSON file for the results")
    parser.add_argument(
        "--separator", action="append", default=None, help="documents to evaluate with"
    )
    args = parser.parse_args(argv)
    machine = machine_info()
    start = time.perf_counter()
    rows = [row for w in args.workdirs for row in evaluate_run(w, args.separator)]
    print("| run | mixer | trained packed | step | documents | boundaries | packed | windows |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {Path(r['workdir']).name} | {r['mixer']} | {r['trained_packed']} | {r['step']} "
            f"| {r['separator'] or 'files'!r} | {r['boundaries']} "
            f"| {r['packed/bits_per_byte']:.4f} | {r['windows/bits_per_byte']:.4f} |"
        )
    if args.output:
        result = dict(machine=machine, wall_time_sec=time.perf_counter() - start, runs=rows)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

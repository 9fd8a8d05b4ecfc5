"""A BPE run against the byte-level baseline, in bits per byte on the same validation bytes.

    python experiments/bpe_vs_bytes.py runs/lm-bpe --baseline docs/results/lm_packing_cpu.json \
        --output docs/results/lm_bpe_vs_bytes_cpu.json

The BPE run's validation split is cut from its token stream, so its own ``eval/bits_per_byte``
is measured on other text than a byte run's. This script also scores it on the byte run's
validation windows: the windows of ``seq_len + 1`` bytes a byte-level ``configs/lm.py`` run
evaluates (same corpus, ``max_bytes``, split and ``num_val_windows``), each decoded to text
(a character cut by the window's edges is dropped), encoded with the run's tokenizer and
scored on its tokens after the first: cross-entropy summed over those tokens, divided by
``ln 2`` times the bytes they cover. Like the byte run, every window starts without context
and no segment ids are given (the baseline figure taken is its ``windows/bits_per_byte``,
``pack_eval.py``'s score of the same windows without segment ids).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from linear_attention.benchmarks import machine_info
from linear_attention.data import IGNORE_INDEX, TextData, load_tokenizer
from linear_attention.data.tokenizers import bits_per_byte, label_bytes
from linear_attention.training import evaluation
from linear_attention.training.load import restore_run
from linear_attention.training.mesh import shard_batch


def window_batches(windows: list[bytes], tokenizer, width: int, batch_size: int):
    """Batches of the windows as tokens (``inputs = ids[:-1]``, ``labels = ids[1:]``, padded
    to ``width`` with ignored labels), and the bytes their labels cover."""
    inputs = np.zeros((len(windows), width), np.int32)
    labels = np.full((len(windows), width), IGNORE_INDEX, np.int32)
    for i, window in enumerate(windows):
        ids = tokenizer.encode(window.decode("utf-8", errors="ignore"))[: width + 1]
        inputs[i, : ids.size - 1], labels[i, : ids.size - 1] = ids[:-1], ids[1:]
    covered = label_bytes(labels, tokenizer.token_bytes)
    batches = [
        {"inputs": inputs[b : b + batch_size], "labels": labels[b : b + batch_size]}
        for b in range(0, len(windows), batch_size)
    ]
    return batches, covered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", help="the BPE run")
    parser.add_argument("--baseline", required=True, help="pack_eval.py's JSON of the byte run")
    parser.add_argument("--baseline_run", default="gated-pack", help="its run folder's name")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    machine, start = machine_info(), time.perf_counter()
    run = restore_run(args.workdir)
    cfg, d = run.config, run.config.data
    tokenizer = load_tokenizer(d.tokenizer)
    byte_data = TextData(
        seq_len=d.seq_len,
        path=d.path or None,
        max_bytes=d.max_bytes or None,
        val_fraction=d.val_fraction,
        num_val_windows=d.num_val_windows,
        seed=cfg.seed,
    )
    windows = [
        bytes(np.r_[x, y[-1:]].astype(np.uint8))
        for x, y in zip(byte_data.val_inputs, byte_data.val_labels, strict=True)
    ]
    batches, covered = window_batches(windows, tokenizer, d.seq_len, cfg.train.eval_batch)
    sums = [
        evaluation.eval_step(
            run.state, shard_batch(b, run.mesh), graphdef=run.graphdef, mesh=run.mesh
        )
        for b in batches
    ]
    loss_sum, _, count = np.asarray(sums, np.float64).sum(axis=0).tolist()

    with open(os.path.join(args.workdir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(args.workdir, "metrics.jsonl")) as f:
        curve = [
            {"step": r["step"], "eval/bits_per_byte": r["eval/bits_per_byte"]}
            for r in map(json.loads, f)
            if "eval/bits_per_byte" in r
        ]
    baseline = json.loads(Path(args.baseline).read_text())
    byte_rows = [
        r
        for r in baseline["runs"]
        if Path(r["workdir"]).name == args.baseline_run and r["separator"] == d.separator
    ]
    result = dict(
        machine=machine,
        wall_time_sec=time.perf_counter() - start,
        bpe_run=dict(
            workdir=os.path.abspath(args.workdir),
            step=run.step,
            tokenizer=d.tokenizer,
            vocab_size=cfg.model.vocab_size,
            mixer=cfg.model.mixer,
            param_count=summary.get("param_count"),
            corpus=summary.get("corpus"),
            own_validation=curve,
            train_time_sec=summary.get("train_time_sec"),
            tokens_per_sec=summary.get("tokens_per_sec"),
        ),
        byte_windows=dict(
            windows=len(windows),
            labelled_tokens=count,
            labelled_bytes=covered,
            bits_per_byte=bits_per_byte(loss_sum, count, covered),
        ),
        byte_baseline=dict(source=args.baseline, runs=byte_rows),
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    own = summary["eval/bits_per_byte"]
    print(f"BPE run at step {run.step}: own validation {own:.4f} bits per byte")
    print(
        f"on the byte run's {len(windows)} validation windows: "
        f"{result['byte_windows']['bits_per_byte']:.4f} bits per byte ({covered} bytes)"
    )
    for r in byte_rows:
        print(f"byte baseline ({r['workdir']}): {r['windows/bits_per_byte']:.4f} (windows)")
    print(f"written to {args.output}")
    return 0 if math.isfinite(result["byte_windows"]["bits_per_byte"]) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Sizes of the paper-size LM presets and the memory rematerialisation saves, from dry runs.

    python experiments/lm_sizing.py --out docs/results/lm_sizing_cpu.json      # ~30 min here
    python experiments/lm_sizing.py --out /tmp/s.json --presets smoke --micro_batch 2  # smoke

For each preset of ``configs/lm.py`` asked for, and each ``--remat`` value: the dry run of
`linear_attention.training.sizing` (the train step compiled on abstract shapes, nothing
allocated), with the preset's batch (0.5M tokens for the paper sizes) run as micro-batches of
``--micro_batch`` rows (``grad_accum_steps`` = batch / micro_batch) on one device: parameters,
FLOPs per token, and the compiled step's bytes per device. Then the ``default`` preset as it
is (batch 64 × 1024, no accumulation) with remat none and block: the memory block remat saves.

Figures are XLA's for this machine's CPU backend (another backend schedules differently), with
the load average recorded. Each row also splits the FLOPs per token into the matmuls and the
sequence mixing (`training.flops`). Writes the JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from linear_attention.benchmarks import machine_info
from linear_attention.training.cli import load_config_file
from linear_attention.training.config import experiment_config
from linear_attention.training.flops import flops_per_token
from linear_attention.training.sizing import abstract_model, dry_run

ROOT = Path(__file__).resolve().parents[1]

PAPER = (
    "transformer_340m", "gla_340m", "gated_deltanet_400m", "kda_400m",
    "transformer_1.3b", "gla_1.3b", "gated_deltanet_1.3b", "kda_1.3b",
)  # fmt: skip


def size(preset: str, remat: str, micro_batch: int | None) -> dict:
    config = load_config_file(f"{ROOT / 'configs' / 'lm.py'}:{preset}")
    # this machine's backend, one device holding everything (a preset's TPU slice and FSDP are
    # sized by `la-train --dry_run` for that slice)
    config.mesh.target, config.mesh.fsdp = "", False
    config.model.remat = remat
    if micro_batch:
        config.train.grad_accum_steps = max(config.train.batch_size // micro_batch, 1)
    start = time.perf_counter()
    out = dry_run(config)
    cfg = experiment_config(config)
    flops = flops_per_token(abstract_model(cfg), cfg.data.seq_len)
    return dict(
        preset=preset,
        remat=remat,
        batch_size=config.train.batch_size,
        grad_accum_steps=config.train.get("grad_accum_steps", 1),
        seq_len=config.data.seq_len,
        seconds=time.perf_counter() - start,
        load_avg_end=os.getloadavg(),
        **out,
        flops_matmul=flops["matmul"],
        flops_mixing=flops["total"] - flops["matmul"],
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--presets", nargs="*", default=list(PAPER))
    parser.add_argument("--remat", nargs="+", default=["none", "block"])
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--default_preset", default="default", help="'' to skip it")
    args = parser.parse_args(argv)
    result = {"machine": machine_info(), "micro_batch": args.micro_batch, "presets": []}
    for preset in args.presets:
        for remat in args.remat:
            result["presets"].append(size(preset, remat, args.micro_batch))
            print(json.dumps(result["presets"][-1]), flush=True)
    if args.default_preset:
        runs = {r: size(args.default_preset, r, None) for r in ("none", "block")}
        for run in runs.values():
            print(json.dumps(run), flush=True)
        none, block = (runs[r]["train_step_bytes_per_device"] for r in ("none", "block"))
        result["default_remat"] = dict(runs=list(runs.values()), block_over_none=block / none)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


def table(result) -> str:
    rows = [
        "| preset | parameters | train FLOPs / token | micro-batch | remat | "
        "train-step memory / device |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["presets"]:
        micro = r["batch_size"] // r["grad_accum_steps"]
        rows.append(
            f"| {r['preset']} | {r['parameters'] / 1e6:.1f}M | {r['flops_per_token'] / 1e9:.2f}G "
            f"| {micro} × {r['seq_len']} | {r['remat']} | "
            f"{r['train_step_bytes_per_device'] / 2**30:.2f} GiB |"
        )
    if "default_remat" in result:
        rows.append(
            f"\ndefault preset, block / none: {result['default_remat']['block_over_none']:.3f}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()

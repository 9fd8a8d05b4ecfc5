"""The ``la-eval`` command line; its usage, three ways:

    la-eval --workdir W [--config.SECTION.FIELD=VALUE ...] [--step N] [--output FILE]
    la-eval --workdir W --tasks T1,T2 [--include_path DIR] [--num_fewshot N] [--limit N]
            [--batch_tokens N] [--log_samples] [--step N] --output FILE [--overwrite]
    la-eval --workdir W --position_buckets N [--block_len L] [--data PATH] [--num_blocks K]
            [--batch_tokens N] [--step N] --output FILE [--plot FILE] [--overwrite]
    la-eval --workdir W --needles T1,T2 --lengths N1,N2 [--depths D1,D2] [--samples S]
            [--answer_len A] [--seed S] [--data PATH] [--step N] --output FILE [--overwrite]
    la-eval --workdir W --needles configs/needles.py:PRESET [--lengths ...] --output FILE

Without ``--tasks`` or ``--position_buckets`` it evaluates the run on its own evaluation data
(`training.eval_cli`). ``--tasks`` runs lm-evaluation-harness's ``simple_evaluate`` through
`harness.LMEvalModel` and writes its result dict as JSON (with the samples under
``--log_samples``); tasks read local files only (`tasks`). ``--position_buckets`` writes the
mean loss per bucket of positions over long blocks (`positions`) as JSON and a plot.
``--needles`` scores RULER-style needle tasks (`needles`) over context lengths × depths and
writes the cells as JSON, a table per task and a heat map per task (``<output>_<task>.png``).
Bad input
stops with ``la-eval: error: ...`` (exit status 2) before the checkpoint is loaded; the output
is written whole or not at all.
"""

from __future__ import annotations

from linear_attention.training import cuda_plugin

cuda_plugin.hide()  # before jax is imported: without a GPU, no CUDA plugin's driver messages

import argparse
import json
import os
import sys

from linear_attention.evals.runs import load_text_run, text_run_config
from linear_attention.evals.tasks import check_tasks, go_offline, task_manager
from linear_attention.training.cli_args import (
    UsageError,
    error,
    load_config_file,
    plain,
    show_spelling_warnings,
)
from linear_attention.training.outputs import check_output

USAGE = __doc__.split("\n\n")[1]
MODES = ("tasks", "position_buckets", "needles")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="la-eval", usage=USAGE, add_help=False)
    add = parser.add_argument
    add("--workdir", required=True)
    add("--step", type=int)
    add("--output", required=True)
    add("--overwrite", action="store_true")
    add("--batch_tokens", type=int, default=4096)
    add("--tasks")
    add("--include_path")
    add("--num_fewshot", type=int)
    add("--limit", type=int)
    add("--log_samples", action="store_true")
    add("--position_buckets", type=int)
    add("--block_len", type=int)
    add("--data")
    add("--num_blocks", type=int, default=16)
    add("--plot")
    add("--needles")
    add("--lengths")
    add("--depths")
    add("--samples", type=int)
    add("--answer_len", type=int)
    add("--seed", type=int, default=0)
    return parser


def _positive(name: str, value, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"--{name} must be >= {minimum}, got {value}")


def _parse(argv: list[str]) -> argparse.Namespace:
    """The arguments, checked (UsageError) before anything is loaded."""
    parser = _parser()
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(f"{message}\n{USAGE}"))
    args = parser.parse_args(argv)
    modes = [m for m in MODES if getattr(args, m) is not None]
    if len(modes) != 1:
        raise UsageError("give one of --tasks, --position_buckets or --needles")
    own = {"tasks": ("include_path", "num_fewshot", "limit", "log_samples"),
           "position_buckets": ("block_len", "plot", "num_blocks"),
           "needles": ("lengths", "depths", "samples", "answer_len", "seed")}  # fmt: skip
    (mode,) = modes
    if args.data is not None and mode == "tasks":
        raise UsageError("--data goes with --position_buckets or --needles")
    for other, names in own.items():
        for name in names if other != mode else ():
            if getattr(args, name) not in (None, False, parser.get_default(name)):
                raise UsageError(f"--{name} goes with --{other}")
    if mode == "needles":
        _needle_grid(args)
    for name in ("batch_tokens", "limit", "position_buckets", "block_len", "num_blocks",
                 "samples", "answer_len"):  # fmt: skip
        _positive(name, getattr(args, name))
    _positive("num_fewshot", args.num_fewshot, 0)
    check_output(args.output, overwrite=args.overwrite, workdir=args.workdir)
    stem = os.path.splitext(args.output)[0]
    if mode == "position_buckets":
        args.plot = args.plot or stem + ".png"
        check_output(args.plot, flag="--plot", overwrite=args.overwrite, workdir=args.workdir)
    if mode == "needles":
        args.maps = {t: f"{stem}_{t}.png" for t in args.needles}
        for path in args.maps.values():
            check_output(path, flag="a heat map", overwrite=args.overwrite, workdir=args.workdir)
    return args


def _numbers(flag: str, text: str, kind):
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(
            f"--{flag} must be a comma-separated list of numbers, got {text!r}"
        ) from None
    if not values:
        raise UsageError(f"--{flag} needs at least one value")
    return values


def _needle_grid(args) -> None:
    """--needles (task names, or a preset ``configs/needles.py:NAME`` whose fields the other
    flags replace), --lengths and --depths as lists (UsageError for a bad one)."""
    preset = dict(depths="0,0.25,0.5,0.75,1", samples=4, answer_len=64)
    if ".py" in args.needles:
        preset = dict(load_config_file(args.needles))
        args.needles = preset["needles"]
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.needles = [t.strip() for t in args.needles.split(",") if t.strip()]
    if not args.needles:
        raise UsageError("--needles needs at least one task name")
    if args.lengths is None:
        raise UsageError("--needles needs --lengths N1,N2,... (context lengths in tokens)")
    args.lengths = _numbers("lengths", args.lengths, int)
    args.depths = _numbers("depths", args.depths, float)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-eval`` (see the module docstring); returns the exit status."""
    if argv is None:  # (the program itself, not a caller that manages warnings)
        show_spelling_warnings()
    argv = list(sys.argv if argv is None else argv)
    helping = any(a in ("-h", "--help", "-help") for a in argv[1:])
    if not any(a.startswith("--") and a[2:].split("=")[0] in MODES for a in argv[1:]):
        from linear_attention.training.eval_cli import eval_main

        if helping:  # the three ways first, then the first way's fields
            print(plain(__doc__))
        return eval_main(argv)
    if helping:
        print(plain(__doc__))
        return 0
    go_offline()
    try:
        args = _parse(argv[1:])
        config = text_run_config(args.workdir)
        if args.tasks is not None:
            return _run_tasks(args)
        if args.needles is not None:
            return _run_needles(args, config)
        return _run_positions(args, config)
    except (UsageError, ValueError) as e:
        return error("la-eval", e)
    except OSError as e:
        return error("la-eval", f"{e.filename}: {e.strerror or e}")


def _write(path: str, record: dict) -> None:
    from linear_attention.data.files import write_atomic

    write_atomic(path, json.dumps(record, indent=2, default=_plain) + "\n")


def _plain(value):
    """JSON for what lm-eval's result dict holds besides plain values (NumPy numbers, the
    task configs' functions)."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return str(value)


def _run_tasks(args) -> int:
    try:
        import lm_eval
    except ImportError:
        raise UsageError("--tasks needs lm-evaluation-harness: pip install -e '.[eval]'") from None
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise UsageError(f"--include_path {args.include_path!r} is not a folder")
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        raise UsageError("--tasks needs at least one task name")
    manager = task_manager(args.include_path)
    check_tasks(names, manager)
    from linear_attention.evals.harness import LMEvalModel

    model = LMEvalModel(run=load_text_run(args.workdir, step=args.step),
                        batch_tokens=args.batch_tokens)  # fmt: skip
    result = lm_eval.simple_evaluate(
        model=model,
        tasks=names,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        log_samples=args.log_samples,
        task_manager=manager,
    )
    record = {
        "la_eval": {
            "workdir": os.path.abspath(args.workdir),
            "step": model.run.step,
            "batch_tokens": args.batch_tokens,
            "max_length": model.max_length,
            "prefix_token_id": model.prefix_token_id,
        },
        **{k: v for k, v in result.items() if k != "samples" or args.log_samples},
    }
    _write(args.output, record)
    print(lm_eval.utils.make_table(result))
    print(f"written to {args.output}")
    return 0


def _documents(args, config, max_bytes: int) -> tuple[str, list[str]]:
    """``(what was read, its documents)``: ``--data``, or the run's own text."""
    from linear_attention.data.corpus import read_documents

    data = args.data
    if data is None:
        if not hasattr(config.data, "text_field"):
            raise UsageError("the run reads token files, not text: give --data PATH")
        data = config.data.path
    text_field = getattr(config.data, "text_field", "text")
    documents, _ = read_documents(data or None, text_field=text_field, max_bytes=max_bytes)
    return data or "the built-in corpus", documents


def _run_needles(args, config) -> int:
    from linear_attention.data.needles import corpus_sentences
    from linear_attention.evals.needle_study import check_grid, heat_map, needle_study, table

    check_grid(args.needles, args.lengths, args.depths, args.answer_len, config.model.max_length)
    data, documents = _documents(args, config, 1 << 22)
    run = load_text_run(args.workdir, step=args.step)
    cells = needle_study(run, args.needles, args.lengths, args.depths, samples=args.samples,
                         sentences=corpus_sentences(documents), seed=args.seed,
                         answer_len=args.answer_len)  # fmt: skip
    tables = {t: table(cells, t) for t in args.needles}
    for task, path in args.maps.items():
        heat_map(path, cells, task)
    record = {"workdir": os.path.abspath(args.workdir), "step": run.step, "data": data,
              "samples": args.samples, "seed": args.seed, "answer_len": args.answer_len,
              "trained_seq_len": config.data.seq_len, "tables": tables, "cells": cells}  # fmt: skip
    _write(args.output, record)
    print("\n\n".join(tables.values()))
    print(f"written to {args.output} and {', '.join(args.maps.values())}")
    return 0


def _run_positions(args, config) -> int:
    from linear_attention.evals.positions import (
        bucket_means,
        document_blocks,
        plot_buckets,
        position_losses,
    )

    limit = config.model.max_length
    block_len = args.block_len or limit
    if block_len > limit:
        raise UsageError(f"--block_len {block_len} exceeds the model's max_length {limit}")
    if args.position_buckets > block_len:
        raise UsageError(f"--position_buckets {args.position_buckets} > block length {block_len}")
    cap = 64 * args.num_blocks * (block_len + 1)  # bytes read: enough, but not a whole corpus
    data, documents = _documents(args, config, cap)
    run = load_text_run(args.workdir, step=args.step)
    blocks = document_blocks(documents, run.tokenizer, block_len, args.num_blocks)
    losses = position_losses(run.model, blocks, max(1, args.batch_tokens // block_len))
    buckets = bucket_means(losses, args.position_buckets)
    record = {
        "workdir": os.path.abspath(args.workdir),
        "step": run.step,
        "data": data,
        "block_len": block_len,
        "num_blocks": len(blocks),
        "position_buckets": args.position_buckets,
        "trained_seq_len": config.data.seq_len,
        "buckets": buckets,
        "loss_by_position": losses.tolist(),
    }
    plot = args.plot
    title = f"{os.path.basename(os.path.abspath(args.workdir))} step {run.step}"
    plot_buckets(plot, buckets, trained_len=config.data.seq_len, title=title)
    _write(args.output, record)
    for b in buckets:
        print(f"positions [{b['start']}, {b['stop']}): loss {b['loss']:.4f}")
    print(f"written to {args.output} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

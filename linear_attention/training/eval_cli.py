"""The ``la-eval`` command line.

    la-eval --workdir runs/x [--config.data.seq_len=256 ...] [--step N] [--output FILE]

It starts from the run's own ``config.json``, whose fields can all be overridden with
``--config.<section>.<field>=value``; a bad value stops with ``la-eval: error: ...`` (exit
status 2) before anything is evaluated.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys

from absl import flags

from linear_attention.training import config as config_lib
from linear_attention.training.cli_args import (
    UsageError,
    check_backend,
    error,
    parse_overrides,
    pop_workdir,
    sections_help,
    show_spelling_warnings,
    usage_help,
    validate,
    workdir_config,
    workdir_flags,
)
from linear_attention.training.load import evaluate_run, run_config
from linear_attention.training.metrics import write_json
from linear_attention.training.outputs import check_output
from linear_attention.training.platforms import quiet_platforms

EVAL_USAGE = (
    "usage: la-eval --workdir DIR [--config.SECTION.FIELD=VALUE ...] [--step N] [--output FILE]"
    " [--overwrite]"
)


def _override_values(argv: list[str]) -> dict[str, str]:
    return {
        a.split("=", 1)[0].lstrip("-"): a.split("=", 1)[1] if "=" in a else "True"
        for a in argv
        if re.match(r"^--?config\.", a)
    }


def eval_main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-eval``: evaluate a run's checkpoint on its evaluation data (or on
    data given by ``--config.data.*`` overrides); prints the metrics and writes them, with the
    overrides, to ``--output`` (default ``<workdir>/eval_step<N>[_<overrides digest>].json``,
    rewritten by the same evaluation). ``--output`` is checked before anything is evaluated:
    it must not exist (``--overwrite`` replaces it) and is never one of a run's own files
    (``config.json``, ``summary.json``, ``metrics.jsonl``, checkpoints). An override that
    changes what the checkpoint means (a ``config.model`` field, ``config.data.tokenizer``) is
    said on the first line and recorded under ``changed`` in the output."""
    quiet_platforms()
    if argv is None:  # (the program itself, not a caller that manages warnings)
        show_spelling_warnings()
    argv = list(sys.argv if argv is None else argv)
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        print(usage_help(EVAL_USAGE, f"{eval_main.__doc__}\n\n{sections_help()}"))
        return 0

    def extra(fv):
        workdir_flags(fv)
        flags.DEFINE_string("output", None, "JSON file for the metrics", flag_values=fv)
        flags.DEFINE_bool("overwrite", False, "replace an existing --output file", flag_values=fv)

    try:
        workdir = pop_workdir(argv)
        fv = parse_overrides(argv, workdir_config(workdir, EVAL_USAGE), extra)
        overrides = _override_values(argv)
        if fv.output is not None:
            check_output(fv.output, overwrite=fv.overwrite, workdir=workdir)
        changed = meaning_changes(validate(run_config(workdir)), validate(fv.config))
        check_backend(fv.config)
        if changed:
            shown = "; ".join(
                f"{k} = {v['now']!r} (the run has {v['run']!r})" for k, v in changed.items()
            )
            print(
                f"la-eval: warning: the checkpoint evaluated as another model or tokenizer: {shown}"
            )
        tokenizer = []
        metrics = evaluate_run(workdir, config=fv.config, step=fv.step, message=tokenizer.append)
    except (UsageError, ValueError) as e:
        return error("la-eval", e)
    if tokenizer:
        print(f"la-eval: warning: changed since the checkpoint was saved: {'; '.join(tokenizer)}")
        changed = {**changed, "data": tokenizer}
    step = metrics.pop("step")
    record = {"step": step, "workdir": os.path.abspath(workdir), "overrides": overrides, **metrics}
    if changed:
        record["changed"] = changed
    output = fv.output
    if output is None:
        digest = hashlib.sha1(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
        output = os.path.join(workdir, f"eval_step{step}{'_' + digest if overrides else ''}.json")
    try:
        write_json(output, record)
    except OSError as e:
        return error("la-eval", f"--output {output!r} not written ({e.strerror or e})")
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
    print(f"step {step}: {shown}\nwritten to {output}")
    return 0


# Model fields that compute the same function (to rounding) or only bound the lengths.
_SAME_MEANING = ("dtype", "param_dtype", "remat", "max_length", "redraw_interval")


def meaning_changes(run: config_lib.ExperimentConfig, now: config_lib.ExperimentConfig) -> dict:
    """``{"config.<path>": {"run": old, "now": new}}`` for each field where ``now`` reads the
    run's checkpoint as another model (a ``model`` field but those of `_SAME_MEANING`) or its
    ids as another tokenizer's (``data.tokenizer``)."""
    out = {}
    old_model, new_model = _fields(run.to_dict()["model"]), _fields(now.to_dict()["model"])
    for name in sorted((set(old_model) | set(new_model)) - set(_SAME_MEANING)):
        if old_model.get(name) != new_model.get(name):
            out[f"config.model.{name}"] = {"run": old_model.get(name), "now": new_model.get(name)}
    old_tok = getattr(run.data, "tokenizer", None)
    new_tok = getattr(now.data, "tokenizer", None)
    if old_tok != new_tok:
        out["config.data.tokenizer"] = {"run": old_tok, "now": new_tok}
    return out


def _fields(model: dict) -> dict:
    """A model section with each mixer option a field of its own (``options.chunk_size``)."""
    options = model.pop("options", {})
    return {**model, **{f"options.{k}": v for k, v in options.items()}}


if __name__ == "__main__":
    sys.exit(eval_main())

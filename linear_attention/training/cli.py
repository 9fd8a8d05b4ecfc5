"""Command lines: ``la-train``, ``la-eval`` and ``la-generate``.

    la-train --config configs/mqar.py:cpu --workdir runs/x [--config.a.b=v ...] [--dry_run [--fit]]
             [--allow_data_change]
    la-eval --workdir runs/x [--config.data.seq_len=256 ...] [--step N] [--output FILE]
    la-generate --workdir runs/x --prompt "def " --num_tokens 200 [--temperature 0.8 --top_k 40]

``--config`` is an ml_collections config file (``path[:preset]``) whose fields can all be
overridden with ``--config.<section>.<field>=value``; ``la-eval`` starts from the run's own
``config.json`` instead. A missing file, an unknown field or a bad value stops with
``<command>: error: ...`` (exit status 2) before anything is built or compiled.

``--dry_run`` sizes the run without running it; with ``--config.mesh.target=tpu:GEN:TOPOLOGY``
(a TPU slice: libtpu) or ``gpu:CHIP:COUNT`` (NVIDIA GPUs: the ``gpu-compile`` extra) it
compiles the train step for that target and exits 1 when it does not fit a device.

A resumed run whose corpus, token file or tokenizer changed since its checkpoint stops with
``la-train: error:`` naming the change; ``--allow_data_change`` goes on with the new data (said).
"""

from __future__ import annotations

from linear_attention.training import cuda_plugin
from linear_attention.training.signals import honour_interrupts, keep_ignored_interrupts

# Before the imports below (JAX: seconds), so that la-train honours Ctrl-C from its start, and
# (without a GPU) jax starts without the CUDA plugin's driver messages.
keep_ignored_interrupts()
cuda_plugin.hide()

import json
import os
import re
import sys
import textwrap

from absl import flags

from linear_attention.layers import COMMON_OPTIONS, MIXERS, MixerConfig
from linear_attention.training.cli_args import (
    UsageError,
    check_backend,
    error,
    load_config_file,
    load_module,
    parse_overrides,
    sections_help,
    show_spelling_warnings,
    usage_help,
    validate,
)
from linear_attention.training.config import experiment_config
from linear_attention.training.eval_cli import eval_main
from linear_attention.training.generate_cli import generate_main
from linear_attention.training.gpu_target import GpuTarget
from linear_attention.training.platforms import quiet_platforms
from linear_attention.training.quit_signals import exit_on_signal
from linear_attention.training.sizing import FIT_ORDER, verdict
from linear_attention.training.sizing import dry_run as dry_run_sizing
from linear_attention.training.target_base import TargetCompileError
from linear_attention.training.targets import parse_target
from linear_attention.training.trainer import Interrupted, NonFiniteLossError, train
from linear_attention.training.workdir import RunError

# la-eval and la-generate live in `eval_cli` and `generate_cli`; their entry points stay
# importable from here because console scripts installed before the split name this module.
__all__ = [
    "USAGE",
    "UsageError",
    "eval_main",
    "generate_main",
    "load_config_file",
    "main",
    "parse_args",
]

USAGE = (
    "usage: la-train --config CONFIG_FILE[:PRESET] --workdir DIR [--config.SECTION.FIELD=VALUE ...]"
    " [--dry_run [--fit]] [--allow_data_change]"
)


def _pop_config_spec(argv: list[str]) -> tuple[list[str], str | None]:
    """Remove ``--config=SPEC`` / ``--config SPEC`` from ``argv``; returns (rest, SPEC)."""
    rest, spec, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config", "-config"):
            if i + 1 >= len(argv):
                raise UsageError("--config needs a value: CONFIG_FILE[:PRESET]")
            spec, i = argv[i + 1], i + 2
            continue
        if re.match(r"^--?config=", a):
            spec = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return rest, spec


def parse_args(argv: list[str]):
    """``(config, workdir)`` for ``la-train`` from ``argv`` (``argv[0]`` is the program name);
    the config is the ConfigDict with overrides applied, already validated. Raises
    `UsageError`."""
    config, workdir, _ = _parse_train(argv)
    return config, workdir


def _parse_train(argv: list[str]):
    argv, spec = _pop_config_spec(argv)
    if spec is None:
        raise UsageError(f"--config is required\n{USAGE}")
    config = load_config_file(spec)

    def extra(fv):
        flags.DEFINE_string(
            "workdir", None, "run folder (created; resumed if it exists)", flag_values=fv
        )
        flags.DEFINE_bool(
            "dry_run",
            False,
            "print the resolved config, then one JSON line {parameters, flops_per_token, "
            "train_step_bytes_per_device} (the train step compiled on abstract shapes), and exit; "
            "with --config.mesh.target=tpu:GEN:TOPOLOGY or gpu:CHIP:COUNT compiled for that "
            "TPU slice or those GPUs, adding target, hbm_bytes_per_device, fits and the memory "
            "parts (exit 1: it does not fit)",
            flag_values=fv,
        )
        flags.DEFINE_bool(
            "fit",
            False,
            "with --dry_run and a target: search the first setting that fits and print it as "
            "overrides. " + FIT_ORDER.replace("\n", " "),
            flag_values=fv,
        )

    fv = parse_overrides(argv, config, extra)
    config = fv.config
    if not fv.workdir and not fv.dry_run:
        raise UsageError(f"--workdir is required\n{USAGE}")
    if fv.fit and not fv.dry_run:
        raise UsageError(f"--fit searches with --dry_run; add it\n{USAGE}")
    validate(config)
    if not fv.dry_run:
        check_backend(config)
    return config, fv.workdir, (fv.dry_run and ("fit" if fv.fit else "size"))


def _mixers_help() -> str:
    """Each mixer's options with its defaults (`layers.options`): the common ones as
    --config.model.FIELD, each mixer's own as --config.model.options.FIELD."""
    lines = textwrap.wrap(
        "mixers (--config.model.mixer=NAME or NAME,NAME,... per layer) and their options "
        "(--config.model.options.OPTION=VALUE: every layer whose mixer takes it; one mixer's "
        "layers: --config.model.layer_options=\"{'NAME': {'OPTION': VALUE}}\"):",
        100,
    )
    base = MixerConfig.defaults()
    common = ", ".join(f"{name}={base[name]}" for name in COMMON_OPTIONS if name != "rope")
    lines += textwrap.wrap(
        f"every mixer: {common} (rope: model.position='rope'; None: the mixer's default)",
        100,
        initial_indent="  ",
        subsequent_indent="      ",
    )
    for name, cls in MIXERS.items():
        defaults = cls.Config.defaults()
        own = [f"{o}={defaults[o]}" for o in cls.Config.own_options()]
        changed = [f"{o}={defaults[o]}" for o in COMMON_OPTIONS if defaults[o] != base[o]]
        text = ", ".join(own + changed) or "no options of its own"
        lines += textwrap.wrap(text, 100, initial_indent=f"  {name}: ", subsequent_indent=" " * 6)
    return "\n".join(lines)


def _presets_help() -> str:
    """Presets of the config files in ``configs/`` of the current directory (or the checkout)."""
    here = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "configs")
    folder = next((d for d in ("configs", here) if os.path.isdir(d)), None)
    if folder is None:
        return "presets: see the PRESETS of your config file"
    lines = ["config files and presets (--config FILE:PRESET):"]
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.endswith(".py") or name.startswith("_"):
            continue
        try:
            module = load_module(path)
        except Exception:  # a broken file is the user's to find with --config
            continue
        presets = getattr(module, "PRESETS", None)
        # the docstring's first paragraph, whole (a first line alone can stop mid-sentence)
        doc = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
        shown = os.path.relpath(path) if folder == "configs" else os.path.normpath(path)
        names = f"{shown}: {', '.join(presets) if presets else '(no presets)'}"
        lines += textwrap.wrap(names, 100, initial_indent="  ", subsequent_indent=" " * 6)
        lines += textwrap.wrap(doc, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-train`` and ``experiments/train.py``; returns the exit status."""
    quiet_platforms()
    if argv is None:  # (the program itself, not a caller that manages warnings)
        show_spelling_warnings()
    argv = list(sys.argv if argv is None else argv)
    try:
        honour_interrupts()  # (a Ctrl-C while la-train loaded)
    except KeyboardInterrupt:
        print("la-train: interrupted before it started")
        return 130
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        fit = (
            "--dry_run with --config.mesh.target=tpu:GEN:TOPOLOGY (or gpu:CHIP:COUNT) --fit:\n"
            f"{FIT_ORDER}"
        )
        text = f"{__doc__}\n{fit}\n\n{_presets_help()}\n\n{sections_help()}\n\n{_mixers_help()}"
        print(usage_help(USAGE, text))
        return 0
    allow_data_change = "--allow_data_change" in argv
    argv = [a for a in argv if a != "--allow_data_change"]
    try:
        config, workdir, dry_run = _parse_train(argv)
    except UsageError as e:
        return error("la-train", e)
    if dry_run:  # the resolved config, then the sizing as one JSON line (the last)
        return _dry_run(config, fit=dry_run == "fit")

    try:
        summary = train(config, workdir, allow_data_change=allow_data_change)
    except RunError as e:  # a busy or damaged workdir, a config that no longer fits it, ...
        return error("la-train", e)
    except OSError as e:  # a full disk: config.json, metrics.jsonl, summary.json
        return error("la-train", f"cannot write {e.filename or workdir}: {e.strerror or e}")
    except NonFiniteLossError as e:
        print(f"la-train: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"la-train: {e}; rerun the same command to resume in {workdir}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"la-train: interrupted; rerun the same command to resume in {workdir}")
        return 130
    finals = {k: v for k, v in summary.items() if k.startswith("eval/")}
    print("final: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(finals.items())))
    return 0


def _dry_run(config, *, fit: bool) -> int:
    """Print the resolved config and the sizing's JSON line; exit 1 (one ``la-train:`` line on
    stderr) where the step does not fit its target or its compiler refuses it. SIGTERM or
    SIGINT ends it with one line (`quit_signals`)."""
    with exit_on_signal("la-train") as reinstall:
        return _sizing(config, fit, reinstall)


def _sizing(config, fit: bool, reinstall) -> int:
    try:
        target = parse_target(experiment_config(config).mesh.target)
    except ValueError as e:
        return error("la-train", e)
    if isinstance(target, GpuTarget) and cuda_plugin.hidden():
        cuda_plugin.restart()  # XLA:GPU needs the plugin this process kept out
    print(json.dumps(experiment_config(config).to_dict(), indent=2, sort_keys=True))
    log = lambda line: print(f"la-train: {line}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        if target is not None:  # libtpu or the CUDA plugin loads here (cached for the sizing)
            target.devices()  # with its signal handlers,
            reinstall()  # which this module's replace again
        sizing = dry_run_sizing(config, fit=fit, log=log)
    except ValueError as e:
        return error("la-train", e)
    except TargetCompileError as e:
        print(f"la-train: {e}", file=sys.stderr)
        return 1
    if fit and sizing["fits"]:
        overrides = " ".join(sizing["fit"]["overrides"]) or "(none: it fits as given)"
        print(f"fits {sizing['target']['name']} with: {overrides}")
    print(json.dumps(sizing, sort_keys=True))
    line = verdict(sizing)
    if line:
        print(f"la-train: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

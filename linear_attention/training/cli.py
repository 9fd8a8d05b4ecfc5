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
it compiles the train step for that TPU slice (libtpu) and exits 1 when it does not fit a chip.

A resumed run whose corpus, token file or tokenizer changed since its checkpoint stops with
``la-train: error:`` naming the change; ``--allow_data_change`` goes on with the new data (said).
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import hashlib
import importlib.util
import itertools
import json
import os
import re
import sys
import textwrap

import jax
import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_dict, config_flags

from linear_attention.data.tokenizers import BYTES, load_tokenizer
from linear_attention.layers import COMMON_OPTIONS, MIXERS, MixerConfig
from linear_attention.models import generate_stream
from linear_attention.training import config as config_lib
from linear_attention.training.config import SECTION_CLASSES, SECTIONS, experiment_config
from linear_attention.training.load import evaluate_run, load_run, run_config
from linear_attention.training.metrics import write_json
from linear_attention.training.outputs import check_output
from linear_attention.training.sizing import FIT_ORDER, verdict
from linear_attention.training.sizing import dry_run as dry_run_sizing
from linear_attention.training.tpu_target import TargetCompileError
from linear_attention.training.trainer import Interrupted, NonFiniteLossError, train
from linear_attention.training.workdir import RunError

USAGE = (
    "usage: la-train --config CONFIG_FILE[:PRESET] --workdir DIR [--config.SECTION.FIELD=VALUE ...]"
    " [--dry_run [--fit]] [--allow_data_change]"
)
EVAL_USAGE = (
    "usage: la-eval --workdir DIR [--config.SECTION.FIELD=VALUE ...] [--step N] [--output FILE]"
    " [--overwrite]"
)
GENERATE_USAGE = (
    "usage: la-generate --workdir DIR --prompt TEXT --num_tokens N [--temperature T] [--top_k K]"
    " [--seed S] [--step N]"
)


class UsageError(ValueError):
    """A bad command line or configuration."""


# ------------------------------------------------------------------------ config files
def _split_spec(spec: str) -> tuple[str, str | None]:
    """``"path[:preset]"`` -> ``(path, preset or None)``."""
    path, sep, preset = spec.rpartition(":")
    if not sep or "/" in preset or preset.endswith(".py"):
        return spec, None
    return path, preset or None


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``get_config(preset)`` of the config file ``path[:preset]`` (loaded with
    ``importlib.util.spec_from_file_location``); a missing file or a failing ``get_config``
    raises `UsageError`."""
    path, preset = _split_spec(spec)
    if not os.path.isfile(path):
        raise UsageError(f"--config: no config file {path!r}")
    module = _load_module(path)
    if not hasattr(module, "get_config"):
        raise UsageError(f"--config: {path} has no get_config(arg) function")
    try:
        config = module.get_config(preset)
    except Exception as e:  # the file's own message (e.g. an unknown preset) is the useful part
        raise UsageError(f"--config {spec}: {e}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UsageError(f"--config: {path}: get_config returned {type(config).__name__}")
    return config


def _load_module(path: str):
    name = "la_config_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _none_type(section: str, field: str):
    """The scalar type of a field whose value is None (from the section's dataclass)."""
    for cls in SECTION_CLASSES.get(section, ()):
        if field in {f.name for f in dataclasses.fields(cls)}:
            return config_lib.field_type(cls, field)
    return str


def config_from_json(values: dict) -> ml_collections.ConfigDict:
    """A run's ``config.json`` as a ConfigDict whose every field can be overridden: None fields
    become typed placeholders, a list of mixers the string ``"a,b"``, a list of integers (JSON
    has no tuples; ``data.eval_lengths``) a tuple again, so that ``--config.data.eval_lengths=
    (4,8)`` parses as it does for ``la-train``."""
    config = ml_collections.ConfigDict()
    for key, value in values.items():
        if not isinstance(value, dict):
            config[key] = value
            continue
        section = ml_collections.ConfigDict()
        for field, v in value.items():
            if v is None:
                v = config_dict.placeholder(_none_type(key, field))
            elif isinstance(v, list) and v and all(type(x) is int for x in v):
                v = tuple(v)
            elif isinstance(v, list):
                v = ",".join(map(str, v))
            section[field] = v
        config[key] = section
    return config


# ------------------------------------------------------------------------ argv parsing
def _override_paths(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0].lstrip("-") for a in argv if re.match(r"^--?(no)?config\.", a)]


def _unknown_field(e: Exception, argv: list[str], config) -> UsageError:
    """A clean message for a misspelled override: the full dotted path and a suggestion."""
    inner = e.args[0] if e.args and isinstance(e.args[0], Exception) else e
    first = str(inner.args[0] if inner.args else inner).splitlines()[0]
    name = first.strip("\"' ")
    paths = _override_paths(argv)
    culprit = next((p for p in paths if name in p.split(".")[1:]), f"config.{name}")
    parts = culprit.split(".")
    index = parts.index(name, 1) if name in parts[1:] else len(parts) - 1
    parent = config
    for part in parts[1:index]:
        parent = parent.get(part) if hasattr(parent, "get") else None
    known = list(parent.keys()) if isinstance(parent, ml_collections.ConfigDict) else []
    message = f"unknown config field --{culprit}"
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        suggestion = ".".join([*parts[:index], close[0], *parts[index + 1 :]])
        message += f"; did you mean --{suggestion}?"
    elif known:
        where = ".".join(parts[:index])
        message += f"; {where} has: {', '.join(sorted(known))}"
    return UsageError(message)


def _parse(argv: list[str], config, define_extra) -> flags.FlagValues:
    """Parse ``argv`` with ``--config.*`` overrides of ``config``; returns the FlagValues
    (``fv.config`` is the overridden ConfigDict). Raises `UsageError`."""
    fv = flags.FlagValues()
    define_extra(fv)
    try:
        config_flags.DEFINE_config_dict("config", config, "config", flag_values=fv, sys_argv=argv)
        fv(argv)
    except (AttributeError, KeyError) as e:
        raise _unknown_field(e, argv, config) from None
    except config_flags.config_flags.UnsupportedOperationError as e:
        raise UsageError(str(e).split(". ")[0]) from None
    except flags.Error as e:
        raise UsageError(str(e).splitlines()[-1]) from None
    return fv


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


def _validate(config):
    try:
        return experiment_config(config)
    except ValueError as e:
        raise UsageError(str(e)) from None


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
            "with --config.mesh.target=tpu:GEN:TOPOLOGY compiled for that TPU slice, adding "
            "target, hbm_bytes_per_device, fits and the memory parts (exit 1: it does not fit)",
            flag_values=fv,
        )
        flags.DEFINE_bool(
            "fit",
            False,
            "with --dry_run and a target: search the first setting that fits and print it as "
            "overrides. " + FIT_ORDER.replace("\n", " "),
            flag_values=fv,
        )

    fv = _parse(argv, config, extra)
    config = fv.config
    if not fv.workdir and not fv.dry_run:
        raise UsageError(f"--workdir is required\n{USAGE}")
    if fv.fit and not fv.dry_run:
        raise UsageError(f"--fit searches with --dry_run; add it\n{USAGE}")
    _validate(config)
    return config, fv.workdir, (fv.dry_run and ("fit" if fv.fit else "size"))


def _sections_help() -> str:
    lines = ["config sections and fields (override any with --config.SECTION.FIELD=VALUE):"]
    lines.append("  seed")
    for section in SECTIONS[1:]:
        names = dict.fromkeys(
            f.name for cls in SECTION_CLASSES[section] for f in dataclasses.fields(cls)
        )
        lines += textwrap.wrap(
            ", ".join(names), 100, initial_indent=f"  {section}: ", subsequent_indent=" " * 6
        )
    return "\n".join(lines)


def _mixers_help() -> str:
    """Each mixer's options with its defaults (`layers.options`), as --config.model.FIELD."""
    lines = ["mixers (--config.model.mixer=NAME or NAME,NAME,... per layer) and their options:"]
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
            module = _load_module(path)
        except Exception:  # a broken file is the user's to find with --config
            continue
        presets = getattr(module, "PRESETS", None)
        doc = (module.__doc__ or "").strip().splitlines()
        shown = os.path.relpath(path) if folder == "configs" else os.path.normpath(path)
        lines.append(f"  {shown}: {', '.join(presets) if presets else '(no presets)'}")
        if doc:
            lines.append(f"      {doc[0]}")
    return "\n".join(lines)


def _help(usage: str, text: str) -> str:
    return f"{usage}\n\n{text.strip()}\n"


def _error(prog: str, message) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-train`` and ``experiments/train.py``; returns the exit status."""
    argv = list(sys.argv if argv is None else argv)
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        fit = f"--dry_run with --config.mesh.target=tpu:GEN:TOPOLOGY --fit: {FIT_ORDER}"
        text = f"{__doc__}\n{fit}\n\n{_presets_help()}\n\n{_sections_help()}\n\n{_mixers_help()}"
        print(_help(USAGE, text))
        return 0
    allow_data_change = "--allow_data_change" in argv
    argv = [a for a in argv if a != "--allow_data_change"]
    try:
        config, workdir, dry_run = _parse_train(argv)
    except UsageError as e:
        return _error("la-train", e)
    if dry_run:  # the resolved config, then the sizing as one JSON line (the last)
        return _dry_run(config, fit=dry_run == "fit")

    try:
        summary = train(config, workdir, allow_data_change=allow_data_change)
    except RunError as e:  # a busy or damaged workdir, a config that no longer fits it, ...
        return _error("la-train", e)
    except OSError as e:  # a full disk: config.json, metrics.jsonl, summary.json
        return _error("la-train", f"cannot write {e.filename or workdir}: {e.strerror or e}")
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
    stderr) where the step does not fit its target or XLA:TPU refuses it."""
    print(json.dumps(experiment_config(config).to_dict(), indent=2, sort_keys=True))
    log = lambda line: print(f"la-train: {line}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        sizing = dry_run_sizing(config, fit=fit, log=log)
    except ValueError as e:
        return _error("la-train", e)
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


def _run_config(workdir: str | None, usage: str) -> ml_collections.ConfigDict:
    if not workdir:
        raise UsageError(f"--workdir is required\n{usage}")
    try:
        return config_from_json(run_config(workdir))
    except (ValueError, OSError) as e:
        raise UsageError(e) from None


def _pop_workdir(argv: list[str]) -> str | None:
    """The value of ``--workdir`` (needed before parsing: the overrides apply to its config)."""
    for i, a in enumerate(argv):
        if re.match(r"^--?workdir=", a):
            return a.split("=", 1)[1]
        if a in ("--workdir", "-workdir") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _workdir_flag(fv) -> None:
    flags.DEFINE_string("workdir", None, "the run's folder (written by la-train)", flag_values=fv)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=fv)


def eval_main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-eval``: evaluate a run's checkpoint on its evaluation data (or on
    data given by ``--config.data.*`` overrides); prints the metrics and writes them, with the
    overrides, to ``--output`` (default ``<workdir>/eval_step<N>[_<overrides digest>].json``,
    rewritten by the same evaluation). ``--output`` is checked before anything is evaluated:
    it must not exist (``--overwrite`` replaces it) and is never one of a run's own files
    (``config.json``, ``summary.json``, ``metrics.jsonl``, checkpoints). An override that
    changes what the checkpoint means (a ``config.model`` field, ``config.data.tokenizer``) is
    said on the first line and recorded under ``changed`` in the output."""
    argv = list(sys.argv if argv is None else argv)
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        print(_help(EVAL_USAGE, f"{eval_main.__doc__}\n\n{_sections_help()}"))
        return 0

    def extra(fv):
        _workdir_flag(fv)
        flags.DEFINE_string("output", None, "JSON file for the metrics", flag_values=fv)
        flags.DEFINE_bool("overwrite", False, "replace an existing --output file", flag_values=fv)

    try:
        workdir = _pop_workdir(argv)
        fv = _parse(argv, _run_config(workdir, EVAL_USAGE), extra)
        overrides = _override_values(argv)
        if fv.output is not None:
            check_output(fv.output, overwrite=fv.overwrite, workdir=workdir)
        changed = meaning_changes(_validate(run_config(workdir)), _validate(fv.config))
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
        return _error("la-eval", e)
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
        return _error("la-eval", f"--output {output!r} not written ({e.strerror or e})")
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
    old_model, new_model = run.to_dict()["model"], now.to_dict()["model"]
    for name in sorted((set(old_model) | set(new_model)) - set(_SAME_MEANING)):
        if old_model.get(name) != new_model.get(name):
            out[f"config.model.{name}"] = {"run": old_model.get(name), "now": new_model.get(name)}
    old_tok = getattr(run.data, "tokenizer", None)
    new_tok = getattr(now.data, "tokenizer", None)
    if old_tok != new_tok:
        out["config.data.tokenizer"] = {"run": old_tok, "now": new_tok}
    return out


def _check_utf8(flag: str, text: str) -> None:
    """UsageError unless ``text`` (an argument, decoded by Python with surrogate escapes) is
    UTF-8: a tokenizer reads text only."""
    raw = os.fsencode(text)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{flag} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})"
        ) from None


def _override_values(argv: list[str]) -> dict[str, str]:
    return {
        a.split("=", 1)[0].lstrip("-"): a.split("=", 1)[1] if "=" in a else "True"
        for a in argv
        if re.match(r"^--?config\.", a)
    }


def generate_main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-generate``: sample from a text run's checkpoint, printing the prompt
    (encoded with the run's tokenizer) and then the text of each token as it is drawn. Token i
    is drawn from ``fold_in(key(seed), i)`` with ``softmax(logits / temperature)`` over the
    ``top_k`` largest logits (0: all); ``--temperature 0`` is greedy."""
    argv = list(sys.argv if argv is None else argv)
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        print(_help(GENERATE_USAGE, generate_main.__doc__))
        return 0

    def extra(fv):
        _workdir_flag(fv)
        flags.DEFINE_string("prompt", None, "text to continue", flag_values=fv)
        flags.DEFINE_integer("num_tokens", None, "tokens to generate", flag_values=fv)
        flags.DEFINE_float("temperature", 1.0, "sampling temperature (0: greedy)", flag_values=fv)
        flags.DEFINE_integer(
            "top_k", 0, "sample among the k largest logits (0: all)", flag_values=fv
        )
        flags.DEFINE_integer("seed", 0, "random seed of the sample", flag_values=fv)

    try:
        workdir = _pop_workdir(argv)
        fv = _parse(argv, _run_config(workdir, GENERATE_USAGE), extra)
        cfg = _validate(fv.config)
        if not cfg.data.has_text:
            raise UsageError(
                f"la-generate samples text; {workdir} is a {cfg.data.kind!r} run without a "
                "tokenizer (config.data.kind must be 'text', or 'tokens' with "
                "config.data.tokenizer)"
            )
        if not fv.prompt:
            raise UsageError(f"--prompt is required (a non-empty text)\n{GENERATE_USAGE}")
        _check_utf8("--prompt", fv.prompt)
        if fv.num_tokens is None:
            raise UsageError(f"--num_tokens is required\n{GENERATE_USAGE}")
        if fv.top_k < 0:
            raise UsageError(f"--top_k must be >= 0 (0: all), got {fv.top_k}")
        if fv.seed < 0:
            raise UsageError(f"--seed must be >= 0, got {fv.seed}")
        model, _ = load_run(workdir, config=fv.config, step=fv.step)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        prompt = tokenizer.encode(fv.prompt).astype(np.int32)[None]
        tokens = generate_stream(
            model,
            prompt,
            fv.num_tokens,
            rng=jax.random.key(fv.seed),
            temperature=fv.temperature,
            top_k=fv.top_k or None,
        )
        first = next(tokens)  # arguments are checked when the first token is asked for
    except (UsageError, ValueError) as e:
        return _error("la-generate", e)
    sys.stdout.write(fv.prompt)
    if tokenizer.name == BYTES:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for token in itertools.chain([first], tokens):
            sys.stdout.write(decoder.decode(bytes([int(token[0])])))
            sys.stdout.flush()
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
        return 0
    # Other tokenizers: decode everything drawn so far and print what is new, holding back a
    # trailing replacement character (a token that ends inside a UTF-8 character).
    drawn, shown = [], ""
    for token in itertools.chain([first], tokens):
        drawn.append(int(token[0]))
        text = tokenizer.decode(drawn).rstrip("\ufffd")
        if text.startswith(shown):
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    text = tokenizer.decode(drawn)
    sys.stdout.write((text[len(shown) :] if text.startswith(shown) else "") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

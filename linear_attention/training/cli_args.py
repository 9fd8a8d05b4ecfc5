"""What the command lines share: config files (``path[:preset]``), a run's ``config.json`` as
an overridable ConfigDict, ``--config.*`` parsing with clean messages for misspelled fields,
``--workdir`` / ``--step`` of the programs that read a finished run, and the ``<prog>: error:``
line with exit status 2 (`UsageError`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
import textwrap
import warnings

import jax
import ml_collections
from absl import flags
from ml_collections import config_dict, config_flags

from linear_attention.fields import closest
from linear_attention.kernels.primitives.pallas import pallas_target
from linear_attention.models import legacy
from linear_attention.models.options import option_classes
from linear_attention.training import config as config_lib
from linear_attention.training.config import (
    SECTION_CLASSES,
    SECTIONS,
    experiment_config,
    options_section,
)
from linear_attention.training.load import run_config


class UsageError(ValueError):
    """A bad command line or configuration."""


# ------------------------------------------------------------------------ config files
def split_spec(spec: str) -> tuple[str, str | None]:
    """``"path[:preset]"`` -> ``(path, preset or None)``."""
    path, sep, preset = spec.rpartition(":")
    if not sep or "/" in preset or preset.endswith(".py"):
        return spec, None
    return path, preset or None


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``get_config(preset)`` of the config file ``path[:preset]`` (loaded with
    ``importlib.util.spec_from_file_location``), or a run's ``config.json`` as it is (to train
    from a converted checkpoint: ``--config W/config.json --config.train.init_from=W``); a
    missing file or a failing ``get_config`` raises `UsageError`."""
    path, preset = split_spec(spec)
    if not os.path.isfile(path):
        raise UsageError(f"--config: no config file {path!r}")
    if path.endswith(".json") and preset is None:  # a run's config.json (e.g. la-convert's)
        try:
            with open(path) as f:
                return config_from_json(json.load(f))
        except (OSError, ValueError) as e:
            raise UsageError(f"--config {path}: not a run's config.json ({e})") from None
    module = load_module(path)
    if not hasattr(module, "get_config"):
        raise UsageError(f"--config: {path} has no get_config(arg) function")
    try:
        config = module.get_config(preset)
    except Exception as e:  # the file's own message (e.g. an unknown preset) is the useful part
        raise UsageError(f"--config {spec}: {e}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UsageError(f"--config: {path}: get_config returned {type(config).__name__}")
    return config


def load_module(path: str):
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
    (4,8)`` parses as it does for ``la-train``. The model's `options` are `options_section`'s
    (every mixer option overridable), an old run's flat mixer options moved into them."""
    config = ml_collections.ConfigDict()
    for key, value in values.items():
        if not isinstance(value, dict):
            config[key] = value
            continue
        if key == "model":
            value = {"options": {}, **legacy.move_options(value, "config.model", strict=True)}
        section = ml_collections.ConfigDict()
        for field, v in value.items():
            if key == "model" and field == "options":
                v = options_section(v)
            elif v is None:
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
    close = closest(name, known)
    if close:
        suggestion = ".".join([*parts[:index], close, *parts[index + 1 :]])
        message += f"; did you mean --{suggestion}?"
    elif known:
        where = ".".join(parts[:index])
        message += f"; {where} has: {', '.join(sorted(known))}"
    return UsageError(message)


def _respelled(argv: list[str]) -> list[str]:
    """``argv`` with the old flat mixer options (``--config.model.state_dim=16``) in the new
    spelling (``--config.model.options.state_dim=16``), warned (`models.legacy`)."""
    out = []
    for arg in argv:
        match = re.match(r"^(--?(?:no)?config\.)(model\.\w+)(=.*)?$", arg)
        if match and legacy.new_path(match[2]):
            arg = match[1] + legacy.respelled(match[2], stacklevel=3) + (match[3] or "")
        out.append(arg)
    return out


def show_spelling_warnings() -> None:
    """Show the command line's old-spelling `DeprecationWarning`s (Python hides them outside
    ``__main__``): the programs' entry points call this."""
    warnings.filterwarnings("default", f".*{legacy.SPELLING}", DeprecationWarning)


def parse_overrides(argv: list[str], config, define_extra) -> flags.FlagValues:
    """Parse ``argv`` with ``--config.*`` overrides of ``config`` (old flat mixer options
    respelled, warned); returns the FlagValues (``fv.config`` is the overridden ConfigDict).
    Raises `UsageError`."""
    argv = _respelled(argv)
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


def validate(config):
    try:
        return experiment_config(config)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_backend(config) -> None:
    """`UsageError` when the config's kernels cannot run on this machine: ``method="pallas"``
    (for every layer, or for one layer type through ``layer_options``) lowers Pallas kernels,
    which run on the backends the family's descriptor names (a TPU; a GPU for causal linear
    attention) (a dry run with a TPU target compiles them from any
    machine, so it does not call this). Whether a layer runs them is `ModelConfig.uses_pallas`,
    the train step's own test; the fields that set such a method name the cause."""
    model = validate(config).model
    layers = model.backend_layers
    if not layers:
        return
    own = config.model.get("layer_options") or {}
    own = [f"config.model.layer_options.{m}.method" for m in layers if "method" in own.get(m, {})]
    fields = own if len(own) == len(layers) else ["config.model.options.method", *own]
    first = model.mixer_config(next(iter(layers)))
    method, default = first.method, repr(first.FAMILY.supported[0])
    if fields == ["config.model.options.method"]:
        instead = f"pass --config.model.options.method={default[1:-1]}"
    else:
        instead = f"set it to {default}" if len(fields) == 1 else f"set them to {default}"
    kinds = {b for backends in layers.values() for b in backends}
    needs = " or ".join(k for k in ("TPU", "GPU") if k.lower() in kinds)
    try:
        pallas_target(fields[0])  # a TPU, a GPU (Mosaic GPU kernels) or a context manager
    except ValueError:
        raise UsageError(
            f"{' and '.join(fields)} = {method!r} runs the Pallas kernels, which need a "
            f"{needs}, and this machine's backend is {jax.default_backend()!r}: run it there, or "
            f"{instead} (the same recurrence in XLA); --dry_run with "
            "--config.mesh.target=tpu:GEN:TOPOLOGY compiles it for a TPU slice from here"
        ) from None


def sections_help() -> str:
    lines = ["config sections and fields (override any with --config.SECTION.FIELD=VALUE):"]
    lines.append("  seed")
    for section in SECTIONS[1:]:
        names = dict.fromkeys(
            f.name for cls in SECTION_CLASSES[section] for f in dataclasses.fields(cls)
        )
        lines += textwrap.wrap(
            ", ".join(names), 100, initial_indent=f"  {section}: ", subsequent_indent=" " * 6
        )
        if section == "model":  # (the mixers' own options: below, by mixer)
            lines += textwrap.wrap(
                ", ".join(option_classes()),
                100,
                initial_indent="  model.options: ",
                subsequent_indent=" " * 6,
            )
    return "\n".join(lines)


def plain(text: str) -> str:
    """Docstring text for a terminal: without the reST/Markdown code quotes (``x``, `x`)."""
    return re.sub(r"`([^`\n]+)`", r"\1", re.sub(r"``([^`\n]+)``", r"\1", text))


def usage_help(usage: str, text: str) -> str:
    return plain(f"{usage}\n\n{text.strip()}\n")


def error(prog: str, message) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def workdir_config(workdir: str | None, usage: str) -> ml_collections.ConfigDict:
    if not workdir:
        raise UsageError(f"--workdir is required\n{usage}")
    try:
        return config_from_json(run_config(workdir))
    except (ValueError, OSError) as e:
        raise UsageError(e) from None


def pop_workdir(argv: list[str]) -> str | None:
    """The value of ``--workdir`` (needed before parsing: the overrides apply to its config)."""
    for i, a in enumerate(argv):
        if re.match(r"^--?workdir=", a):
            return a.split("=", 1)[1]
        if a in ("--workdir", "-workdir") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def workdir_flags(fv) -> None:
    flags.DEFINE_string("workdir", None, "the run's folder (written by la-train)", flag_values=fv)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=fv)

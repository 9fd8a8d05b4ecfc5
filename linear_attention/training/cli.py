"""Command line: ``la-train --config configs/mqar.py:cpu --workdir runs/x [--config.a.b=v ...]``.

``--config`` is an ml_collections config file (``path[:preset]``) whose fields can all be
overridden with ``--config.<section>.<field>=value``. A missing file, an unknown field or a bad
value stops with a message naming it (exit status 2) before anything is built or compiled.
"""

from __future__ import annotations

import re
import sys

from absl import flags
from ml_collections import config_flags

from linear_attention.training.config import experiment_config
from linear_attention.training.trainer import NonFiniteLossError, train

USAGE = (
    "usage: la-train --config CONFIG_FILE[:PRESET] --workdir DIR [--config.SECTION.FIELD=VALUE ...]"
)


class UsageError(ValueError):
    """A bad command line or configuration."""


def _override_paths(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0].lstrip("-") for a in argv if re.match(r"^--?(no)?config\.", a)]


def parse_args(argv: list[str]):
    """``(config, workdir)`` from ``argv`` (``argv[0]`` is the program name); the config is
    the ConfigDict with overrides applied, already validated. Raises `UsageError`."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "config file, path[:preset]", flag_values=fv, sys_argv=argv
    )
    flags.DEFINE_string(
        "workdir", None, "run folder (created; resumed if it exists)", flag_values=fv
    )
    try:
        fv(argv)
    except flags.Error as e:
        # A config file whose get_config raised: keep only the last line (the error itself).
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise UsageError(lines[-1] if "Traceback" in str(e) else str(e)) from None
    except (AttributeError, KeyError) as e:
        name = str(e).strip("\"'")
        culprits = [p for p in _override_paths(argv) if name in p.split(".")] or [name]
        raise UsageError(f"unknown config field: --{culprits[0]}") from None
    try:
        config = fv.config
        if config is not None:
            config.to_dict  # noqa: B018 (an unloadable file gives an object raising on use)
    except OSError as e:  # the file could not be loaded; the message names the path
        raise UsageError(" ".join(str(e).split())) from None
    if config is None:
        raise UsageError(f"--config is required\n{USAGE}")
    if not fv.workdir:
        raise UsageError(f"--workdir is required\n{USAGE}")
    try:
        experiment_config(config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return config, fv.workdir


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``la-train`` and ``experiments/train.py``; returns the exit status."""
    argv = list(sys.argv if argv is None else argv)
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    try:
        config, workdir = parse_args(argv)
    except UsageError as e:
        print(f"la-train: error: {e}", file=sys.stderr)
        return 2

    try:
        summary = train(config, workdir)
    except NonFiniteLossError as e:
        print(f"la-train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"la-train: interrupted; rerun the same command to resume in {workdir}")
        return 130
    finals = {k: v for k, v in summary.items() if k.startswith("eval/")}
    print("final: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(finals.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

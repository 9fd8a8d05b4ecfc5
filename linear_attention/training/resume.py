"""What a resumed run must share with the run it continues: the seed, model and data config
(``config.json``, or the checkpoint's record when it is gone), and a finished run's summary."""

from __future__ import annotations

import json
import os

from linear_attention.training.config import ExperimentConfig, config_difference
from linear_attention.training.metrics import Reporter
from linear_attention.training.workdir import RunError, check_run_config

# Sections of config.json that a resumed run must share with the run it continues.
FIXED_SECTIONS = ("seed", "model", "data")


class ResumeConfigError(RunError):
    """The workdir holds a run whose seed/model/data differ from the config given."""


def check_resume_config(path: str, current: dict, cfg: ExperimentConfig) -> bool:
    """RunError if the run saved at ``path`` (its ``config.json``) has another seed, model or
    data config than ``current``; False when there is no ``config.json``."""
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            previous = json.load(f)
    except (OSError, ValueError) as e:
        raise RunError(
            f"{path} is damaged ({e}); it records the run this workdir holds: restore it, or "
            "use another workdir"
        ) from None
    check_run_config(path, previous)
    compare_fixed(previous, current, cfg, os.path.dirname(path))
    return True


def compare_fixed(previous: dict, current: dict, cfg: ExperimentConfig, workdir: str) -> None:
    # (a field added to the code since the run was saved, at its default, is no difference)
    fixed = {section: previous.get(section) for section in FIXED_SECTIONS}
    diff = config_difference(fixed, {section: current[section] for section in FIXED_SECTIONS}, cfg)
    if diff:
        name, old, new = diff
        raise ResumeConfigError(
            f"{workdir} holds a run with config.{name} = {old!r}, but this config "
            f"has {new!r}; resume with the same {'/'.join(FIXED_SECTIONS)} or use another workdir"
        )


def read_summary(path: str, reporter: Reporter) -> dict | None:
    """A finished run's summary, or None if there is none or it is damaged (then it is
    rewritten by a final evaluation)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            summary = json.load(f)
        if isinstance(summary, dict):
            return summary
    except (OSError, ValueError):
        pass
    reporter.message(f"{path} is damaged: evaluating the final checkpoint again to rewrite it")
    return None

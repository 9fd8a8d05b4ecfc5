"""A run's model: built from its seed (`build_model`), reloaded (`load_run(workdir) -> (model,
config)`, `evaluate_run` behind ``la-eval``) or started from another run's parameters
(`initialize_from`, ``config.train.init_from``).

A workdir written by `train` holds ``config.json`` and ``checkpoints/<step>``. Loading rebuilds
the model (and optimizer) from the config, restores the checkpoint into it, and returns the
model with the validated `ExperimentConfig`. A config may be given instead of the run's own, e.g.
with other data fields for evaluation; its model must have the checkpoint's parameter shapes.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax
import optax
from flax import nnx

from linear_attention.models import LanguageModel
from linear_attention.training.checkpoint import (
    META_NAME,
    Checkpoints,
    latest_saved_step,
    saved_steps,
)
from linear_attention.training.config import ExperimentConfig, experiment_config
from linear_attention.training.evaluation import evaluate
from linear_attention.training.mesh import check_batch_size, make_mesh, state_shardings
from linear_attention.training.optim import make_optimizer
from linear_attention.training.run_data import build_data, data_changes, data_record
from linear_attention.training.workdir import RunError, check_run_config


class RestoredRun(NamedTuple):
    """The training state of a checkpoint: ``nnx.merge(graphdef, state)`` is (model, optimizer)."""

    graphdef: nnx.GraphDef
    state: nnx.State
    config: ExperimentConfig
    step: int
    mesh: jax.sharding.Mesh


def build_model(config: ExperimentConfig, tx: optax.GradientTransformation):
    """``(model, optimizer)``: the model from ``config.seed``, AdamW over its `nnx.Param`s."""
    model = LanguageModel(config.model, rngs=nnx.Rngs(config.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def run_config(workdir: str) -> dict:
    """The run's ``config.json`` as a dict; ValueError if the folder holds no run."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"workdir {workdir!r} holds no run (no config.json)")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is damaged ({e}): not a run's config") from None
    check_run_config(path, config)
    return config


def restore_run(workdir: str, *, config=None, step: int | None = None) -> RestoredRun:
    """Restore checkpoint ``step`` (default: the latest) of the run in ``workdir``, built from
    ``config`` (a ConfigDict, dict or `ExperimentConfig`; default: the run's ``config.json``)."""
    cfg = experiment_config(run_config(workdir) if config is None else config)
    folder = os.path.join(workdir, "checkpoints")
    steps = saved_steps(workdir)
    if step is None:
        step = latest_saved_step(workdir)
    elif step not in steps:
        raise ValueError(f"step must be one of the saved checkpoints {steps}, got {step!r}")
    mesh = make_mesh(cfg.mesh.num_devices, cfg.mesh.seq, model=cfg.mesh.model)
    check_batch_size("train.eval_batch_size", cfg.train.eval_batch, mesh)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build_model(cfg, tx)))
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract,
        state_shardings(abstract, mesh, cfg.mesh.fsdp),
    )
    checkpoints = Checkpoints(folder, keep=cfg.train.keep_checkpoints)
    try:
        problem = checkpoints.verify(step)
        if problem is not None:
            raise ValueError(f"checkpoint step {step} of {workdir!r} is damaged: {problem}")
        state = checkpoints.restore(step, target)  # RunError (a ValueError) if it does not fit
    finally:
        checkpoints.close()
    return RestoredRun(graphdef, state, cfg, step, mesh)


def run_header(workdir: str, run: RestoredRun) -> dict:
    """What ``run`` (restored from ``workdir``) is, for the head of an analysis's output: the
    folder, the checkpoint's step, the task, the model's mixer and shape, learning rate and seed."""
    config = run.config
    model = config.model
    return dict(
        workdir=workdir,
        step=run.step,
        task=getattr(config.data, "task", None),
        model=dict(
            mixer=model.mixer,
            num_layers=model.num_layers,
            num_heads=model.num_heads,
            num_householder=model.options.get("num_householder"),
            allow_neg_eigval=model.options.get("allow_neg_eigval"),
        ),
        learning_rate=config.optimizer.learning_rate,
        seed=config.seed,
    )


def load_run(
    workdir: str, *, config=None, step: int | None = None
) -> tuple[LanguageModel, ExperimentConfig]:
    """``(model, config)`` of the run in ``workdir``: the `LanguageModel` with the parameters of
    checkpoint ``step`` (default: the latest) and the run's validated config (or ``config``)."""
    run = restore_run(workdir, config=config, step=step)
    model, _ = nnx.merge(run.graphdef, run.state)
    return model, run.config


def initialize_from(model, workdir: str) -> None:
    """Set ``model``'s parameters to those of the latest checkpoint of the run in ``workdir``
    (`config.train.init_from`); RunError naming the first parameter whose shape differs."""
    try:
        source, _ = load_run(workdir)
    except ValueError as e:
        raise RunError(f"config.train.init_from: {e}") from None
    want = nnx.state(model, nnx.Param)
    got = nnx.state(source, nnx.Param)
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(want))
    got_leaves = dict(jax.tree_util.tree_leaves_with_path(got))
    for path, leaf in want_leaves.items():
        other = got_leaves.get(path)
        if other is None or other.shape != leaf.shape:
            found = "absent" if other is None else f"of shape {other.shape}"
            raise RunError(
                f"config.train.init_from: parameter {jax.tree_util.keystr(path)} is {found} in "
                f"{workdir}, this model's is {leaf.shape}: config.model must match that run's"
            )
    for path in got_leaves.keys() - want_leaves.keys():
        raise RunError(
            f"config.train.init_from: {workdir} has parameter {jax.tree_util.keystr(path)}, "
            "which this model lacks: config.model must match that run's"
        )
    nnx.update(model, jax.tree.map(lambda a, b: b.astype(a.dtype), want, got))


def evaluate_run(workdir: str, *, config=None, step: int | None = None, message=None) -> dict:
    """Evaluate checkpoint ``step`` (default: the latest) on the evaluation data of ``config``
    (default: the run's own; another ``config.data.path`` is read with the run's tokenizer, and
    its validation split evaluated): the metrics of ``summary.json`` (``eval/loss``,
    ``eval/accuracy``, ``eval/bits_per_byte`` for text), computed as training computes them,
    with ``step``. A tokenizer whose file or vocabulary differs from the one the checkpoint
    recorded (`run_data.data_record`) is said through ``message``, one line per change."""
    run = restore_run(workdir, config=config, step=step)
    data = build_data(run.config, cache_dir=os.path.join(workdir, "token_cache"))
    if message is not None:
        for change in tokenizer_changes(workdir, run.step, data.provenance):
            message(change)
    metrics = evaluate(run.state, data, run.config, run.graphdef, run.mesh)
    return {"step": run.step, **metrics}


def tokenizer_changes(workdir: str, step: int, provenance: dict | None) -> list[str]:
    """How the tokenizer of ``provenance`` differs from the one checkpoint ``step`` of
    ``workdir`` was trained with (its ``meta.json`` record; nothing when it has none)."""
    try:
        with open(os.path.join(workdir, "checkpoints", str(step), META_NAME)) as f:
            saved = json.load(f).get("data")
    except (OSError, ValueError, AttributeError):
        return []
    now = data_record(provenance)
    if not isinstance(saved, dict) or now is None:
        return []
    keys = ("tokenizer", "tokenizer_sha256", "vocab_size")
    return data_changes({k: saved[k] for k in keys if k in saved}, now)

"""Shared helpers of the training tests: configs of the checkout, a tiny MQAR run, the newest
checkpoint's state of a finished run, a model's jitted forward pass and a float64 NumPy
cross-entropy."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from linear_attention.data import IGNORE_INDEX
from linear_attention.training import experiment_config, make_optimizer, trainer
from linear_attention.training.checkpoint import Checkpoints
from tests.scripts import load_module

ROOT = Path(__file__).resolve().parents[2]

# A model's logits as one compiled program, for the references that read them (eagerly, every
# operation of the forward pass compiles alone).
full_pass = nnx.jit(lambda model, *args: model(*args))


def load_config(name: str, arg: str | None = None):
    """``get_config(arg)`` of ``configs/<name>.py``."""
    return load_module(f"configs/{name}.py", f"configs_{name}").get_config(arg)


def tiny_mqar():
    """The smoke preset with a favor + softmax hybrid whose features are redrawn every 2 steps,
    so the loop's redraw and both kinds of mixer are exercised."""
    config = load_config("mqar", "smoke")
    config.model.mixer = "favor,softmax"
    config.model.options.feature_dim = 8
    config.model.redraw_interval = 2
    return config


def tiny_mqar_with(**changes):
    """`tiny_mqar()` with ``{"section.field": value}`` changes, at any depth
    (``model.options.method``)."""
    config = tiny_mqar()
    for key, value in changes.items():
        *path, field = key.split(".")
        node = config
        for part in path:
            node = getattr(node, part)
        setattr(node, field, value)
    return config


def final_state(workdir, config):
    """``(graphdef, state)`` of the newest checkpoint in ``workdir`` of a run of ``config``
    (restored onto the abstract model and optimizer that ``config`` builds)."""
    cfg = experiment_config(config)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    model, opt = nnx.eval_shape(lambda: trainer.build_model(cfg, tx))
    graphdef, abstract = nnx.split((model, opt))
    ckpt = Checkpoints(os.path.join(workdir, "checkpoints"), keep=3)
    try:
        state = ckpt.restore(ckpt.latest_step(), abstract)
    finally:
        ckpt.close()
    return graphdef, state


def np_stats(logits, labels):
    """float64 mean cross-entropy (nats) and accuracy over labelled positions."""
    logits = np.asarray(logits, np.float64)
    mask = labels != IGNORE_INDEX
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, np.where(mask, labels, 0)[..., None], -1)[..., 0]
    ce = (logz - picked)[mask]
    acc = (logits.argmax(-1) == labels)[mask]
    return ce.mean(), acc.mean()


@pytest.fixture
def tiny_config():
    return tiny_mqar()


# One mixer of each family, as one hybrid model: a single compile for a target covers them all.
FAMILIES = "linear,gated,gated_deltanet,rwkv7,gated_deltaproduct,softmax,swa"
# The diagonal recurrences' mixers (Mamba-1's selective scan, Griffin's RG-LRU): compiled for
# each target under -m slow (their own dry runs: they take no chunk_size).
RECURRENT_FAMILIES = "mamba,rglru"
# The cases of the targets' family tests: every family on packed text (segment ids through every
# kernel); MQAR with two families by default and every family under -m slow.
FAMILY_CASES = [
    ("lm.py:smoke", FAMILIES),
    ("mqar.py:smoke", "gated,softmax"),
    pytest.param("mqar.py:smoke", FAMILIES, marks=pytest.mark.slow),
]


def dry_run_cli(capsys, *argv) -> tuple[int, dict | None, str]:
    """la-train --dry_run: (exit status, the last stdout line as JSON or None, stderr)."""
    from linear_attention.training import cli

    status = cli.main(["la-train", *argv, "--dry_run"])
    out, err = capsys.readouterr()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return status, (json.loads(last) if last.startswith("{") else None), err


def families_dry_run(capsys, preset: str, mixers: str, target: str, chunk: int = 16) -> dict:
    """The dry run of ``configs/<preset>`` with one layer per mixer of ``mixers`` (chunks of
    ``chunk``) compiled for ``target``: its sizing, after checking that it exits 0 and leaves the
    default backend as it was (a target compiles, it runs nothing)."""
    import jax

    backend = jax.default_backend()
    status, sizing, err = dry_run_cli(
        capsys,
        f"--config=configs/{preset}",
        f"--config.mesh.target={target}",
        f"--config.model.options.chunk_size={chunk}",
        f"--config.model.mixer={mixers}",
        f"--config.model.num_layers={len(mixers.split(','))}",
    )
    assert status == 0, err
    assert jax.default_backend() == backend
    return sizing

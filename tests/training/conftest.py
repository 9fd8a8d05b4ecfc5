"""Shared helpers of the training tests: configs of the checkout, a tiny MQAR run, the newest
checkpoint's state of a finished run, a model's jitted forward pass and a float64 NumPy
cross-entropy."""

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
    config.model.feature_dim = 8
    config.model.redraw_interval = 2
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

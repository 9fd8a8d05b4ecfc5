"""Shared by the evaluation tests: the qwen3_5 transformers fixture imported with
``la-convert`` (a run workdir with its character-level tokenizer.json, max_length 64), and a
float64 NumPy reference of a model's log-probabilities from its plain forward pass."""

import os

import numpy as np
import pytest
from flax import nnx

from linear_attention.training import convert
from tests.scripts import ROOT

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_5")
TASK_DIR = os.path.join(ROOT, "tests", "evals", "tasks")
MAX_LENGTH = 64  # the fixture's max_position_embeddings

_forward = nnx.jit(lambda model, tokens: model(tokens))


@pytest.fixture(scope="package")
def converted(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("evals") / "run")
    convert.from_hf(FIXTURE, workdir)
    return workdir


def reference_logp(model, tokens) -> np.ndarray:
    """``float64[n, V]`` log-softmax of the model's unpacked forward pass on ``tokens`` (one
    sequence, n <= 64), right-padded to 64 so that one program serves every length (position
    t reads tokens <= t only)."""
    n = len(tokens)
    padded = np.zeros((1, MAX_LENGTH), np.int32)
    padded[0, :n] = tokens
    logits = np.asarray(_forward(model, padded), np.float64)[0, :n]
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))

"""experiments/pack_eval.py: a run evaluated with and without its documents' boundaries."""

from __future__ import annotations

import json
import math

import numpy as np
from flax import nnx

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.tokenizers import train_bpe
from linear_attention.training import experiment_config, trainer
from tests.scripts import load_module
from tests.training.conftest import final_state, load_config, np_stats


def test_packed_and_windows_figures(tmp_path):
    """A BPE run (so bits per byte differ from the loss in bits per token): the packed figure
    is the run's own evaluation, the windows figure a NumPy cross-entropy summed over the
    labelled tokens and divided by the bytes they decode to."""
    pe = load_module("experiments/pack_eval.py", "pack_eval")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(1)
    texts = [rng.integers(97, 123, rng.integers(20, 60)).tobytes() for _ in range(40)]
    for i, text in enumerate(texts):
        (corpus / f"{i:02d}.txt").write_bytes(text)
    tokenizer = str(tmp_path / "tok.json")
    tok = train_bpe([t.decode() for t in texts], vocab_size=300, output=tokenizer)
    config = load_config("lm", "smoke")
    config.data.path, config.data.max_bytes = str(corpus), 0
    config.data.tokenizer, config.model.vocab_size = tokenizer, tok.vocab_size
    config.data.val_fraction, config.data.num_val_windows = 0.25, 6
    config.train.sample_tokens, config.train.num_steps = 0, 2
    workdir = str(tmp_path / "run")
    summary = trainer.train(config, workdir)
    assert pe.main([workdir, "--output", str(tmp_path / "out.json")]) == 0
    (row,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert row["trained_packed"] and row["step"] == 2 and row["boundaries"] > 0
    assert row["tokenizer"] == tokenizer
    # the packed figure is the run's own evaluation
    assert math.isclose(row["packed/bits_per_byte"], summary["eval/bits_per_byte"], rel_tol=1e-5)
    # the windows figure: the same model and labels, no segment ids (NumPy cross-entropy),
    # over the bytes the labelled tokens decode to
    data = trainer.build_data(experiment_config(config))
    graphdef, state = final_state(workdir, config)
    model, _ = nnx.merge(graphdef, state)
    labels = data.val_labels[data.val_labels != IGNORE_INDEX]
    covered = sum(len(tok.decode([t]).encode()) for t in labels.tolist())
    assert row["labelled_tokens"] == labels.size and row["labelled_bytes"] == covered
    assert covered > 1.2 * labels.size  # merges: per byte is not per token here
    nats = np_stats(model(data.val_inputs), data.val_labels)[0] * labels.size
    assert math.isclose(row["windows/bits_per_byte"], nats / covered / math.log(2), rel_tol=1e-4)
    assert abs(row["windows/bits_per_byte"] - row["packed/bits_per_byte"]) > 1e-5
    # other documents: one ends after every "a"
    files, by_a = pe.evaluate_run(workdir, ["", "a"])
    assert files["packed/bits_per_byte"] == row["packed/bits_per_byte"]
    assert by_a["separator"] == "a" and by_a["boundaries"] > row["boundaries"]

"""experiments/pack_eval.py: a run evaluated with and without its documents' boundaries."""

from __future__ import annotations

import json
import math

import numpy as np
from flax import nnx

from linear_attention.training import experiment_config, trainer
from tests.scripts import load_module
from tests.training.conftest import final_state, load_config, np_stats


def test_packed_and_windows_figures(tmp_path):
    pe = load_module("experiments/pack_eval.py", "pack_eval")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(1)
    for i in range(40):
        (corpus / f"{i:02d}.txt").write_bytes(rng.integers(97, 123, rng.integers(20, 60)).tobytes())
    config = load_config("lm", "smoke")
    config.data.path, config.data.max_bytes = str(corpus), 0
    config.data.val_fraction, config.data.num_val_windows = 0.25, 6
    config.train.sample_tokens, config.train.num_steps = 0, 2
    workdir = str(tmp_path / "run")
    summary = trainer.train(config, workdir)
    assert pe.main([workdir, "--output", str(tmp_path / "out.json")]) == 0
    (row,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert row["trained_packed"] and row["step"] == 2 and row["boundaries"] > 0
    # the packed figure is the run's own evaluation
    assert math.isclose(row["packed/bits_per_byte"], summary["eval/bits_per_byte"], rel_tol=1e-5)
    # the windows figure: the same model and labels, no segment ids (NumPy cross-entropy)
    data = trainer.build_data(experiment_config(config))
    graphdef, state = final_state(workdir, config)
    model, _ = nnx.merge(graphdef, state)
    want = np_stats(model(data.val_inputs), data.val_labels)[0] / math.log(2)
    assert math.isclose(row["windows/bits_per_byte"], want, rel_tol=1e-4)
    assert not math.isclose(row["windows/bits_per_byte"], row["packed/bits_per_byte"], rel_tol=1e-4)
    # other documents: one ends after every "a"
    files, by_a = pe.evaluate_run(workdir, ["", "a"])
    assert files["packed/bits_per_byte"] == row["packed/bits_per_byte"]
    assert by_a["separator"] == "a" and by_a["boundaries"] > row["boundaries"]

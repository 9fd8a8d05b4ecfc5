"""The state-tracking and MAD sweep presets: every preset expands and validates, and the
state-tracking smoke grid runs end to end (best lr by the mean over seeds, per-length columns,
the table and the figure)."""

import csv

import numpy as np
import pytest

from linear_attention.training import experiment_config
from linear_attention.training import sweep as engine
from tests.training.conftest import ROOT

SWEEPS = ROOT / "configs" / "sweeps"


@pytest.mark.parametrize(
    "spec,count",
    [
        ("state_tracking.py:cpu", 144),
        ("state_tracking.py:groups", 288),
        ("state_tracking.py:smoke", 8),
        ("mad.py:cpu", 360),
        ("mad.py:smoke", 12),
    ],
)
def test_presets_expand_and_validate(spec, count):
    config = engine.load_sweep(str(SWEEPS / spec))
    axes, points = engine.expand(config)
    assert len(points) == count
    names = {a.name for a in axes}
    assert {"task", "mixer", "lr", "seed"} <= names
    lrs = next(a for a in axes if a.name == "lr").choices
    assert len(lrs) >= 2 if spec.endswith("smoke") else len(lrs) >= 3
    for point in points[:: max(1, count // 12)]:
        cfg = experiment_config(point.config)
        assert cfg.data.task == point.labels["task"]
        assert cfg.model.vocab_size >= cfg.data.tokens
        if point.labels["mixer"].endswith("_neg"):
            assert cfg.model.allow_neg_eigval
        if point.labels["mixer"] == "based":
            assert cfg.model.mixer == ("taylor", "swa")


@pytest.mark.slow  # 8 runs, 2 delta-rule models compiled at 3 shapes: minutes on a loaded CPU
def test_state_tracking_smoke_sweep(tmp_path):
    config = engine.load_sweep(str(SWEEPS / "state_tracking.py:smoke"))
    result = engine.run(config, tmp_path, log=lambda *_: None)
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)
    for column in ("task", "model.mixer", "optimizer.learning_rate", "seed", "eval/accuracy"):
        assert column in rows[0], column
    for row in rows:
        per_length = [float(row[f"eval/length_{n}/accuracy"]) for n in (12, 20)]
        assert float(row["eval/accuracy"]) == pytest.approx(np.mean(per_length))
        # (True for the *_neg labels; unset, the mixer's default False, for the others)
        assert (row["model.allow_neg_eigval"] == "True") == row["mixer"].endswith("_neg")
    best = {r["mixer"]: r for r in result["best"]}
    for mixer in ("gated_deltanet", "gated_deltanet_neg"):
        means = {}
        for r in rows:
            if r["mixer"] == mixer:
                means.setdefault(r["lr"], []).append(float(r["eval/accuracy"]))
        lr = max(means, key=lambda k: np.mean(means[k]))
        assert best[mixer]["lr"] == lr
        assert best[mixer]["eval/accuracy"] == pytest.approx(np.mean(means[lr]))
        assert best[mixer]["eval/accuracy min"] == min(means[lr])
        assert best[mixer]["eval/accuracy max"] == max(means[lr])
    md = (tmp_path / "results.md").read_text()
    assert "| gated_deltanet_neg |" in md and "L=12 | L=20" in md
    assert (tmp_path / "accuracy_vs_length.png").read_bytes()[:4] == b"\x89PNG"
    # The tables and figure again from results.csv alone (no run folders needed).
    again = engine.run(
        config,
        tmp_path / "redraw",
        report_only=True,
        results_csv=tmp_path / "results.csv",
        log=lambda *_: None,
    )
    assert again["markdown"] == result["markdown"]

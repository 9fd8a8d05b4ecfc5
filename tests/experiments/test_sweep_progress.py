"""A sweep says how many runs are done and how many are to go after each run (serially and in
workers' results), with the time so far and an estimate of the rest."""

import json
from pathlib import Path

from linear_attention.training import experiment_config
from linear_attention.training import sweep as sweep_package
from linear_attention.training.metrics import write_json
from linear_attention.training.sweep import points as sweep_points
from linear_attention.training.sweep import workers

MQAR = str(Path(__file__).resolve().parents[2] / "configs/sweeps/mqar.py")


def test_progress_line_counts_and_estimates(monkeypatch):
    clock = iter([100.0, 110.0, 130.0, 160.0])
    monkeypatch.setattr(workers.time, "perf_counter", lambda: next(clock))
    progress = workers.SweepProgress(3)
    assert progress.done() == "sweep: 1 of 3 runs done, 2 to go (10 s so far, about 20 s more)"
    assert progress.done() == "sweep: 2 of 3 runs done, 1 to go (30 s so far, about 15 s more)"
    assert progress.done() == "sweep: 3 of 3 runs done, 0 to go (60 s so far)"


def test_a_serial_sweep_logs_runs_done_and_to_go(tmp_path, monkeypatch):
    def fake_train(config, workdir, *, reporter):
        cfg = experiment_config(config)
        write_json(f"{workdir}/config.json", json.loads(json.dumps(cfg.to_dict())))
        write_json(f"{workdir}/summary.json", {"eval/accuracy": 0.5, "step": 6})

    monkeypatch.setattr(sweep_points, "train", fake_train)
    config = sweep_package.load_sweep(f"{MQAR}:smoke")
    lines = []
    sweep_package.run(config, tmp_path, only=["mixer=softmax"], log=lines.append)
    said = [line.split(" (")[0] for line in lines if line.startswith("sweep: ")]
    assert said == [f"sweep: {i} of 4 runs done, {4 - i} to go" for i in range(1, 5)]
    lines.clear()  # a rerun: every run finished, none to count
    sweep_package.run(config, tmp_path, only=["mixer=softmax"], log=lines.append)
    assert not [line for line in lines if line.startswith("sweep: ")]

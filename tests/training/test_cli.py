"""The command lines: la-train's help, dry run and error messages; Ctrl-C in a real process."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from linear_attention.training import cli, experiment_config
from linear_attention.training.metrics import read_jsonl
from tests.training.conftest import ROOT, load_config

SMOKE = "--config=configs/mqar.py:smoke"


def test_help_lists_presets_and_sections(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["la-train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "configs/mqar.py: default, cpu, smoke" in out
    assert "configs/lm.py: default, cpu, smoke" in out
    for section in ("model: vocab_size, d_model", "data: kind", "optimizer:", "train:", "mesh:"):
        assert section in out
    assert "--dry_run" in out


def test_dry_run_prints_the_resolved_config_and_runs_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    workdir = tmp_path / "never"
    argv = ["la-train", SMOKE, f"--workdir={workdir}", "--config.model.mixer=gated,softmax"]
    assert cli.main([*argv, "--config.train.num_steps=9", "--dry_run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = load_config("mqar", "smoke")
    expected.model.mixer = "gated,softmax"
    expected.train.num_steps = 9
    assert printed == json.loads(json.dumps(experiment_config(expected).to_dict()))
    assert printed["model"]["mixer"] == ["gated", "softmax"]
    assert not workdir.exists()


def test_resume_with_another_config_is_a_usage_error(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    workdir = tmp_path / "run"
    workdir.mkdir()
    previous = experiment_config(load_config("mqar", "smoke")).to_dict()
    (workdir / "config.json").write_text(json.dumps(previous))
    status = cli.main(["la-train", SMOKE, f"--workdir={workdir}", "--config.model.d_model=16"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("la-train: error: ") and "Traceback" not in err
    assert "config.model.d_model = 32, but this config has 16" in err


def test_ctrl_c_saves_a_checkpoint_and_the_rerun_resumes_from_it(tmp_path):
    """SIGINT to a real la-train process long before its first scheduled checkpoint."""
    workdir = tmp_path / "run"
    common = [SMOKE, f"--workdir={workdir}", "--config.train.checkpoint_every=100000"]
    common += ["--config.train.eval_every=100000", "--config.train.log_every=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "experiments/train.py", *common, "--config.train.num_steps=100000"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 240
        while len(read_jsonl(str(workdir / "metrics.jsonl"))) < 2:  # training is under way
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    step = int(err.split("SIGINT at step ")[1].split(":")[0])
    assert "checkpoint saved; rerun the same command to resume" in err
    assert "SIGINT received: saving a checkpoint" in out
    assert os.listdir(workdir / "checkpoints") == [str(step)]
    assert step >= 2

    rerun = subprocess.run(
        [sys.executable, "experiments/train.py", *common, f"--config.train.num_steps={step + 1}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming from step {step} " in rerun.stdout
    assert [r["step"] for r in read_jsonl(str(workdir / "metrics.jsonl"))][-1] == step + 1


@pytest.mark.parametrize(
    "spec, path, preset",
    [
        ("configs/mqar.py", "configs/mqar.py", None),
        ("configs/mqar.py:cpu", "configs/mqar.py", "cpu"),
        ("/a:b/configs/lm.py:smoke", "/a:b/configs/lm.py", "smoke"),
    ],
)
def test_config_spec_split(spec, path, preset):
    assert cli._split_spec(spec) == (path, preset)

"""experiments/fault_trials.py at its smallest (slow: real sweeps and runs in subprocesses):
one Ctrl-C on a two-worker sweep, and one SIGKILL of a short run before its rerun; the files
hold every try, the load and the verdicts the issue asks for."""

import json
import subprocess
import sys

import pytest

from tests.scripts import DEADLINE_S, ROOT


def _trial(tmp_path, *args):
    out = tmp_path / "trial.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments/fault_trials.py"), *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_one_ctrl_c_on_a_two_worker_sweep(tmp_path):
    result = _trial(tmp_path, "ctrl_c", "--tries", "1")
    (t,) = result["tries"]
    assert (result["passed"], result["of"]) == (1, 1)
    assert t["exit_status"] == 130 and not t["traceback"] and t["checkpoints_saved"] == 2
    assert len(t["load_avg_before"]) == 3 and result["cpu_count"] >= 1


@pytest.mark.slow
def test_one_sigkill_then_rerun_ends_as_the_straight_run(tmp_path):
    result = _trial(tmp_path, "sigkill", "--kills", "1", "--steps", "6", "--checkpoint_every", "2")
    assert result["rerun_exit_status"] == 0 and result["identical_final_metrics"]
    assert result["rerun_final"]["step"] == result["straight_final"]["step"] == 6
    (kill,) = result["kills"]
    assert 0 <= kill["delay_s"] <= result["straight_run_s"]

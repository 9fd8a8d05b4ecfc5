"""experiments/long_context.py: a tiny run in a subprocess (the script forces 8 CPU devices
before JAX starts): files, every point, ratios from the raw figures, and the per-device memory
falling as time is split."""

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import DEADLINE_S, ROOT


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("lc")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    args = ["--out", str(out), "--log2_T", "9", "--devices", "1", "4", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments/long_context.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "long_context.png").stat().st_size > 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow  # (the script's whole preset: minutes on 2 cores)
def test_every_point_and_ratios(result):
    recs = {(r["layer"], r["devices"]): r for r in result["records"]}
    assert set(recs) == {(layer, n) for layer in ("gated", "gated_deltanet") for n in (1, 4)}
    assert result["machine"]["device_count"] == 8
    for (layer, _), r in recs.items():
        one = recs[layer, 1]
        assert r["T"] == 512 and len(r["times_s"]) == 1 and r["median_s"] > 0
        assert r["memory_ratio_vs_1"] == pytest.approx(
            r["memory_per_device_MiB"] / one["memory_per_device_MiB"]
        )
        assert r["time_ratio_vs_1"] == pytest.approx(r["median_s"] / one["median_s"])


@pytest.mark.slow  # (the script's whole preset: minutes on 2 cores)
def test_memory_per_device_falls_with_the_split(result):
    for layer in ("gated", "gated_deltanet"):
        (r,) = [r for r in result["records"] if r["layer"] == layer and r["devices"] == 4]
        assert r["memory_ratio_vs_1"] < 0.6  # ideal 0.25, plus replicated parameters

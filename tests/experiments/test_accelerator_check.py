"""experiments/accelerator_check.py: the tiny preset end to end (checks pass, every point timed,
ratios follow from the raw times), the time budget, and bad arguments."""

import json
import statistics

import pytest

from tests.scripts import load_module


@pytest.fixture(scope="module")
def ac():
    return load_module("experiments/accelerator_check.py", "accelerator_check")


@pytest.fixture(scope="module")
def tiny(ac, tmp_path_factory):
    out = tmp_path_factory.mktemp("accel")
    ac.run(out, "tiny", log=lambda _: None)
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow  # (the script's whole preset: minutes on 2 cores)
def test_tiny_preset_checks_and_times_everything(ac, tiny):
    out, res = tiny
    assert (out / "time_vs_T.png").stat().st_size > 0
    assert res["checks_passed"]
    checked = {(c["method"], c["check"]) for c in res["checks"] if "rel_err" in c}
    for method in ("chunk", "chunk_parallel"):
        assert {(method, "forward"), (method, "gradient")} <= checked
    for c in res["checks"]:
        assert c.get("ok") is True or "unsupported" in c
        if c.get("dtype") == "float32":
            assert c["rel_err"] < 1e-4
    recs = {(r["method"], r["dtype"], r["mode"]): r for r in res["records"]}
    assert len(recs) == len(ac.TIMED) * len(ac.DTYPES) * len(ac.MODES)
    for r in recs.values():
        assert r["median_s"] > 0 and len(r["times_s"]) == 2 and "skipped" not in r
    for dtype in ac.DTYPES:
        for mode in ac.MODES:
            a = recs["chunk", dtype, mode]["times_s"][1:]
            b = recs["chunk_parallel", dtype, mode]["times_s"][1:]
            speedup = recs["chunk_parallel", dtype, mode]["chunk_parallel_speedup"]
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            assert speedup == pytest.approx(statistics.median(ratios))


def test_spent_budget_skips_every_timing(ac):
    records = ac.run_timings((64,), ("float32",), 1, -1.0, 20.0, 2**40, log=lambda _: None)
    assert len(records) == len(ac.TIMED) * len(ac.MODES)
    assert all("time budget" in r["skipped"] and "median_s" not in r for r in records)


def test_bad_arguments_raise(ac, tmp_path):
    with pytest.raises(ValueError, match="preset"):
        ac.run(tmp_path, "huge")
    with pytest.raises(ValueError, match="dtypes"):
        ac.run(tmp_path, "tiny", dtypes=("float16",))

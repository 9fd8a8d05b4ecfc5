"""experiments/accelerator_check.py: the tiny preset end to end (checks pass, every point timed,
ratios follow from the raw times, every kernel family checked, a training step of every paper
preset), the time budget, one family and one training step on their own, and bad arguments."""

import json
import math
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
    checked = {(c["family"], c["check"], c["dtype"]) for c in res["family_checks"]}
    assert checked == {
        (family, check, dtype)
        for family in ac.FAMILIES
        for check, dtype in (
            ("forward", "float32"),
            ("gradient", "float32"),
            ("forward", "bfloat16"),
        )
    }
    assert all(c["ok"] for c in res["family_checks"])
    steps = res["train_steps"]
    assert [r["preset"] for r in steps] == list(ac.paper_presets())
    for r in steps:
        assert r["tokens_per_sec"] == pytest.approx(r["batch"] * r["seq_len"] / r["step_s"])
        assert r["mfu"] is None  # no --peak_flops
        assert abs(r["first_loss"] - math.log(32_000)) < 0.5


def test_one_family_is_checked_against_its_reference(ac):
    """The sliding window against the quadratic form with its band mask (T 37, window 7)."""
    checks = ac.run_family_checks(37, families=("sliding_window",))
    assert [(c["check"], c["dtype"]) for c in checks] == [
        ("forward", "float32"),
        ("gradient", "float32"),
        ("forward", "bfloat16"),
    ]
    assert all(c["ok"] and c["reference"] == "quadratic" for c in checks)
    assert checks[0]["rel_err"] < 1e-5 and checks[1]["rel_err"] < 1e-5


def test_a_training_step_reports_tokens_per_second_and_mfu(ac):
    """gla_340m at one narrow layer, 2 rows of 16: the first step's loss is that of a fresh
    model (near ln 32000, the uniform guess) and the MFU is flops · tokens/s / peak."""
    cfg = ac.step_config("gla_340m", depth=1, narrow=True, seq_len=16, batch=2)
    assert (cfg.model.num_layers, cfg.model.d_model, cfg.model.vocab_size) == (1, 64, 32_000)
    rec = ac.run_train_step(cfg, repeats=2, peak_flops=1e12)
    assert abs(rec["first_loss"] - math.log(32_000)) < 0.5
    assert rec["step_s"] == statistics.median(rec["times_s"]) and len(rec["times_s"]) == 2
    assert rec["tokens_per_sec"] == pytest.approx(32 / rec["step_s"])
    assert rec["mfu"] == pytest.approx(rec["flops_per_token"] * rec["tokens_per_sec"] / 1e12)
    assert rec["parameters"] > 32_000 * 64  # the embedding alone


def test_spent_budget_skips_every_timing(ac):
    records = ac.run_timings((64,), ("float32",), 1, -1.0, 20.0, 2**40, log=lambda _: None)
    assert len(records) == len(ac.TIMED) * len(ac.MODES)
    assert all("time budget" in r["skipped"] and "median_s" not in r for r in records)


def test_bad_arguments_raise(ac, tmp_path):
    with pytest.raises(ValueError, match="preset"):
        ac.run(tmp_path, "huge")
    with pytest.raises(ValueError, match="dtypes"):
        ac.run(tmp_path, "tiny", dtypes=("float16",))
    with pytest.raises(ValueError, match="peak_flops"):
        ac.run(tmp_path, "tiny", peak_flops=0.0)

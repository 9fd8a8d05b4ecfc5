"""Smoke test of experiments/benchmark.py: the quick preset end to end, and the skip rules.

Times are not asserted (speed lives in the benchmark); the test checks that every method and
pass is measured, the files are written, and the derived numbers follow from the raw times.
"""

import json
import math
import statistics
from pathlib import Path

import pytest

from tests.scripts import load_module

ROOT = Path(__file__).resolve().parents[1]
METHODS = [
    "chunk",
    "chunk_decay",
    "chunk_gla",
    "scan",
    "associative_scan",
    "quadratic",
    "softmax",
    "blockwise_softmax",
    "naive_chunked_causal",
    "performer_causal",
]


@pytest.fixture(scope="module")
def bench():
    return load_module("experiments/benchmark.py", "benchmark")


@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench.run(out, preset="quick", log=lambda _: None)
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow  # (the script's whole preset: minutes on 2 cores)
def test_quick_preset_measures_every_method_and_writes_files(quick):
    out, res = quick
    assert (out / "time_vs_T.png").stat().st_size > 0
    assert (out / "memory_vs_T.png").stat().st_size > 0
    assert {"platform", "cpu_count", "jax_version", "device_kind"} <= set(res["machine"])
    repeats, Ts = res["config"]["repeats"], res["config"]["T"]
    assert len(Ts) >= 2
    got = {(r["method"], r["mode"], r["T"]): r for r in res["records"]}
    assert set(got) == {(m, mode, T) for m in METHODS for mode in ("fwd", "grad") for T in Ts}
    for rec in got.values():
        assert "skipped" not in rec, rec
        assert len(rec["times_s"]) == repeats + 1  # warm-up + interleaved rounds
        assert all(math.isfinite(t) and t > 0 for t in rec["times_s"])
        assert rec["median_s"] == statistics.median(rec["times_s"][1:])
        assert isinstance(rec["temp_bytes"], int) and rec["temp_bytes"] >= 0
    # the quadratic-memory methods' gradient temporaries grow with T
    for m in ("quadratic", "softmax"):
        assert got[m, "grad", Ts[1]]["temp_bytes"] > got[m, "grad", Ts[0]]["temp_bytes"] > 0


@pytest.mark.slow  # (the script's whole preset: minutes on 2 cores)
def test_speedups_and_headline_follow_from_the_raw_times(quick, bench):
    _, res = quick
    T = res["config"]["headline_T"]
    got = {(r["method"], r["mode"]): r for r in res["records"] if r["T"] == T}
    head = res["headline"]
    for mode in ("fwd", "grad"):
        chunk = got["chunk", mode]["times_s"]
        for base in ("naive_chunked_causal", "performer_causal"):
            ratios = [b / c for b, c in zip(got[base, mode]["times_s"][1:], chunk[1:], strict=True)]
            assert got["chunk", mode][f"speedup_vs_{base}"] == pytest.approx(
                statistics.median(ratios)
            )
            assert head[f"{mode}_speedup_vs_{base}"] == got["chunk", mode][f"speedup_vs_{base}"]
        assert head[f"{mode}_ms"] == pytest.approx(got["chunk", mode]["median_s"] * 1e3)
    assert head["grad_temp_MB"] == got["chunk", "grad"]["temp_bytes"] / 2**20
    # forward FLOPs 4·T·H·(C·d + d²) with H=4, C=d=64, against the n³ matmul timed alongside
    n, t_mm = res["matmul"]["n"], res["matmul"]["median_s"]
    flops = 4 * T * 4 * (64 * 64 + 64 * 64)
    expected = (flops / got["chunk", "fwd"]["median_s"]) / (2 * n**3 / t_mm)
    assert head["fraction_of_matmul_peak"] == pytest.approx(expected)
    sweep = res["chunk_sweep"]
    assert sweep["T"] == T
    for mode in ("fwd", "grad"):
        recs = [r for r in sweep["records"] if r["mode"] == mode]
        assert {r["chunk_size"] for r in recs} == set(bench.PRESETS["quick"]["chunk_sizes"])
        assert sweep["fastest"][mode] == min(recs, key=lambda r: r["median_s"])["chunk_size"]


def test_budgets_skip_points_with_a_reason(bench, tmp_path):
    run = dict(methods=["performer_causal"], repeats=1, parts=("linear",), log=lambda _: None)
    # Memory, on the compiled program: over budget at the first T, skipped from then on.
    res = bench.run(tmp_path / "a", T=(64, 128), mem_budget_gb=1e-9, **run)
    recs = {(r["mode"], r["T"]): r for r in res["records"]}
    for mode in ("fwd", "grad"):
        assert recs[mode, 64]["temp_bytes"] > 0 and "GiB at T=64" in recs[mode, 64]["skipped"]
        assert recs[mode, 128]["skipped"] == recs[mode, 64]["skipped"]
        assert recs[mode, 128]["temp_bytes"] is None and "median_s" not in recs[mode, 128]
    assert res["headline"] is None
    # Memory, predicted before compiling from the growth over the two previous T.
    inputs = bench.make_inputs(64)["feat"], bench.make_inputs(128)["feat"]
    t64, t128 = (
        bench.compile_point(bench.performer_causal, "fwd", x)[0]
        .memory_analysis()
        .temp_size_in_bytes
        for x in inputs
    )
    predicted = t128**2 / t64
    assert predicted > t128 > 0
    budget = (predicted * t128) ** 0.5 / 2**30
    res = bench.run(tmp_path / "b", T=(64, 128, 256), mem_budget_gb=budget, **run)
    fwd = {r["T"]: r for r in res["records"] if r["mode"] == "fwd"}
    assert [fwd[T]["temp_bytes"] for T in (64, 128, 256)] == [t64, t128, None]
    assert fwd[128]["median_s"] > 0
    assert fwd[256]["skipped"].startswith("over budget: predicted temp")
    # Time: a zero budget runs the first T only.
    res = bench.run(tmp_path / "c", T=(64, 128, 192), time_budget_s=0.0, **run)
    recs = {(r["mode"], r["T"]): r for r in res["records"]}
    for mode in ("fwd", "grad"):
        assert recs[mode, 64]["median_s"] > 0
        assert "s at T=64" in recs[mode, 128]["skipped"] and "took" in recs[mode, 128]["skipped"]
        assert recs[mode, 192]["skipped"] == recs[mode, 128]["skipped"]


@pytest.mark.slow  # (the script's whole preset: minutes on 2 cores)
def test_quick_preset_measures_the_delta_rule(quick):
    out, res = quick
    assert (out / "delta_vs_T.png").stat().st_size > 0
    delta = res["delta"]
    got = {(r["method"], r["mode"], r["T"]): r for r in delta["records"]}
    methods = ("delta_chunk", "delta_scan")
    modes = ("fwd", "grad")
    assert set(got) == {(m, mode, T) for m in methods for mode in modes for T in delta["T"]}
    for rec in got.values():
        assert "skipped" not in rec and rec["median_s"] > 0 and rec["temp_bytes"] >= 0
    T = max(delta["T"])
    head = delta["headline"]
    for mode in ("fwd", "grad"):
        chunk, scan = (got[m, mode, T]["times_s"] for m in methods)
        ratio = statistics.median(s / c for s, c in zip(scan[1:], chunk[1:], strict=True))
        assert head[f"{mode}_speedup"] == pytest.approx(ratio)
    temps = [got[m, "grad", T]["temp_bytes"] for m in methods]
    assert head["grad_memory_ratio"] == pytest.approx(temps[1] / temps[0])
    assert head["meets_4x_grad_memory"] == (head["grad_memory_ratio"] >= 4.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(preset="huge"), "preset"),
        (dict(T=(100,)), "T must be multiples of 64"),
        (dict(methods=["flash"]), "methods"),
        (dict(repeats=0), "repeats"),
        (dict(parts=("softmax",)), "parts"),
    ],
)
def test_bad_arguments_raise(bench, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench.run(tmp_path, **kwargs)

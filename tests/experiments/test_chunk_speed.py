"""experiments/chunk_speed.py: a tiny run end to end (files, every point, ratios and targets from
the raw times), the kernels it loads from a git revision compute what the library computes, and
timing.interleaved (its timer) times every point every round in varying order."""

import json
import statistics

import jax
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.scripts import load_module


@pytest.fixture(scope="module")
def cs():
    return load_module("experiments/chunk_speed.py", "chunk_speed")


def test_tiny_run_before_and_after(cs, tmp_path):
    res = cs.run(
        tmp_path, before="HEAD", T=128, repeats=2, matmul_n=64, decays=("head",), log=lambda _: None
    )
    assert (tmp_path / "speed.png").stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["before"] == "HEAD"
    recs = {(r["name"], r["decay"], r["mode"]): r for r in res["records"]}
    raw = json.loads((tmp_path / "results.json").read_text())
    assert raw["records"] == json.loads(json.dumps(res["records"]))
    recs_stream = {
        m: {c: res["stream_times_s"][m][c] for c in ("wall", "cpu")} for m in ("fwd", "grad")
    }
    expected = {("naive", "none", m) for m in ("fwd", "grad")} | {
        (n, d, m) for n in ("chunk", "@HEAD") for d in ("none", "head") for m in ("fwd", "grad")
    }
    assert set(recs) == expected
    for (name, decay, mode), r in recs.items():
        for clock in ("wall", "cpu"):
            own = r[f"{clock}_times_s"]
            assert len(own) == 3 and min(own) >= 0  # warm-up + 2 rounds
            assert r[f"{clock}_ms"] == pytest.approx(1e3 * statistics.median(own[1:]))
            if decay == "none":
                naive = recs["naive", "none", mode][f"{clock}_times_s"]
                ratio = statistics.median(n / t for n, t in zip(naive[1:], own[1:], strict=True))
                assert r[f"{clock}_speedup_vs_naive"] == pytest.approx(ratio)
            if name == "chunk":
                old = recs["@HEAD", decay, mode][f"{clock}_times_s"]
                ratio = statistics.median(t / o for t, o in zip(own[1:], old[1:], strict=True))
                assert r[f"{clock}_over_before"] == pytest.approx(ratio)
            stream = recs_stream[mode][clock]
            ratio = statistics.median(t / s for t, s in zip(own[1:], stream[1:], strict=True))
            assert r[f"{clock}_over_stream"] == pytest.approx(ratio)
        if mode == "fwd" and decay == "none":
            assert r["wall_fraction_of_peak"] > 0
            assert r["wall_fraction_of_peak_at_stream"] > 0
    t = res["targets"]["chunk"]["cpu"]
    assert t["grad_temp_MiB"]["value"] == recs["chunk", "none", "grad"]["temp_MiB"]
    assert t["grad_temp_MiB"]["met"] == (t["grad_temp_MiB"]["value"] <= 64)
    speedup = recs["chunk", "none", "fwd"]["cpu_speedup_vs_naive"]
    assert t["fwd_speedup_vs_naive"] == dict(value=speedup, bound=3.5, met=speedup >= 3.5)


def test_stream_reads_every_input_once(cs):
    q, k, v = (np.full((1, 3, 2, 4), x, np.float32) for x in (1.0, 2.0, 4.0))
    np.testing.assert_array_equal(cs.stream(q, k, v), np.full((1, 3, 2, 4), 7.0))
    dq, dk, dv = cs.stream_grad(q, k, v, 3 * q)
    for got, want in ((dq, 3.0), (dk, 6.0), (dv, 12.0)):
        np.testing.assert_array_equal(got, np.full((1, 3, 2, 4), want))


def test_loaded_kernels_compute_the_library_numbers(cs, tmp_path):
    q, k, v = (jax.random.uniform(key, (cs.B, 70, cs.H, cs.D)) for key in jax.random.split(
        jax.random.key(0), 3))  # fmt: skip
    ref = K.causal_linear_attention(q, k, v, method="quadratic")
    old = cs.load_kernels("HEAD", tmp_path)
    np.testing.assert_allclose(old.causal_linear_attention(q, k, v), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="multiple"):
        cs.run(tmp_path, T=100)


def test_interleaved_times_every_point_every_round_in_varying_order():
    bench = load_module("experiments/benchmark.py", "benchmark_for_chunk_speed")
    calls = []
    points = {i: (lambda i=i: calls.append(i), ()) for i in range(4)}
    cpu = {}
    times = bench.interleaved(points, rounds=6, slow_s=float("inf"), cpu_times=cpu)
    assert all(len(times[i]) == len(cpu[i]) == 7 for i in range(4))
    rounds = [tuple(calls[4 * r : 4 * r + 4]) for r in range(7)]
    assert all(sorted(r) == [0, 1, 2, 3] for r in rounds)
    assert len({r[r.index(0) - 1] for r in rounds[1:]}) > 1  # not always the same predecessor

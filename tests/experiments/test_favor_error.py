"""experiments/favor_error.py: the tiny preset end to end, and one point's errors against an
independent float64 NumPy FAVOR+."""

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.scripts import load_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fe():
    return load_module("experiments/favor_error.py", "favor_error")


@pytest.fixture(scope="module")
def tiny(fe, tmp_path_factory):
    out = tmp_path_factory.mktemp("favor")
    fe.run(out, "tiny", log=lambda _: None)
    return out, json.loads((out / "results.json").read_text())


def test_tiny_preset_writes_files_with_sane_numbers(fe, tiny):
    out, res = tiny
    assert (out / "favor_error.png").stat().st_size > 0
    assert len((out / "results.csv").read_text().splitlines()) == len(res["records"]) + 1
    cfg = fe.PRESETS["tiny"]
    assert len(res["records"]) == len(cfg["norms"]) * cfg["seeds"] * len(cfg["m"]) * 2
    assert res["non_finite"] == 0
    for r in res["records"]:
        for metric in fe.METRICS:
            assert math.isfinite(r[metric]) and r[metric] > 0
    # the summary is the statistics of the records
    for s in res["summary"]:
        errs = [
            r[s["metric"]]
            for r in res["records"]
            if (r["norm"], r["orthogonal"], r["m"]) == (s["norm"], s["orthogonal"], s["m"])
        ]
        assert len(errs) == s["seeds"] == cfg["seeds"]
        assert s["mean"] == pytest.approx(np.mean(errs))
        assert s["std"] == pytest.approx(np.std(errs))
        assert (s["p10"], s["p90"]) == pytest.approx(tuple(np.percentile(errs, [10, 90])))
    # slopes are the least-squares fit of log mean error vs log m
    for sl in res["slopes"]:
        pts = sorted(
            (s["m"], s["mean"])
            for s in res["summary"]
            if (s["norm"], s["orthogonal"], s["metric"])
            == (sl["norm"], sl["orthogonal"], sl["metric"])
        )
        m, e = np.asarray(pts).T
        assert sl["slope"] == pytest.approx(np.polyfit(np.log(m), np.log(e), 1)[0])
    # at the small norm, 16x more features cut the kernel and weight errors (both projections)
    small = min(cfg["norms"])
    mean = {
        (s["orthogonal"], s["m"], s["metric"]): s["mean"]
        for s in res["summary"]
        if s["norm"] == small
    }
    lo, hi = min(cfg["m"]), max(cfg["m"])
    for orth in (True, False):
        for metric in ("kernel", "weights"):
            assert mean[orth, hi, metric] < 0.7 * mean[orth, lo, metric]


def test_point_errors_match_float64_numpy_favor(fe):
    T, d, m, norm = 12, 8, 24, 1.5
    q, k, v = fe.make_data(jax.random.key(3), T, d, norm)
    np.testing.assert_allclose(np.linalg.norm(q, axis=-1), norm * d**0.25, rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(k, axis=-1), norm * d**0.25, rtol=1e-5)
    w = K.feature_maps.random_projection(jax.random.key(4), m, d, orthogonal=True)
    got = fe.point_errors(q, k, v, w, fe.exact(q, k, v))

    q64, k64, v64, w64 = (np.asarray(x, np.float64) for x in (q, k, v, w))
    kernel = np.empty((T, T))
    for i in range(T):
        for j in range(T):
            kernel[i, j] = math.exp(q64[i] @ k64[j] / math.sqrt(d))
    weights = kernel / kernel.sum(axis=1, keepdims=True)
    out = weights @ v64

    def phi(x):
        xs = x * d**-0.25
        return np.exp(xs @ w64.T - 0.5 * np.sum(xs * xs, -1, keepdims=True)) / math.sqrt(m)

    est = phi(q64) @ phi(k64).T
    est_w = est / est.sum(axis=1, keepdims=True)

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert got["kernel"] == pytest.approx(rel(est, kernel), rel=1e-3)
    assert got["weights"] == pytest.approx(rel(est_w, weights), rel=1e-3)
    assert got["output"] == pytest.approx(rel(est_w @ v64, out), rel=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(preset="huge"), "preset"),
        (dict(m=[0, 4]), "m must be"),
        (dict(norms=[-1.0]), "norms must be"),
        (dict(seeds=0), "seeds must be"),
    ],
)
def test_bad_arguments_raise(fe, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fe.run(tmp_path, **{"preset": "tiny", **kwargs})

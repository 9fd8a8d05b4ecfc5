"""experiments/chunk_speed.py: a tiny run end to end (files, every point, ratios from the raw
times), and the kernel it loads from a git revision computes what the library computes."""

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
    res = cs.run(tmp_path, before="HEAD", T=128, repeats=2, matmul_n=64, log=lambda _: None)
    assert (tmp_path / "speed.png").stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["before"] == "HEAD"
    recs = {(r["name"], r["mode"]): r for r in res["records"]}
    assert set(recs) == {(n, m) for n in ("naive", "chunk", "chunk@HEAD") for m in ("fwd", "grad")}
    for (_, mode), r in recs.items():
        for clock in ("wall", "cpu"):
            own, naive = r[f"{clock}_times_s"], recs["naive", mode][f"{clock}_times_s"]
            assert len(own) == 2 and min(own) >= 0
            ratio = statistics.median(n / t for n, t in zip(naive, own, strict=True))
            assert r[f"{clock}_speedup_vs_naive"] == pytest.approx(ratio)
        if mode == "fwd":
            assert 0 < r["wall_fraction_of_peak"] and r["temp_MiB"] >= 0


def test_loaded_kernels_compute_the_library_numbers(cs):
    q, k, v = (jax.random.uniform(key, (cs.B, 70, cs.H, cs.D)) for key in jax.random.split(
        jax.random.key(0), 3))  # fmt: skip
    ref = K.causal_linear_attention(q, k, v, method="quadratic")
    for rev in (None, "HEAD"):
        o = cs.load_kernel(rev)(q, k, v)
        np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="multiple"):
        cs.run("/tmp/unused", T=100)

"""experiments/chunk_ab.py: a tiny A/B of the chunk kernel against the checkout's own HEAD."""

import json
import math
import statistics

from tests.scripts import load_module


def test_tiny_ab_against_head(tmp_path):
    ab = load_module("experiments/chunk_ab.py", "chunk_ab")
    res = ab.run("HEAD", tmp_path, T=64, repeats=1, log=lambda _: None)
    assert json.loads((tmp_path / "results.json").read_text())["config"]["T"] == 64
    rows = {(r["kernel"], r["decay"], r["mode"]): r for r in res["rows"]}
    kinds = [
        (n, d, m)
        for n in ("base", "new")
        for d in ("none", "head", "key")
        for m in ("fwd", "grad")
        if (n, d) != ("base", "key")
    ]
    assert set(rows) == set(kinds)
    for (name, decay, mode), r in rows.items():
        assert len(r["times_s"]) == 2 and all(t > 0 and math.isfinite(t) for t in r["times_s"])
        assert r["median_ms"] == 1e3 * statistics.median(r["times_s"][1:])
        if name == "new" and decay != "key":
            base = rows["base", decay, mode]["times_s"][1]
            assert r["new_over_base"] == r["times_s"][1] / base

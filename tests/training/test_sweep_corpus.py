"""Sweep results rows carry the corpus record of a text run's summary, and the machine
record of every run's."""

import json

from linear_attention.training.sweep.grid import Point
from linear_attention.training.sweep.results import collect
from tests.training.conftest import load_config


def test_results_rows_carry_the_corpus_record(tmp_path):
    config = load_config("lm", "smoke")
    point = Point(name="p", labels={}, values={}, config=config)
    corpus = {"path": "builtin:/x", "files": 3, "bytes": 10, "sha256": "ab", "python": "3.11.7"}
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "summary.json").write_text(json.dumps({"step": 6, "corpus": corpus}))
    (row,) = collect([], [point], tmp_path)
    assert row["status"] == "ok" and row["step"] == 6
    assert row["corpus/python"] == "3.11.7" and row["corpus/sha256"] == "ab"
    assert row["corpus/bytes"] == 10 and row["corpus/path"] == "builtin:/x"
    assert "corpus/files" not in row and "corpus/tokenizer" not in row


def test_results_rows_carry_the_machine_record(tmp_path):
    config = load_config("lm", "smoke")
    points = [Point(name=n, labels={}, values={}, config=config) for n in ("new", "old")]
    machine = {
        "cpu_model": "AMD EPYC",
        "cpu_id": "25/1/1",
        "cpu_flags": "avx avx2 fma",
        "device_kind": "cpu",
        "jax_version": "0.4.38",
        "cpu_count": 2,
        "load_avg_end": [1.0, 2.0, 3.0],
    }
    for name, summary in (("new", {"step": 6, "machine": machine}), ("old", {"step": 6})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    new, old = collect([], points, tmp_path)
    assert new["machine/cpu_model"] == "AMD EPYC" and new["machine/jax_version"] == "0.4.38"
    assert new["machine/device_kind"] == "cpu" and "machine/cpu_count" not in new
    assert new["machine/cpu_id"] == "25/1/1" and new["machine/cpu_flags"] == "avx avx2 fma"
    # a run from before the record existed has no machine columns (not empty strings)
    assert not any(key.startswith("machine/") for key in old)

"""Sweep results rows carry the corpus record of a text run's summary."""

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

"""The results files behind EXPERIMENTS.md (docs/results/*.csv) are well-formed tables: one
header, every row as wide as it, no run twice; the MAD and state-tracking files carry the
columns the studies report (issue 21: task, mixer, learning rate, seed, eval/accuracy)."""

import csv

import pytest

from tests.scripts import ROOT

CSVS = sorted((ROOT / "docs" / "results").glob("*.csv"))
STUDY_COLUMNS = ("task", "model.mixer", "optimizer.learning_rate", "seed", "eval/accuracy")


@pytest.mark.parametrize("path", CSVS, ids=lambda p: p.name)
def test_results_csv_is_one_table(path):
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    assert len(set(header)) == len(header), f"repeated columns in {path.name}"
    assert rows, f"{path.name} has no rows"
    for i, row in enumerate(rows, start=2):
        assert row != header, f"{path.name}:{i} repeats the header"
        assert len(row) == len(header), f"{path.name}:{i} has {len(row)} fields, not {len(header)}"
    if "point" in header:
        points = [row[header.index("point")] for row in rows]
        assert len(set(points)) == len(points), f"{path.name} lists a run twice"
    if path.name.startswith(("mad", "state_tracking")):
        assert set(STUDY_COLUMNS) <= set(header), (path.name, set(STUDY_COLUMNS) - set(header))

"""The study pages (docs/studies/*.md, issue 74): every table between `<!-- table: NAME -->`
markers equals its regeneration from docs/results/ by docs/studies.py, so no table drifts
from its file; the generator's tuning equals the sweep tool's own best-per-setting file, its
Fisher test equals SciPy's, a changed results file changes the page, and every three-decimal
figure in a page's text comes from its tables or the results files it links."""

import csv
import json
import math
import re
import shutil

import pytest
from scipy import stats

from tests.scripts import ROOT, load_module

studies = load_module("docs/studies.py", "docs_studies")
PAGES = studies.pages()


def test_the_studies_have_pages_and_every_table_is_on_one():
    names = [name for page in PAGES for name in studies.names_used(page.read_text())]
    assert {p.stem for p in PAGES} >= {
        "README",
        "mqar",
        "lm",
        "decoding",
        "length_generalisation",
        "favor",
        "packing",
        "state_tracking",
        "mad",
        "tokenizers",
    }
    assert sorted(set(names)) == sorted(studies.TABLES), "a table no page shows, or one unknown"
    for page in PAGES:
        used = studies.names_used(page.read_text())
        assert len(used) == len(set(used)), f"a table shown twice on {page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_table_equals_its_results_file(page):
    text = page.read_text()
    assert studies.names_used(text), f"{page.name} has no generated table"
    stale = [
        name
        for name, old, new in zip(
            studies.names_used(text),
            studies.BLOCK.findall(text),
            studies.BLOCK.findall(studies.fill(text)),
            strict=True,
        )
        if old != new
    ]
    assert not stale, f"{page.name}: {stale} differ from docs/results/ (run python docs/studies.py)"


def test_an_unknown_table_is_an_error():
    with pytest.raises(KeyError, match="no table named 'mqar.nope'"):
        studies.fill("<!-- table: mqar.nope -->\n<!-- /table -->")


def test_tuning_equals_the_sweeps_best_file():
    """docs/results/mqar_sweep_cpu_best.csv is written by experiments/sweep.py's own
    best-per-setting code; the generator picks the same rate and mean for every cell."""
    rows = list(csv.DictReader(open(ROOT / "docs/results/mqar_sweep_cpu.csv", newline="")))
    best = studies.best_of_rates(rows, ("mixer", "d_model"))
    with open(ROOT / "docs/results/mqar_sweep_cpu_best.csv", newline="") as f:
        reference = list(csv.DictReader(f))
    assert len(reference) == len(best) == 28
    for ref in reference:
        cell = best[(ref["mixer"], ref["d_model"])]
        assert cell["lr"] == ref["lr"], ref["point"]
        assert math.isclose(cell["mean"], float(ref["eval/accuracy"]), rel_tol=1e-12)
        assert math.isclose(cell["min"], float(ref["eval/accuracy min"]), rel_tol=1e-12)
        assert math.isclose(cell["max"], float(ref["eval/accuracy max"]), rel_tol=1e-12)


def test_fisher_test_equals_scipy():
    for a, n1, b, n2 in ((9, 30, 0, 30), (2, 30, 0, 30), (2, 30, 0, 84), (3, 10, 1, 12)):
        _, p = stats.fisher_exact([[a, n1 - a], [b, n2 - b]], alternative="greater")
        assert math.isclose(studies.fisher_one_sided(a, n1, b, n2), p, rel_tol=1e-9)


def test_rounding_rule():
    assert studies.f3(0.87149) == "0.871" and studies.f3(0.8716) == "0.872"
    assert studies.f3(-0.0004) == "0.000" and studies.f3(-0.031) == "−0.031"
    assert studies.sig3(0.5397) == "0.540" and studies.sig3(39.1056) == "39.1"
    assert studies.sig3(1771.36) == "1,771"
    assert studies.rate("0.003") == "3e-3" and studies.rate(0.01) == "1e-2"


def test_a_changed_results_file_changes_the_page(tmp_path, monkeypatch):
    """The comparison can fail: one accuracy changed in a copy of the results makes the MQAR
    page's table differ from the committed one."""
    results = tmp_path / "results"
    shutil.copytree(ROOT / "docs/results", results, ignore=shutil.ignore_patterns("*.png"))
    path = results / "mqar_sweep_cpu.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    point = "d_model-64_lr-0.03_mixer-softmax_seed-0_task-64x8"  # a tuned cell's run
    row = next(r for r in rows if r["point"] == point)
    row["eval/accuracy"] = "0.5"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    monkeypatch.setattr(studies, "RESULTS", results)
    page = (ROOT / "docs/studies/mqar.md").read_text()
    assert studies.fill(page) != page


LINK = re.compile(r"\]\((\.\./results/[^)#]+|docs/results/[^)#]+)\)")
FIGURE = re.compile(r"(?<![\d.])−?\d+\.\d{3}(?!\d)")  # a three-decimal figure in the text


def _numbers(obj):
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _numbers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _numbers(value)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield float(obj)
    elif isinstance(obj, str):
        yield from (float(m) for m in re.findall(r"-?\d+\.\d+", obj))


def _file_numbers(path):
    if path.suffix == ".json":
        return set(_numbers(json.loads(path.read_text())))
    if path.suffix not in (".md", ".txt"):
        return set()  # a figure; or a csv, whose figures the generated tables carry
    text = path.read_text()
    return {float(m) for m in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_figures_in_the_text_come_from_a_table_or_a_linked_file(page):
    """Every three-decimal figure in a page's prose is one of its generated tables' figures or a
    value of a json, md or txt results file the page links (rounded by the pages' one rule); a
    linked csv counts through the tables made from it. (A difference is written to four
    decimals, as taken in the file.)"""
    text = page.read_text()
    tables = "".join(m[0] for m in studies.BLOCK.finditer(text))
    prose = studies.BLOCK.sub("", text)
    in_tables = {float(n.replace("−", "-")) for n in FIGURE.findall(tables)}
    known = {studies.f3(v) for v in in_tables}
    for link in LINK.findall(prose):
        path = page.parent / link if link.startswith("..") else ROOT / link
        assert path.exists(), f"{page.name} links {link}, which does not exist"
        known |= {studies.f3(v) for v in _file_numbers(path)}
    unknown = [n for n in FIGURE.findall(prose) if n not in known]
    assert not unknown, f"{page.name}: figures in no table or linked file: {unknown}"

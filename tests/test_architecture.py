"""docs/architecture.md is the contract, so it names only what exists: every public name it writes
as `K.<name>`, `layers.<name>`, `models.<name>`, `training.<name>` or `linear_attention.<module>`,
every folder and file of the package it names, and every registered mixer; and the other
documents point at it, not at a file outside the repository."""

import importlib
import re

import pytest

from linear_attention import kernels, layers, models, training
from tests.scripts import ROOT

PAGE = (ROOT / "docs" / "architecture.md").read_text()
CODE = re.findall(r"`([^`\n]+)`", PAGE)
NAMESPACES = {"K": kernels, "layers": layers, "models": models, "training": training}


def _dotted_names():
    for span in CODE:
        yield from re.findall(r"\b(K|layers|models|training)\.([A-Za-z_]\w*)", span)


@pytest.mark.parametrize("prefix, name", sorted(set(_dotted_names())))
def test_every_public_name_exists(prefix, name):
    assert hasattr(NAMESPACES[prefix], name), f"docs/architecture.md names {prefix}.{name}"


def test_every_module_and_path_exists():
    modules = {m for span in CODE for m in re.findall(r"\blinear_attention(?:\.\w+)+", span)}
    assert modules
    for module in sorted(modules):
        importlib.import_module(module)
    paths = {
        p
        for span in CODE
        for p in re.findall(
            r"(?<![\w/])((?:kernels|layers|models|training|data|tests)/[\w/]*(?:\.py)?)", span
        )
    }
    paths |= set(re.findall(r"linear_attention/([\w/]+\.py)", PAGE))
    assert paths
    for path in sorted(paths):
        target = ROOT / path if path.startswith("tests/") else ROOT / "linear_attention" / path
        assert target.exists(), f"docs/architecture.md names {path}"


def test_every_registered_mixer_is_named():
    named = set(CODE)
    missing = sorted(name for name in layers.MIXERS if name not in named)
    assert not missing, f"docs/architecture.md does not name the mixers {missing}"


def test_documents_point_at_the_page_in_the_repository():
    pages = [ROOT / "README.md", ROOT / "EXPERIMENTS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    stale = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in pages
        if "results" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), start=1)
        if re.search(r"ARCHITECTURE(\.md| §)", line)
    ]
    assert not stale, f"point these at docs/architecture.md: {stale}"

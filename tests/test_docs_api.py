"""The API reference (docs/apiref.py, built by `sphinx-build`) covers every public name of
`kernels`, `layers`, `models`, `training`, `data` and `evals`: each name of their `__all__` has
a section on its package's page and resolves to a definition in a module's source, which
autodoc2 reads.
No Sphinx here: the build itself runs in CI (`.ci/run`)."""

import pytest

from tests.scripts import ROOT, load_module

apiref = load_module("docs/apiref.py", "docs_apiref")


@pytest.mark.parametrize("package", apiref.PACKAGES)
def test_reference_lists_every_public_name(package):
    page = apiref.page(package)
    for name, path in apiref.definitions(package).items():
        assert f"## `{name}`" in page, f"{package}.{name} has no section"
        assert "```{autodoc2-object} " + path in page, f"{package}.{name} is not rendered"
        assert apiref.defined_in_source(path), f"{package}.{name}: no definition at {path}"


def test_reference_pages_are_in_the_toctree():
    index = (ROOT / "docs" / "index.md").read_text()
    for package in apiref.PACKAGES:
        assert f"api/{package}" in index, f"docs/index.md does not list api/{package}"

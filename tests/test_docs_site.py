"""The documentation site's setup (issue 75), checked without building it: one sidebar entry
per page (no document in two toctrees), MyST dollarmath on with the kernels guide's maths in
$...$, scrolling code blocks, a landing page with the quick start and the recall figure; and the
API reference's parts: Returns sections keep their code whole, dataclass fields show their
defaults, constants come after the functions."""

import ast
import dataclasses
import re

from linear_attention import kernels as K
from linear_attention.layers.log_linear import LogLinearConfig
from linear_attention.models.config import ModelConfig
from tests.scripts import ROOT, load_module

DOCS = ROOT / "docs"
TOCTREE = re.compile(r"^```\{toctree\}\n(.*?)^```", re.MULTILINE | re.DOTALL)
docstring_md = load_module("docs/docstring_md.py", "docs_docstring_md")
render_md = load_module("docs/render_md.py", "docs_render_md")
apiref = load_module("docs/apiref.py", "docs_apiref_site")


def conf_value(name: str):
    """A top-level assignment of docs/conf.py, read without running it (it writes pages)."""
    for node in ast.parse((DOCS / "conf.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(name)


def toctree_documents(page):
    """The documents the toctrees of `page` list (globs expanded), in order."""
    docs = []
    for body in TOCTREE.findall(page.read_text()):
        entries = [line.strip() for line in body.splitlines()]
        for entry in entries:
            if not entry or entry.startswith(":"):
                continue
            base = page.parent
            if "*" in entry:
                docs += sorted(
                    str(p.relative_to(DOCS).with_suffix("")) for p in base.glob(f"{entry}.md")
                )
            else:
                docs.append(str((base / entry).relative_to(DOCS)))
    return docs


def test_no_document_is_in_two_toctrees():
    listed = [doc for page in DOCS.rglob("*.md") for doc in toctree_documents(page)]
    twice = sorted({doc for doc in listed if listed.count(doc) > 1})
    assert not twice, f"listed more than once (a duplicate sidebar entry): {twice}"
    assert "results/mqar_sweep_cpu" in listed and "guides/kernels" in listed


def test_maths_and_code_blocks():
    assert "dollarmath" in conf_value("myst_enable_extensions")
    css = conf_value("html_css_files")
    assert all((DOCS / "_static" / name).exists() for name in css)
    assert "overflow-x: auto" in (DOCS / "_static" / css[0]).read_text()
    guide = (DOCS / "guides" / "kernels.md").read_text()
    recurrences = guide.split("## The recurrences")[1].split("\n## ")[0]
    assert "$$\n\\begin{aligned}" in recurrences
    table = [line for line in recurrences.splitlines() if line.startswith("| `")]
    assert all(line.count("$") >= 2 for line in table)
    # A row per kernel family but linear attention's, whose recurrence is the display above.
    named = {line.split("`")[1] for line in table}
    assert named == set(K.FAMILIES) - {"causal_linear_attention"}


def test_landing_page():
    index = (DOCS / "index.md").read_text()
    assert "## Quick start" in index
    assert "la-train --config configs/mqar.py:cpu --workdir runs/mqar" in index
    figure = re.search(r"!\[[^\]]*\]\((figures/mqar_accuracy_vs_state_bytes\.png)\)", index)
    assert figure and (DOCS / figure[1]).exists()


def test_returns_sections_keep_their_code():
    text = (
        "Doc.\n\nArgs:\n  q, k: `[B, T, H, M]`.\n  eps: a float.\nReturns:\n"
        "  `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state` the state.\n"
    )
    out = docstring_md.google_sections_to_markdown(text)
    assert "- `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state`" in out
    assert "- `eps`: a float." in out  # a real entry still gets its name set as code


def test_fields_show_their_defaults():
    value = render_md.field_value
    assert value("linear_attention.layers.log_linear.LogLinearConfig.num_levels") == "15"
    assert value("linear_attention.models.config.ModelConfig.mixer") == "'linear'"
    assert value("linear_attention.models.config.ModelConfig.vocab_size") == "(required)"
    assert value("linear_attention.data.configs.MQARDataConfig.vocab_size") == "(required)"
    assert value("linear_attention.models.config.ModelConfig.check") is None  # not a field
    assert dataclasses.is_dataclass(LogLinearConfig) and dataclasses.is_dataclass(ModelConfig)


def test_constants_come_after_the_functions():
    page = apiref.page("kernels")
    sections = re.findall(r"^## `(\w+)`", page, re.MULTILINE)
    kinds = [apiref.is_constant("kernels", name) for name in sections]
    assert kinds == sorted(kinds) and any(kinds) and not all(kinds)
    assert sections.index("METHODS") > sections.index("causal_linear_attention")


def test_every_page_is_in_a_toctree():
    """Each page has its one sidebar entry (no hidden glob catches a page left out)."""
    listed = {doc for page in DOCS.rglob("*.md") for doc in toctree_documents(page)}
    pages = {
        str(p.relative_to(DOCS).with_suffix(""))
        for p in DOCS.rglob("*.md")
        if p.parts[len(DOCS.parts)] not in ("api", "_build") and p.name != "index.md"
    }
    pages |= {f"api/{package}" for package in apiref.PACKAGES}
    assert pages - listed == set(), f"in no toctree: {sorted(pages - listed)}"

"""Sphinx configuration: MyST pages and an API reference generated from the docstrings.

Build (offline, warnings as errors): `sphinx-build -W --keep-going -b html docs docs/_build/html`.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import apiref  # noqa: E402  (docs/apiref.py, beside this file)
import options_table  # noqa: E402  (docs/options_table.py: the mixer options table)
import studies  # noqa: E402  (docs/studies.py: the study pages' tables from docs/results/)

project = "linear_attention"
author = "linear_attention authors"
copyright = "the linear_attention authors"

extensions = ["myst_parser", "autodoc2"]

# The reference: one page per package, a section per name of its `__all__` (docs/apiref.py),
# each rendered by autodoc2 from its defining module. Nothing is excluded.
apiref.write_pages()
autodoc2_packages = [{"path": "../linear_attention", "auto_mode": False}]
# The docstrings are Markdown-ish (single backticks for code, unicode math, Google-style
# sections): MyST, after docs/docstring_md.py turns the sections into lists.
autodoc2_docstring_parser_regexes = [(r".*", "docstring_md")]
# The pages are MyST, so autodoc2 writes MyST; docs/render_md.py shows dataclass fields'
# defaults (autodoc2 alone shows the helper call that declares them, e.g. `spec_field(...)`).
autodoc2_render_plugin = "render_md.Renderer"
autodoc2_hidden_objects = {"dunder", "private", "inherited"}

# dollarmath: $...$ and $$...$$ in the pages, rendered by MathJax (Sphinx's default HTML maths:
# the page loads it in the reader's browser; the build fetches nothing).
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

# A code block Pygments cannot lex (a shell line with a `<placeholder>` in it) is shown
# unhighlighted; that is cosmetic, not a broken page, so it does not fail the build.
suppress_warnings = ["misc.highlighting_failure"]

source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "linear_attention"
html_static_path = ["_static"]
html_css_files = ["custom.css"]  # wide code blocks and tables scroll, signatures wrap


def _title_results_files(app, docname, source):
    """Give a results table (docs/results/*.md, written by the sweeps without a heading) its
    file name as a title, so the results index can list it."""
    if docname.startswith("results/") and not source[0].lstrip().startswith("#"):
        source[0] = f"# `{docname}.md`\n\n{source[0]}"


def _fill_study_tables(app, docname, source):
    """Regenerate every marked table of a study page (docs/studies/*.md) from its results
    file as the page is read, so the site shows the file's figures even where the committed
    page lags (tests/test_docs_studies.py keeps the committed pages equal to this)."""
    if docname.startswith("studies/"):
        source[0] = studies.fill(source[0])


def _fill_options_table(app, docname, source):
    """The mixer options page's table, from the registered mixers' `Config` classes."""
    if docname == "guides/options":
        source[0] = options_table.fill(source[0])


def setup(app):
    app.connect("source-read", _title_results_files)
    app.connect("source-read", _fill_study_tables)
    app.connect("source-read", _fill_options_table)

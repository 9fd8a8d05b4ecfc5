"""Every registered mixer has its row in the one table of test cases (`tests/mixer_cases.py`)
and in the mixer table of docs/guides/models.md, and the rows say what the mixer does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from linear_attention.layers import MIXERS, Mixer
from tests.mixer_cases import MIXER_CASES

MODELS_GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "models.md"


def test_every_registered_mixer_has_a_test_row():
    missing = sorted(set(MIXERS) - set(MIXER_CASES))
    assert not missing, f"add a row to tests/mixer_cases.py for {missing}"
    assert not set(MIXER_CASES) - set(MIXERS), "a row of tests/mixer_cases.py names no mixer"


def test_rows_agree_with_the_mixers():
    """The row's time split is the mixer's own flag, it decodes where it makes a decoding
    state, and its small options make a config."""
    for name, case in MIXER_CASES.items():
        cls = MIXERS[name]
        assert case.splits_time == cls.SEQUENCE_PARALLEL, name
        assert case.decodes == (cls._init_core is not Mixer._init_core), name
        cls.check_options(16, 2, **case.options)


def _docs_rows() -> dict[str, str]:
    """{name: kernel column} of the table under "## The mixers"."""
    text = MODELS_GUIDE.read_text().split("## The mixers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|.*\| (.*) \|$", text, flags=re.M)
    return dict(rows)


def test_every_registered_mixer_has_a_docs_row_naming_its_kernel():
    rows = _docs_rows()
    missing = sorted(set(MIXERS) - set(rows))
    assert not missing, f"add a row to the mixer table of {MODELS_GUIDE.name} for {missing}"
    for name, cls in MIXERS.items():
        if cls.FAMILY is not None:  # (the kernel column names the family's entry point)
            assert f"`{cls.FAMILY.name}`" in rows[name], (name, rows[name])


def test_a_config_with_an_old_method_word_warns_and_loads_the_new_one():
    """A saved config's `method: blockwise` (fox, path) or `recurrent` (mesanet) still loads:
    a `DeprecationWarning` naming the new word, and the config holds the new word."""
    for name, old, new in (("fox", "blockwise", "chunk"), ("mesanet", "recurrent", "scan")):
        with pytest.warns(DeprecationWarning, match=f"mixer '{name}': method '{old}' is now"):
            config = MIXERS[name].make_config(16, 2, method=old)
        assert config.method == new
    with pytest.raises(ValueError, match="unknown method 'recurrent' for mixer 'path'"):
        MIXERS["path"].make_config(16, 2, method="recurrent")

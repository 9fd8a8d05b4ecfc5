"""The mixer options page (docs/guides/options.md): its generated table has a row for every
option of the registered mixers' `Config` classes, naming every mixer that takes it with its
default, and its Python examples build the configs they describe."""

import dataclasses
import re

from linear_attention import models
from linear_attention.layers import MIXERS
from tests.scripts import ROOT, load_module

options_table = load_module("docs/options_table.py", "docs_options_table")
PAGE = ROOT / "docs" / "guides" / "options.md"


def test_the_table_lists_every_mixer_option_with_its_mixers_and_defaults():
    rows = {name: (kind, takers) for name, kind, takers, _ in options_table.rows()}
    for cls in MIXERS.values():
        defaults = {f.name: f.default for f in dataclasses.fields(cls.Config)}
        for option in cls.Config.own_options():
            default, _, takers = rows[option][1].partition(": ")
            entry = next(t for t in takers.split(", ") if t.split(" ")[0] == cls.NAME)
            own = entry.partition(" ")[2]  # "(default)" where it differs from the first one's
            assert (own or default) == (
                f"({defaults[option]!r})" if own else repr(defaults[option])
            )
    block = options_table.BLOCK.search(options_table.fill(PAGE.read_text()))[2]
    assert block.count("\n| `") == len(rows) and all(f"| `{o}` |" in block for o in rows)


def test_the_page_examples_build_their_configs():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    namespace = {"models": models}
    ran = [b for b in blocks if "models.ModelConfig(" in b]
    for block in ran:
        exec(block.replace("from linear_attention import models\n", ""), namespace)
    assert len(ran) == 2
    assert namespace["config"].mixer_config("gated").state_dim == 16
    assert namespace["config"].mixer_config("softmax").num_kv_heads == 1
    based, hybrid = namespace["based"], namespace["hybrid"]
    assert (based.mixer_config("taylor").feature_dim, based.mixer_config("swa").window) == (16, 64)
    assert hybrid.mixer_config("gated_deltanet").num_value_heads == 8
    assert hybrid.layer_num_heads("softmax") == 8 and hybrid.mixer_config("softmax").rope

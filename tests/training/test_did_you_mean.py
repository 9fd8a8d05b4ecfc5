"""A misspelled mixer, preset, task or choice is refused with the closest name (issue 75): one
helper, `fields.did_you_mean`, in every such message."""

import pytest

from linear_attention import fields
from linear_attention.data.mad import mad_changes
from linear_attention.data.state_tracking import check_task
from linear_attention.layers import get_mixer
from linear_attention.models.config import ModelConfig
from tests.scripts import load_module


def test_the_helper():
    assert fields.closest("gated_deltanett", ("gated", "gated_deltanet")) == "gated_deltanet"
    assert fields.did_you_mean("zzzz", ("gated", "linear")) == ""  # nothing close: no guess
    assert fields.did_you_mean(3, ("gated",)) == ""  # not a name
    with pytest.raises(ValueError, match=r"unknown m 'chunck' \(did you mean 'chunk'\?\); allowed"):
        fields.check_choice("m", "chunck", ("chunk", "scan"))


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: get_mixer("gated_detlanet"),
            "unknown mixer 'gated_detlanet' .did you mean 'gated_deltanet'",
        ),
        (lambda: ModelConfig(vocab_size=8, mixer="mesa_net"), "did you mean 'mesanet'"),
        (
            lambda: ModelConfig(vocab_size=8, mixer="linear", options=dict(method="chunck")),
            "did you mean 'chunk'",
        ),
        (lambda: mad_changes("in_context_recal"), "did you mean 'in_context_recall'"),
        (lambda: check_task("s33"), "did you mean 's3'"),
        (
            lambda: load_module("configs/mqar.py", "mqar_dym").get_config("cpuu"),
            "did you mean 'cpu'",
        ),
        (lambda: load_module("configs/lm.py", "lm_dym").get_config("smok"), "did you mean 'smoke'"),
        (
            lambda: load_module("configs/state_tracking.py", "st_dym").get_config("s3_papr"),
            "did you mean 's3_paper'",
        ),
        (
            lambda: load_module("configs/mad.py", "mad_dym").get_config("compresion"),
            "did you mean 'compression'",
        ),
    ],
)
def test_names_get_a_suggestion(make, message):
    with pytest.raises(ValueError, match=message):
        make()

"""experiments/decay_init_swap.py: a model built under `decays_from` has the donor's decay
parameters and its own seed's other weights; the printed rates are A·softplus(b)."""

import argparse

import jax
import numpy as np
import pytest
from flax import nnx

from linear_attention.models import LanguageModel, ModelConfig
from tests.scripts import load_module


@pytest.fixture(scope="module")
def swap():
    return load_module("experiments/decay_init_swap.py", "decay_init_swap")


def test_decays_come_from_the_donor_and_the_rest_from_the_seed(swap):
    cfg = ModelConfig(vocab_size=16, d_model=16, num_layers=2, num_heads=2, mixer="gated")
    donor = swap.decay_params(LanguageModel(cfg, rngs=nnx.Rngs(0)))
    own = LanguageModel(cfg, rngs=nnx.Rngs(1))
    with swap.decays_from(donor):
        swapped = LanguageModel(cfg, rngs=nnx.Rngs(1))
    assert swap.GatedMixer._build.__name__ == "_build"  # restored
    for (a, b), (a_d, b_d), (a_o, _) in zip(
        swap.decay_params(swapped), donor, swap.decay_params(own), strict=True
    ):
        np.testing.assert_array_equal(a, a_d)
        np.testing.assert_array_equal(b, b_d)
        assert not np.array_equal(a, a_o)  # the seeds do draw different decays
    for block, block_own in zip(swapped.blocks, own.blocks, strict=True):
        np.testing.assert_array_equal(
            block.mixer.decay.proj.kernel[...], block_own.mixer.decay.proj.kernel[...]
        )
    rates = swap.memory_rates(donor)
    a, b = donor[0]
    expected = np.exp(a) * np.log1p(np.exp(np.asarray(b, np.float64)))
    np.testing.assert_allclose(rates[0], expected, atol=1e-4)
    assert all(0.0 < r < 16 * 0.1 + 1e-3 for layer in rates for r in layer)  # A·dt ≤ 16·0.1
    assert jax.tree.leaves(nnx.state(swapped, nnx.Param))  # still a whole model


def test_pairs_parse_or_name_the_expected_form(swap):
    assert swap._pair("1:0") == (1, 0)
    with pytest.raises(argparse.ArgumentTypeError, match="SEED:DECAY_SEED"):
        swap._pair("1-0")

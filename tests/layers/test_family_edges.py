"""Edges of the newer mixers (issue 75): a log-linear prefill or step past the positions its
levels cover is refused, a model whose `max_length` its `num_levels` do not cover is refused,
`method="pallas"` with a chunk size its blocks do not tile is refused in the config; the
fixed-state mixers (lstm, mesanet) give the full pass's numbers for a prefill past
`init_state`'s `max_length` (it sizes only the caches that grow)."""

import jax
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import get_mixer
from linear_attention.models.config import ModelConfig

D, H = 16, 2


def x_of(t, seed=0):
    return jax.random.normal(jax.random.key(seed), (1, t, D))


@pytest.mark.parametrize("name", ["log_linear_mamba2", "log_linear_gated_deltanet"])
def test_log_linear_prefill_past_the_levels_is_refused(name):
    mixer = get_mixer(name)(D, H, num_levels=4, chunk_size=4, rngs=nnx.Rngs(0))  # positions < 8
    state = mixer.init_state(1, 8)
    _, state = mixer.prefill(x_of(6), state)
    with pytest.raises(ValueError, match=r"cannot take 3 token\(s\) after position 6: num_levels"):
        mixer.prefill(x_of(3), state)
    _, state = mixer.prefill(x_of(2), state)  # exactly to the end: fine
    with pytest.raises(ValueError, match=r"cannot take 1 token\(s\) after position 8"):
        mixer.step(x_of(1)[:, 0], state)


@pytest.mark.parametrize("name", ["lstm", "mesanet"])
def test_fixed_state_prefill_past_max_length_is_the_full_pass(name):
    mixer = get_mixer(name)(D, H, rngs=nnx.Rngs(0))
    x = x_of(12, seed=1)
    y, _ = mixer.prefill(x, mixer.init_state(1, 4))
    np.testing.assert_allclose(y, mixer(x), rtol=2e-5, atol=2e-5)


def test_model_refuses_num_levels_that_do_not_cover_max_length():
    base = dict(vocab_size=16, d_model=D, num_layers=1, num_heads=H, options=dict(num_levels=5))
    for mixer in ("log_linear_mamba2", "log_linear_gated_deltanet"):
        ModelConfig(**base, mixer=mixer, max_length=16)  # 2^(5-1) = 16: covered
        with pytest.raises(ValueError, match=r"num_levels=5 of mixer .* max_length=17 needs "):
            ModelConfig(**base, mixer=mixer, max_length=17)
    with pytest.raises(ValueError, match=r"needs num_levels >= 12 \(log2\(max_length\) \+ 1\)"):
        ModelConfig(
            **{**base, "options": dict(num_levels=11)}, mixer="log_linear_mamba2", max_length=2048
        )


@pytest.mark.parametrize("mixer", ["linear", "gated_deltanet", "kda", "gated_deltaproduct"])
def test_pallas_chunk_size_must_tile(mixer):
    base = dict(vocab_size=16, d_model=D, num_heads=H, mixer=mixer)
    with pytest.raises(ValueError, match=r"chunk_size must be a multiple of 16 .* got 20"):
        ModelConfig(**base, options=dict(method="pallas", chunk_size=20))
    config = ModelConfig(**base, options=dict(method="pallas", chunk_size=32))
    assert config.mixer_config(mixer).chunk_size == 32

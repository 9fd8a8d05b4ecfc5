"""A decoding state carries its mixer's kind: a state of one mixer is refused by another of the
same shapes (kda and gated_deltanet states are both [B, H, K, Dv]), by the model and by a
layer alone; a state built by hand (kind "") is taken as before."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import MixerState
from linear_attention.models import LanguageModel, ModelConfig


def _model(mixer):
    config = ModelConfig(
        vocab_size=32, d_model=32, num_layers=1, num_heads=2, mixer=mixer, max_length=16
    )
    return LanguageModel(config, rngs=nnx.Rngs(0))


def test_another_mixers_state_is_refused():
    kda, gdn = _model("kda"), _model("gated_deltanet")
    state = kda.init_state(2)
    other = gdn.init_state(2)
    assert state.layers[0].kind == "kda" and other.layers[0].kind == "gated_deltanet"
    assert jax.tree.map(jnp.shape, state.layers[0].core) == jax.tree.map(
        jnp.shape, other.layers[0].core
    )  # the same shapes: only the kind tells them apart
    token = jnp.zeros((2,), jnp.int32)
    with pytest.raises(
        ValueError, match=r"layers\[0\] \(gated_deltanet\) was made by a .kda. mixer"
    ):
        gdn.step(token, state)
    mixer = gdn.blocks[0].mixer
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="the state was made by a 'kda' mixer; this layer is"):
        mixer.step(x, state.layers[0])
    # the kind survives a step (under jit too) and a state built by hand is still taken
    _, after = jax.jit(kda.step)(token, state)
    assert after.layers[0].kind == "kda"
    layer = other.layers[0]
    y_hand, _ = mixer.step(x, MixerState(layer.core, layer.conv, layer.position))
    y_own, _ = mixer.step(x, layer)
    np.testing.assert_array_equal(np.asarray(y_hand), np.asarray(y_own))
    hand = other._replace(layers=(MixerState(layer.core, layer.conv, layer.position),))
    logits_hand, _ = gdn.step(token, hand)
    logits_own, _ = gdn.step(token, other)
    np.testing.assert_array_equal(np.asarray(logits_hand), np.asarray(logits_own))

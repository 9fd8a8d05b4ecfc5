"""The fox mixer's forget gate starts where `forget_bias` puts it: f = sigmoid(b) for a zero
input (the paper's b = 0 gives f = 1/2), and a large bias makes the layer softmax attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers.registry import get_mixer

D, H = 8, 2


def fox(**options):
    return get_mixer("fox")(D, H, **options, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bias", [0.0, 5.0, -2.0])
def test_the_gate_starts_at_sigmoid_of_the_bias(bias):
    log_f = fox(forget_bias=bias).log_forget(jnp.zeros((1, 3, D)))
    np.testing.assert_allclose(np.exp(log_f), 1.0 / (1.0 + np.exp(-bias)), rtol=1e-6)


def test_an_open_gate_is_softmax_attention():
    """With b = 30 the gate's log is ~1e-13 per token: the same output as the softmax mixer
    given the same projections (copied over)."""
    x = jax.random.normal(jax.random.key(1), (2, 7, D))
    f, s = fox(forget_bias=30.0), get_mixer("softmax")(D, H, rngs=nnx.Rngs(0))
    nnx.update(s, nnx.state(f, nnx.Not(nnx.PathContains("forget_gate"))))
    np.testing.assert_allclose(f(x), s(x), rtol=1e-5, atol=1e-6)

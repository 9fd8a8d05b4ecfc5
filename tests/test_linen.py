"""Linen wrappers (flax.nnx.bridge): same numbers as the NNX mixers with copied parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from linear_attention import linen as la_linen
from linear_attention.layers import FeatureProjection, get_mixer
from tests.mixer_cases import MIXER_CASES

B, T, D, H = 2, 12, 16, 2
OPTIONS = {name: case.options for name, case in MIXER_CASES.items()}


def nnx_variables(module) -> dict:
    """An NNX module's variables laid out as Linen collections."""
    variables = {"params": nnx.to_pure_dict(nnx.state(module, nnx.Param))}
    projections = nnx.state(module, FeatureProjection)
    if jax.tree.leaves(projections):
        variables["FeatureProjection"] = nnx.to_pure_dict(projections)
    return variables


# The bridge is one generic wrapper: the default run keeps the mixers whose variables or state
# differ in kind (rope, feature projections, a ring-buffer cache, the delta rule's conv state,
# grouped value heads, token shift: `MixerCase.linen_fast`); the rest run under `-m slow`.
LINEN_FAST = tuple(name for name, case in MIXER_CASES.items() if case.linen_fast)


@pytest.mark.parametrize(
    "name",
    [n if n in LINEN_FAST else pytest.param(n, marks=pytest.mark.slow) for n in OPTIONS],
)
def test_linen_wrapper_matches_nnx_module(name):
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    module = get_mixer(name)(D, H, **OPTIONS[name], rngs=nnx.Rngs(5))
    layer = la_linen.mixer(name, D, H, **OPTIONS[name])
    # the Linen variables have exactly the NNX module's tree (checked abstractly: no compile)
    abstract = jax.eval_shape(layer.init, jax.random.key(1), x)
    copied = nnx_variables(module)
    assert jax.tree.map(jnp.shape, copied) == jax.tree.map(lambda s: s.shape, dict(abstract))

    @jax.jit
    def apply(variables, x):
        y = layer.apply(variables, x)
        y_prefill, state = layer.apply(variables, x, module.init_state(B, T), nnx_method="prefill")
        return y, y_prefill, state.position

    y, y_prefill, position = apply(copied, x)
    expected = nnx.jit(lambda m, x: m(x))(module, x)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_prefill, expected, rtol=1e-4, atol=1e-4)
    assert int(position) == T


class TinyLinenModel(nn.Module):
    """A Linen model that uses a mixer as a submodule."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="embed")(x)
        return x + la_linen.retnet(D, H, conv=True, linen_name="mixer")(x)


def test_mixer_inside_a_linen_model():
    x = jax.random.normal(jax.random.key(0), (B, T, 3))
    model = TinyLinenModel()
    variables = jax.jit(model.init)(jax.random.key(1), x)
    assert set(variables["params"]) == {"embed", "mixer"}
    y = jax.jit(model.apply)(variables, x)
    # the same with the NNX mixer and the Linen Dense by hand
    mixer = get_mixer("retnet")(D, H, conv=True, rngs=nnx.Rngs(0))
    nnx.update(mixer, nnx.State(variables["params"]["mixer"]))
    h = x @ variables["params"]["embed"]["kernel"] + variables["params"]["embed"]["bias"]
    np.testing.assert_allclose(y, h + nnx.jit(lambda m, h: m(h))(mixer, h), rtol=1e-5, atol=1e-5)
    loss = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)  # noqa: E731
    grads = jax.jit(jax.grad(loss))(variables["params"])
    assert float(jnp.abs(grads["mixer"]["inputs"]["qkv_proj"]["kernel"]).max()) > 0


def test_packed_rows_through_the_wrapper():
    """`segment_ids` reach the NNX mixer through the bridge (gla: vector decay, conv, resets)."""
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    segments = jnp.asarray([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3], jnp.int32)
    module = get_mixer("gla")(D, H, conv=True, rngs=nnx.Rngs(5))
    layer = la_linen.gla(D, H, conv=True)
    y = jax.jit(layer.apply)(nnx_variables(module), x, segments)
    expected = nnx.jit(lambda m, x, s: m(x, s))(module, x, segments)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(y, nnx.jit(lambda m, x: m(x))(module, x), atol=1e-4)


def test_bad_options_raise_when_the_wrapper_is_made():
    with pytest.raises(ValueError, match="unknown mixer 'hyena'"):
        la_linen.mixer("hyena", D, H)
    with pytest.raises(ValueError, match="does not use option feature_map"):
        la_linen.mixer("favor", D, H, feature_map="relu")
    with pytest.raises(ValueError, match="not divisible"):
        la_linen.softmax(15, H)

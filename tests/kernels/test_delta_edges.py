"""Edges of the delta family: an empty batch gives empty outputs and state by every method
(the chunk forms crashed on it); zero-width keys and n = 0 sub-steps are errors naming the
shape; β holding NaN is reported as NaN, with where it is."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K

T, H, D = 6, 2, 4


def _x(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _calls(B, n=2, Kd=D):
    beta = jax.nn.sigmoid(_x(B, T, H))
    return {
        "kda": lambda m: K.delta_rule(
            _x(B, T, H, Kd), _x(B, T, H, Kd), _x(B, T, H, D), beta,
            log_decay=-jax.nn.softplus(_x(B, T, H, Kd)), method=m, chunk_size=4,
            return_state=True,
        ),
        "dplr": lambda m: K.dplr_delta_rule(
            _x(B, T, H, Kd), _x(B, T, H, Kd), _x(B, T, H, D), _x(B, T, H, Kd), _x(B, T, H, Kd),
            method=m, chunk_size=4, return_state=True,
        ),
        "delta_product": lambda m: K.delta_product(
            _x(B, T, H, Kd), _x(B, T, H, n, Kd), _x(B, T, H, n, D),
            jax.nn.sigmoid(_x(B, T, H, n)), method=m, chunk_size=4, return_state=True,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("method", ["chunk", "scan"])
@pytest.mark.parametrize("name", ["kda", "dplr", "delta_product"])
def test_an_empty_batch_gives_empty_outputs(name, method):
    o, state = _calls(0)[name](method)
    assert o.shape == (0, T, H, D) and o.dtype == jnp.float32
    assert state.kv.shape == (0, H, D, D) and state.kv.dtype == jnp.float32


@pytest.mark.parametrize("method", ["chunk", "scan"])
def test_zero_sub_steps_and_zero_width_keys_are_errors(method):
    with pytest.raises(ValueError, match=r"k has shape \(1, 6, 2, 0, 4\) \[B, T, H, n, K\]: n = 0"):
        _calls(1, n=0)["delta_product"](method)
    for name in ("kda", "dplr", "delta_product"):
        with pytest.raises(ValueError, match=r"K = 0, keys need at least one channel"):
            _calls(1, Kd=0)[name](method)
    q = _x(1, T, H, 0)
    with pytest.raises(ValueError, match=r"q has shape \(1, 6, 2, 0\) \[B, T, H, K\]: K = 0"):
        K.delta_rule(q, q, _x(1, T, H, D), jax.nn.sigmoid(_x(1, T, H)), method=method)
    state = K.LinearAttentionState(kv=jnp.zeros((1, H, D, D)), k_sum=None)
    with pytest.raises(ValueError, match=r"n = 0, a token needs n >= 1 sub-steps"):
        K.delta_product_step(
            state, _x(1, H, D), _x(1, H, 0, D), _x(1, H, 0, D), jnp.zeros((1, H, 0))
        )


def test_nan_beta_is_reported_as_nan():
    beta = jnp.full((1, T, H), 0.5).at[0, 3, 1].set(jnp.nan)
    q = _x(1, T, H, D)
    with pytest.raises(ValueError) as e:
        K.delta_rule(q, q, q, beta)
    assert str(e.value) == (
        "beta holds NaN (1 of 12 values, the first at index (0, 3, 1)); it must lie in [0, 2]"
    )
    with pytest.raises(ValueError, match=r"got values in \[0.5, 2.5\]"):  # no NaN: the range
        K.delta_rule(q, q, q, beta.at[0, 3, 1].set(2.5))

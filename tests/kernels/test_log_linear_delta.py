"""Log-linear Gated DeltaNet: every method, states, decoding steps and gradients against the
float64 loop of `reference.py` (delta-rule blocks of a binary counter)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import log_linear_delta_rule_loop, rel_err

B, H, D, DV, L = 2, 2, 4, 3, 6  # L = 6 covers positions below 32
T = 21


def inputs(seed=0, t=T):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (B, t, H, D))
    k = jax.random.normal(keys[1], (B, t, H, D))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # unit keys, as the mixer gives
    v = jax.random.normal(keys[2], (B, t, H, DV))
    beta = 2.0 * jax.nn.sigmoid(jax.random.normal(keys[3], (B, t, H)))  # (0, 2)
    a = jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, t, H)) + 2.0)
    lam = jax.nn.softplus(jax.random.normal(keys[5], (B, t, H, L)))
    return q, k, v, beta, a, lam


@functools.partial(jax.jit, static_argnames=("method", "chunk_size", "states"))
def run(q, k, v, beta, a, lam, seg=None, state=None, *, method, chunk_size=4, states=True):
    return K.log_linear_delta_rule(
        q, k, v, beta, a, lam, segment_ids=seg, method=method, chunk_size=chunk_size,
        initial_state=state, return_state=states,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["chunk", "scan"])
@pytest.mark.parametrize("case", ["plain", "reset", "segments", "state"])
def test_matches_the_float64_loop(method, case):
    q, k, v, beta, a, lam = inputs()
    seg, state = None, None
    if case == "reset":
        a = a.at[0, 9, 1].set(-jnp.inf)
    if case == "segments":  # folded into −inf resets: the loop sees them as such
        seg = jnp.asarray([[0] * 8 + [1] * 13, [3] * 17 + [4] * 4], jnp.int32)
    if case == "state":
        position = np.array([[5, 2], [9, 0]])
        levels = jax.random.normal(jax.random.key(7), (B, H, L, D, DV)) * 0.3
        levels = levels * (((position[..., None] >> np.arange(L)) & 1)[..., None, None])
        state = K.LogLinearState(levels, jnp.asarray(position, jnp.int32))
    o, s = run(q, k, v, beta, a, lam, seg, state, method=method)
    a_ref = a
    if seg is not None:
        starts = np.pad(np.diff(np.asarray(seg), axis=1) != 0, ((0, 0), (1, 0)))
        a_ref = np.where(starts[..., None], -np.inf, np.asarray(a))
    o_ref, s_ref, p_ref = log_linear_delta_rule_loop(
        q, k, v, beta, a_ref, lam,
        s0=None if state is None else state.levels,
        position=None if state is None else state.position,
    )  # fmt: skip
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s.levels, s_ref) < 1e-4
    np.testing.assert_array_equal(s.position, p_ref)
    if state is None and method == "chunk":  # the quadratic reference agrees where it applies
        oq = run(q, k, v, beta, a, lam, seg, method="quadratic", states=False)
        assert rel_err(oq, o_ref) < 1e-4


def test_steps_and_gradients():
    q, k, v, beta, a, lam = inputs(seed=3, t=13)
    full, s_full = run(q, k, v, beta, a, lam, method="chunk", chunk_size=5)
    state = K.LogLinearState.zeros(B, H, L, D, DV)
    step = jax.jit(K.log_linear_delta_rule_step)
    outs = []
    for t in range(13):
        o, state = step(state, q[:, t], k[:, t], v[:, t], beta[:, t], a[:, t], lam[:, t])
        outs.append(o)
    assert rel_err(jnp.stack(outs, 1), full) < 1e-5 and rel_err(state.levels, s_full.levels) < 1e-5
    w = jax.random.normal(jax.random.key(9), full.shape)

    def loss(method):
        def f(*args):
            return jnp.sum(K.log_linear_delta_rule(*args, method=method, chunk_size=5) * w)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))

    ref = loss("quadratic")(q, k, v, beta, a, lam)
    for method in ("chunk", "scan"):
        for g, r in zip(loss(method)(q, k, v, beta, a, lam), ref, strict=True):
            assert rel_err(g, r) < 1e-4, method


def test_bad_inputs_raise():
    q, k, v, beta, a, lam = inputs(seed=1, t=5)
    with pytest.raises(ValueError, match="method 'quadratic' .* has no states"):
        K.log_linear_delta_rule(q, k, v, beta, a, lam, method="quadratic", return_state=True)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
        K.log_linear_delta_rule(q, k, v, 3.0 * beta, a, lam)
    with pytest.raises(ValueError, match="no sequence-parallel form"):
        K.log_linear_delta_rule(q, k, v, beta, a, lam, axis_name="seq")

"""Adversarial kernel inputs (issue 14): −inf log decays are resets in every method, a NaN key or
value never reaches earlier outputs, bad dtypes and scalars raise, and edge shapes either work or
raise a clear ValueError. Each case failed (wrong numbers, NaN, silent acceptance or an unclear
crash) before it was fixed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import causal_linear_attention_loop, rel_err

METHODS = K.METHODS
B, T, H, M, DV = 2, 10, 2, 3, 2


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = np.abs(rng.normal(size=(B, T, H, M))) + 0.1
    k = np.abs(rng.normal(size=(B, T, H, M))) + 0.1
    v = rng.normal(size=(B, T, H, DV))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


# ---- −inf log decay: a reset, in every method, with the chunk boundaries anywhere ----


@pytest.mark.parametrize("method", METHODS)
def test_minus_inf_log_decay_is_a_reset(method):
    q, k, v = inputs(1)
    a = np.full((B, T, H), -0.2, np.float32)
    a[0, 0] = -np.inf  # at the first token: the initial state is dropped
    a[0, 3, 1] = a[0, 4, 1] = -np.inf  # two in a row, one head
    a[1, 6] = -np.inf  # mid-chunk for chunk_size 4
    kv0 = jnp.ones((B, H, M, DV))
    k_sum0 = jnp.ones((B, H, M))
    state = K.LinearAttentionState(kv0, k_sum0)
    f = jax.jit(
        lambda q, k, v, a: K.causal_linear_attention(
            q,
            k,
            v,
            log_decay=a,
            method=method,
            chunk_size=4,
            initial_state=state,
            return_state=True,
        )
    )
    o, final = f(q, k, v, jnp.asarray(a))
    ref_o, ref_kv, _ = causal_linear_attention_loop(q, k, v, a, kv0, k_sum0)
    assert np.all(np.isfinite(o)) and rel_err(o, ref_o) < 1e-5
    assert rel_err(final.kv, ref_kv) < 1e-5
    grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, jnp.asarray(a))[0] ** 2), (0, 1, 2))(
        q, k, v
    )
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_recurrent_step_minus_inf_resets():
    q, k, v = inputs(2)
    state = K.LinearAttentionState(jnp.ones((B, H, M, DV)), jnp.ones((B, H, M)))
    o, new = K.recurrent_step(state, q[:, 0], k[:, 0], v[:, 0], log_decay=jnp.full((H,), -jnp.inf))
    fresh, _ = K.recurrent_step(
        K.LinearAttentionState.zeros(B, H, M, DV), q[:, 0], k[:, 0], v[:, 0]
    )
    np.testing.assert_allclose(o, fresh, rtol=1e-6)
    np.testing.assert_allclose(new.kv, k[:, 0, :, :, None] * v[:, 0, :, None, :], rtol=1e-6)


# ---- a NaN key or value at token s reaches no output before s ----


# A NaN key through every method, a NaN value through the chunk forms (the other methods under
# `-m slow`): a value enters each method's state by the same product as its key.
@pytest.mark.parametrize(
    "where, method",
    [
        (where, method)
        if where == "k" or method in ("chunk", "chunk_parallel")
        else pytest.param(where, method, marks=pytest.mark.slow)
        for where in ("k", "v")
        for method in METHODS
    ],
)
def test_nan_stays_causal_linear(where, method):
    q, k, v = inputs(3)
    s = 6  # inside the second chunk of 4 tokens
    k = k.at[0, s, 1, 0].set(jnp.nan) if where == "k" else k
    v = v.at[0, s, 1, 0].set(jnp.nan) if where == "v" else v
    seg = jnp.asarray([[0] * 8 + [1] * 2] * B, jnp.int32)
    for segment_ids in (None, seg):
        o = K.causal_linear_attention(
            q,
            k,
            v,
            log_decay=jnp.full((H,), -0.1),
            method=method,
            chunk_size=4,
            segment_ids=segment_ids,
        )
        o = np.asarray(o)
        assert np.all(np.isfinite(o[0, :s])) and np.all(np.isfinite(o[1])), method
        assert np.all(np.isfinite(o[0, :, 0])), "another head is untouched"
        stop = T if segment_ids is None else 8  # a new document starts clean
        assert np.all(np.isnan(o[0, s:stop, 1])) and np.all(np.isfinite(o[0, stop:, 1]))


@pytest.mark.parametrize("method", METHODS)
def test_gradients_stay_finite_where_outputs_do(method):
    """A loss on the finite outputs of a row with a NaN value: its gradient is finite at every
    other token and equals the gradient with that value zeroed (the NaN outputs, set aside by
    the loss, depend on nothing), in every method ("chunk"'s hand-written backward included)."""
    q, k, v = inputs(3)
    s = 6  # inside the second chunk of 4 tokens; a new document at 8
    seg = jnp.asarray([[0] * 8 + [1] * 2] * B, jnp.int32)
    a = jnp.full((B, T, H), -0.1)

    @jax.jit
    def grads(q, k, v, a, keep):
        def loss(*xs):
            o = K.causal_linear_attention(
                *xs[:3], log_decay=xs[3], method=method, chunk_size=4, segment_ids=seg
            )
            return jnp.sum(jnp.where(keep, jnp.cos(o), 0.0))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, a)

    bad = v.at[0, s, 1, 0].set(jnp.nan)
    keep = np.isfinite(np.asarray(K.causal_linear_attention(q, k, bad, segment_ids=seg)))
    assert not keep[0, s:8, 1].any() and keep[0, :s].all() and keep[0, 8:].all()
    got = grads(q, k, bad, a, keep)
    want = grads(q, k, v.at[0, s, 1, 0].set(0.0), a, keep)
    others = np.ones((B, T), bool)
    others[0, s] = False
    for name, x, y in zip("qkva", got, want, strict=True):
        x, y = np.asarray(x)[others], np.asarray(y)[others]
        assert np.all(np.isfinite(x)), (method, name)
        assert rel_err(x, y) < 1e-5, (method, name)


@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_stays_causal_softmax(blockwise, where):
    q, k, v = inputs(4)
    s = 6
    k = k.at[0, s, 1, 0].set(jnp.nan) if where == "k" else k
    v = v.at[0, s, 1, 0].set(jnp.nan) if where == "v" else v
    if blockwise:
        o = K.blockwise_softmax_attention(q, k, v, causal=True, block_size=4)
    else:
        o = K.softmax_attention(q, k, v, causal=True)
    o = np.asarray(o)
    assert np.all(np.isfinite(o[0, :s])) and np.all(np.isfinite(o[1]))
    assert np.all(np.isnan(o[0, s:, 1])) and np.all(np.isfinite(o[0, :, 0]))


# ---- bad dtypes and scalars ----


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.complex64, jnp.bool_])
def test_non_float_inputs_raise(dtype):
    x = jnp.ones((1, 3, 1, 2), dtype)
    fs = [
        K.causal_linear_attention,
        K.linear_attention,
        K.softmax_attention,
        K.blockwise_softmax_attention,
    ]
    for f in fs:
        with pytest.raises(ValueError, match="real floating dtype"):
            f(x, x, x)
    state = K.LinearAttentionState.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="real floating dtype"):
        K.recurrent_step(state, x[:, 0], x[:, 0], x[:, 0])
    with pytest.raises(ValueError, match="log_decay must have a real floating dtype"):
        y = jnp.ones((1, 3, 1, 2))
        K.causal_linear_attention(y, y, y, log_decay=jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan")])
def test_bad_eps_raises(eps):
    q, k, v = inputs()
    with pytest.raises(ValueError, match="eps must be > 0"):
        K.causal_linear_attention(q, k, v, eps=eps)
    with pytest.raises(ValueError, match="eps must be > 0"):
        K.linear_attention(q, k, v, eps=eps)
    with pytest.raises(ValueError, match="eps must be > 0"):
        K.recurrent_step(
            K.LinearAttentionState.zeros(B, H, M, DV), q[:, 0], k[:, 0], v[:, 0], eps=eps
        )


def test_nan_and_positive_log_decay_raise_eagerly():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="log_decay contains NaN"):
        K.causal_linear_attention(q, k, v, log_decay=jnp.full((H,), jnp.nan))
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        K.causal_linear_attention(q, k, v, log_decay=jnp.full((B, T, H, M), 0.5))
    with pytest.raises(ValueError, match="log_decay contains NaN"):
        K.recurrent_step(
            K.LinearAttentionState.zeros(B, H, M, DV),
            q[:, 0],
            k[:, 0],
            v[:, 0],
            log_decay=jnp.full((B, H), jnp.nan),
        )


def test_ambiguous_log_decay_rank_raises():
    # [B, T] with B = 1 and T = H used to be read as [T, H]: ranks are explicit now
    q = jnp.ones((1, 2, 2, 3))
    with pytest.raises(ValueError, match="has rank 2"):
        K.causal_linear_attention(q, q, q, log_decay=jnp.full((1, 2), -0.5))
    # the explicit form works and means [B, T, 1] (one decay for every head)
    o = K.causal_linear_attention(q, q, q, log_decay=jnp.full((1, 2, 1), -0.5), normalize=False)
    ref = causal_linear_attention_loop(q, q, q, np.full((1, 2, 2), -0.5), normalize=False)[0]
    assert rel_err(o, ref) < 1e-6


# ---- edge shapes ----


@pytest.mark.parametrize("method", METHODS)
def test_empty_batch(method):
    x = jnp.zeros((0, 5, 2, 3))
    o, state = K.causal_linear_attention(x, x, x, method=method, chunk_size=2, return_state=True)
    assert o.shape == (0, 5, 2, 3) and state.kv.shape == (0, 2, 3, 3)


def test_blockwise_softmax_empty_time():
    x = jnp.zeros((2, 0, 2, 3))
    assert K.blockwise_softmax_attention(x, x, x, causal=True).shape == (2, 0, 2, 3)
    assert K.softmax_attention(x, x, x, causal=True).shape == (2, 0, 2, 3)


def test_numpy_inputs_without_normalisation():
    q, k, v = (np.asarray(x) for x in inputs(5))
    ref = causal_linear_attention_loop(q, k, v, normalize=False)[0]
    for method in METHODS:
        o = K.causal_linear_attention(q, k, v, method=method, normalize=False)
        assert rel_err(o, ref) < 1e-5, method


def test_initial_state_without_k_sum():
    q, k, v = inputs(6)
    kv0 = jnp.ones((B, H, M, DV))
    state = K.LinearAttentionState(kv0, None)
    with pytest.raises(ValueError, match="k_sum is None, but normalize=True"):
        K.causal_linear_attention(q, k, v, initial_state=state)
    ref_o, ref_kv, _ = causal_linear_attention_loop(q, k, v, None, kv0, normalize=False)
    for method in METHODS:
        o, final = K.causal_linear_attention(
            q, k, v, initial_state=state, normalize=False, method=method, return_state=True
        )
        assert rel_err(o, ref_o) < 1e-5 and rel_err(final.kv, ref_kv) < 1e-5, method
        assert final.k_sum is None
    o_t, new = K.recurrent_step(state, q[:, 0], k[:, 0], v[:, 0], normalize=False)
    assert new.k_sum is None and rel_err(o_t, ref_o[:, 0]) < 1e-5
    assert state.size_bytes == kv0.size * 4


def test_numpy_integer_sizes_accepted():
    q, k, v = inputs(7)
    o = K.causal_linear_attention(q, k, v, chunk_size=np.int64(4))
    assert rel_err(o, causal_linear_attention_loop(q, k, v)[0]) < 1e-5
    o = K.blockwise_softmax_attention(q, k, v, causal=True, block_size=np.int64(4))
    assert rel_err(o, K.softmax_attention(q, k, v, causal=True)) < 1e-5

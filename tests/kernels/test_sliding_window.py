"""Sliding-window softmax attention against a float64 NumPy loop, and its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention.kernels import sliding_window_attention, softmax_attention


def np_window(q, k, v, window, position=0, segment_ids=None, scale=None):
    """float64 loop: query i (position position + i) sees key j (position position − P + j,
    P = Tk − Tq) iff 0 ≤ lag < window, the key position ≥ 0 and (segments) the same id."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, tq, h, d = q.shape
    tk = k.shape[1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((b, tq, h, v.shape[3]))
    for bi in range(b):
        for hi in range(h):
            for i in range(tq):
                qpos = position + i
                js = [
                    j
                    for j in range(tk)
                    if 0 <= qpos - (position - (tk - tq) + j) < window
                    and position - (tk - tq) + j >= 0
                    and (segment_ids is None or segment_ids[bi, j] == segment_ids[bi, i])
                ]
                if not js:
                    continue
                s = scale * k[bi, js, hi] @ q[bi, i, hi]
                p = np.exp(s - s.max())
                out[bi, i, hi] = (p / p.sum()) @ v[bi, js, hi]
    return out


def _inputs(seed, b, tq, tk, h, d, dv, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, tq, h, d), dtype)
    k = jax.random.normal(keys[1], (b, tk, h, d), dtype)
    v = jax.random.normal(keys[2], (b, tk, h, dv), dtype)
    return q, k, v


# (T, window, block_size): window ≥ T (plain causal), window 1, T not a multiple of the block,
# blocks larger than the window, a window larger than the block (blocks grow to the window).
CASES = [(11, 16, 4), (11, 1, 4), (13, 3, 4), (10, 4, 8), (12, 5, 2), (9, 9, 64)]


@pytest.mark.parametrize("t, window, block_size", CASES)
def test_forward_matches_numpy_loop(t, window, block_size):
    q, k, v = _inputs(0, 2, t, t, 2, 4, 3)
    f = jax.jit(sliding_window_attention, static_argnames=("window", "block_size"))
    o = f(q, k, v, window=window, block_size=block_size)
    assert o.shape == (2, t, 2, 3) and o.dtype == jnp.float32
    np.testing.assert_allclose(o, np_window(q, k, v, window), rtol=1e-5, atol=1e-5)


def test_window_covering_the_sequence_is_causal_softmax_and_window_one_is_v():
    q, k, v = _inputs(1, 1, 7, 7, 2, 4, 4)
    o = sliding_window_attention(q, k, v, window=7, block_size=3)
    np.testing.assert_allclose(o, softmax_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sliding_window_attention(q, k, v, window=1), v, rtol=1e-6)


def _dense_masked(q, k, v, window):
    """Dense T×T masked softmax (the reference for autodiff), float32."""
    t = q.shape[1]
    lag = np.arange(t)[:, None] - np.arange(t)[None, :]
    mask = (lag >= 0) & (lag < window)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhe->bqhe", p, v)


@pytest.mark.parametrize("t, window, block_size", [(10, 3, 4), (9, 4, 2)])
def test_gradients_match_autodiff_of_the_dense_masked_form(t, window, block_size):
    q, k, v = _inputs(2, 2, t, t, 2, 4, 3)
    do = jax.random.normal(jax.random.key(9), (2, t, 2, 3))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * do)

    swa = lambda q, k, v: sliding_window_attention(  # noqa: E731
        q, k, v, window=window, block_size=block_size
    )
    got = jax.jit(jax.grad(loss(swa), argnums=(0, 1, 2)))(q, k, v)
    dense = lambda q, k, v: _dense_masked(q, k, v, window)  # noqa: E731
    want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        assert float(jnp.abs(w).max()) > 1e-3


# (Tq, Tk, window, position): a prefix of keys before the queries (cache or halo), some of it at
# negative positions (masked), more prefix than the window needs (the extra keys are unseen).
PREFIX = [(5, 8, 4, 3), (5, 8, 4, 10), (1, 5, 4, 2), (1, 7, 4, 9), (6, 9, 3, 0), (7, 7, 3, 5)]


@pytest.mark.parametrize("tq, tk, window, position", PREFIX)
def test_keys_before_the_queries_and_position(tq, tk, window, position):
    q, k, v = _inputs(3, 2, tq, tk, 2, 4, 3)
    f = jax.jit(sliding_window_attention, static_argnames=("window", "block_size"))
    o = f(q, k, v, window=window, position=jnp.int32(position), block_size=2)
    np.testing.assert_allclose(o, np_window(q, k, v, window, position), rtol=1e-5, atol=1e-5)


def test_segments_see_only_their_document():
    seg = np.array([[3, 3, 3, 1, 1, 1, 1, 1, 1, 3, 3], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]])
    q, k, v = _inputs(4, 2, 11, 11, 2, 4, 3)
    o = sliding_window_attention(q, k, v, window=3, block_size=4, segment_ids=jnp.asarray(seg))
    np.testing.assert_allclose(o, np_window(q, k, v, 3, segment_ids=seg), rtol=1e-5, atol=1e-5)


def test_bfloat16_in_bfloat16_out_close_to_float32():
    q, k, v = _inputs(5, 1, 10, 10, 2, 8, 8, dtype=jnp.bfloat16)
    o = sliding_window_attention(q, k, v, window=4, block_size=4)
    assert o.dtype == jnp.bfloat16
    want = np_window(*(a.astype(jnp.float32) for a in (q, k, v)), 4)
    np.testing.assert_allclose(o.astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


def test_nan_value_poisons_only_the_queries_that_see_it():
    q, k, v = _inputs(6, 1, 9, 9, 1, 4, 2)
    v = v.at[0, 2, 0, 0].set(jnp.nan)
    o = sliding_window_attention(q, k, v, window=3, block_size=4)
    bad = np.isnan(np.asarray(o[0, :, 0, 0]))
    np.testing.assert_array_equal(bad, [t in (2, 3, 4) for t in range(9)])


BAD = [
    (dict(window=0), "window must be an integer >= 1, got 0"),
    (dict(window=2.0), "window must be an integer >= 1, got 2.0"),
    (dict(window=True), "window must be an integer >= 1"),
    (dict(window=2, block_size=0), "block_size"),
    (dict(window=2, segment_ids=np.zeros((1, 4), np.int32)), r"segment_ids needs Tq = Tk"),
    (dict(window=2, position=jnp.zeros((2,), jnp.int32)), "position must be a scalar"),
]


@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_arguments_raise(kwargs, match):
    q, k, v = _inputs(0, 1, 3, 4, 1, 2, 2)
    with pytest.raises(ValueError, match=match):
        sliding_window_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        sliding_window_attention(k, q, q, window=2)

"""Exact and blockwise softmax attention against a float64 NumPy softmax and its gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention.kernels import (
    blockwise_softmax_attention,
    cached_softmax_attention,
    softmax_attention,
)


def _visible(tq, tk, causal):
    if not causal:
        return np.ones((tq, tk), bool)
    return np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq)


def np_attention(q, k, v, causal, scale=None):
    """float64 softmax attention and its probabilities; rows with no visible key give zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tq, tk, d = q.shape[1], k.shape[1], q.shape[3]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((q.shape[0], tq, q.shape[2], v.shape[3]))
    probs = np.zeros((q.shape[0], q.shape[2], tq, tk))
    visible = _visible(tq, tk, causal)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for i in range(tq):
                js = np.flatnonzero(visible[i])
                if js.size == 0:
                    continue
                s = scale * k[b, js, h] @ q[b, i, h]
                p = np.exp(s - s.max())
                p /= p.sum()
                probs[b, h, i, js] = p
                out[b, i, h] = p @ v[b, js, h]
    return out, probs


def np_attention_grads(q, k, v, do, causal, scale=None):
    """Analytic float64 gradient of sum(o * do): dv = Pᵀdo, ds = P ⊙ (do vᵀ − rowsum(P ⊙ do vᵀ))."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
    scale = 1.0 / np.sqrt(q.shape[3]) if scale is None else scale
    _, p = np_attention(q, k, v, causal, scale)
    dv = np.einsum("bhqk,bqhe->bkhe", p, do)
    dp = np.einsum("bqhe,bkhe->bhqk", do, v)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, k)
    dk = scale * np.einsum("bhqk,bqhd->bkhd", ds, q)
    return dq, dk, dv


def _inputs(seed, b, tq, tk, h, d, dv, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, tq, h, d), dtype)
    k = jax.random.normal(keys[1], (b, tk, h, d), dtype)
    v = jax.random.normal(keys[2], (b, tk, h, dv), dtype)
    do = jax.random.normal(keys[3], (b, tq, h, dv), jnp.float32)
    return q, k, v, do


# (causal, Tq, Tk, D, Dv, block_size, scale): T never a multiple of the block; Tq < Tk is the
# KV-cache decode alignment; Tq > Tk causal leaves the first Tq - Tk queries with no key.
CASES = [
    (False, 13, 13, 8, 8, 4, None),
    (True, 13, 13, 8, 8, 5, None),
    (True, 5, 13, 8, 6, 4, 0.3),
    (True, 9, 4, 8, 8, 3, None),
    (False, 7, 11, 4, 6, 512, 0.7),
]


@pytest.mark.parametrize("causal, tq, tk, d, dv, block_size, scale", CASES)
def test_forward_and_gradients_match_numpy(causal, tq, tk, d, dv, block_size, scale):
    q, k, v, do = _inputs(0, 2, tq, tk, 2, d, dv)
    exact = functools.partial(softmax_attention, causal=causal, scale=scale)
    blockwise = functools.partial(
        blockwise_softmax_attention, causal=causal, scale=scale, block_size=block_size
    )
    want_o, _ = np_attention(q, k, v, causal, scale)
    want_grads = np_attention_grads(q, k, v, do, causal, scale)
    for fn in (exact, blockwise):
        o, vjp = jax.vjp(jax.jit(fn), q, k, v)
        assert o.dtype == jnp.float32 and o.shape == want_o.shape
        np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
        for got, want in zip(vjp(do), want_grads, strict=True):
            assert np.all(np.isfinite(got))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if causal and tq > tk:  # fully masked rows: exactly zero output, no NaN anywhere
        np.testing.assert_array_equal(np.asarray(blockwise(q, k, v))[:, : tq - tk], 0.0)
        np.testing.assert_array_equal(np.asarray(exact(q, k, v))[:, : tq - tk], 0.0)


def test_causal_decode_alignment_is_the_tail_of_full_attention():
    """Queries for the last Tq positions see exactly what they see in full causal attention."""
    q_full, k, v, _ = _inputs(1, 1, 12, 12, 2, 4, 4)
    full = softmax_attention(q_full, k, v, causal=True)
    for tq in (1, 5):
        tail = q_full[:, -tq:]
        np.testing.assert_allclose(
            softmax_attention(tail, k, v, causal=True), full[:, -tq:], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            blockwise_softmax_attention(tail, k, v, causal=True, block_size=5),
            full[:, -tq:],
            rtol=1e-5,
            atol=1e-6,
        )


def test_bfloat16_in_bfloat16_out_close_to_float32():
    q, k, v, _ = _inputs(2, 1, 33, 33, 2, 8, 8, dtype=jnp.bfloat16)
    want = softmax_attention(*(a.astype(jnp.float32) for a in (q, k, v)), causal=True)
    for o in (
        softmax_attention(q, k, v, causal=True),
        blockwise_softmax_attention(q, k, v, causal=True, block_size=8),
    ):
        assert o.dtype == jnp.bfloat16
        assert np.all(np.isfinite(np.asarray(o, np.float32)))
        np.testing.assert_allclose(np.asarray(o, np.float32), want, atol=2e-2, rtol=2e-2)


def test_large_logits_stay_finite():
    """Logits of ~±1e4 would overflow a naive exp; both forms shift by the running max."""
    q, k, v, do = _inputs(3, 1, 10, 10, 1, 4, 4)
    q = q * 100.0
    want, _ = np_attention(q, k, v, True)
    want_grads = np_attention_grads(q, k, v, do, True)
    for fn in (softmax_attention, functools.partial(blockwise_softmax_attention, block_size=3)):
        o, vjp = jax.vjp(jax.jit(functools.partial(fn, causal=True)), q, k, v)
        np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
        for got, ref in zip(vjp(do), want_grads, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)


def _arrays(*shapes):
    return [jnp.zeros(s) for s in shapes]


BAD = [
    (_arrays((2, 3, 4), (2, 3, 2, 4), (2, 3, 2, 4)), {}, "q must have rank 4"),
    (_arrays((2, 3, 2, 4), (2, 3, 4), (2, 3, 2, 4)), {}, "k must have rank 4"),
    (_arrays((2, 3, 2, 4), (2, 3, 2, 4), (3, 2, 4)), {}, "v must have rank 4"),
    (_arrays((2, 3, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4)), {}, r"q / k / v disagree on B"),
    (_arrays((2, 3, 2, 4), (2, 3, 2, 4), (2, 3, 3, 4)), {}, r"q / k / v disagree on H"),
    (_arrays((2, 3, 2, 4), (2, 3, 2, 5), (2, 3, 2, 4)), {}, r"q / k disagree on D"),
    (_arrays((2, 3, 2, 4), (2, 3, 2, 4), (2, 4, 2, 4)), {}, r"k / v disagree on Tk"),
    (_arrays((2, 3, 2, 4), (2, 3, 2, 4), (2, 3, 2, 4)), {"scale": 0.0}, "scale must be > 0"),
    (_arrays((2, 3, 2, 4), (2, 3, 2, 4), (2, 3, 2, 4)), {"scale": -1.0}, "scale must be > 0"),
    (_arrays((2, 3, 2, 4), (2, 3, 2, 4), (2, 3, 2, 4)), {"scale": jnp.ones(2)}, "scale must be a"),
]


@pytest.mark.parametrize("args, kwargs, match", BAD)
@pytest.mark.parametrize("fn", [softmax_attention, blockwise_softmax_attention])
def test_bad_input_raises_naming_the_argument(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("block_size", [0, -3, 2.0, True])
def test_bad_block_size(block_size):
    q = jnp.zeros((1, 3, 1, 4))
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        blockwise_softmax_attention(q, q, q, block_size=block_size)


def test_traced_scale_matches_static_and_gets_a_gradient():
    q, k, v, _ = _inputs(4, 1, 6, 6, 1, 4, 4)
    want, _ = np_attention(q, k, v, True, 0.3)
    grads = []
    for fn in (softmax_attention, functools.partial(blockwise_softmax_attention, block_size=4)):
        o = jax.jit(lambda s, fn=fn: fn(q, k, v, causal=True, scale=s))(0.3)
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
        grads.append(
            jax.jit(jax.grad(lambda s, fn=fn: jnp.sum(fn(q, k, v, causal=True, scale=s) ** 2)))(0.3)
        )
    # d/dscale against a float64 central difference of the NumPy reference
    h = 1e-5
    loss = [np.sum(np_attention(q, k, v, True, 0.3 + e)[0] ** 2) for e in (h, -h)]
    np.testing.assert_allclose(grads, (loss[0] - loss[1]) / (2 * h), rtol=1e-4)
    assert abs(float(grads[0])) > 1e-3


# ---- packed rows ----

SEG = np.array([[0] * 4 + [1] * 7, [3] * 2 + [5] * 5 + [6] * 4])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blockwise", [False, True])
def test_segments_equal_each_document_alone(causal, blockwise):
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 11, 2, 4)), jnp.float32) for _ in range(3))
    if blockwise:  # blocks of 3 straddle the document boundaries
        f = functools.partial(blockwise_softmax_attention, block_size=3)
    else:
        f = softmax_attention
    o = jax.jit(functools.partial(f, causal=causal))(q, k, v, segment_ids=jnp.asarray(SEG))
    want = np.zeros(o.shape)
    for b in range(2):
        for doc in np.unique(SEG[b]):
            m = SEG[b] == doc
            want[b, m] = np_attention(q[b : b + 1, m], k[b : b + 1, m], v[b : b + 1, m], causal)[0][
                0
            ]
    np.testing.assert_allclose(o, want, atol=2e-6)
    # no gradient crosses a boundary: the second document of row 0 ignores the first
    g = jax.jit(
        jax.grad(
            lambda k, v: jnp.sum(
                f(q, k, v, causal=causal, segment_ids=jnp.asarray(SEG))[0, 4:] ** 2
            ),
            argnums=(0, 1),
        )
    )(k, v)
    for x in g:
        assert np.all(np.asarray(x)[0, :4] == 0.0) and np.any(np.asarray(x)[0, 4:] != 0.0)


def test_bad_segment_ids():
    q = jnp.zeros((2, 11, 2, 4))
    for f in (softmax_attention, blockwise_softmax_attention):
        with pytest.raises(ValueError, match="segment_ids"):
            f(q, q, q, segment_ids=jnp.zeros((2, 10), jnp.int32))
        with pytest.raises(ValueError, match="integers"):
            f(q, q, q, segment_ids=jnp.zeros((2, 11)))
        with pytest.raises(ValueError, match="Tq = Tk"):
            f(q[:, :3], q, q, segment_ids=jnp.zeros((2, 11), jnp.int32))


# (Tq, L, position, block_size): one token, a prefill from 0 and one after a prefix, several
# query and key blocks, L not a multiple of the block, the cache exactly full. The default run
# keeps one token after a prefix, a prefill after a prefix and the full cache; the three others
# (one token and a prefill from position 0, blocks of 2) run under `-m slow`.
SLOW = pytest.mark.slow
CACHED = [
    pytest.param(1, 13, 0, 4, marks=SLOW), (1, 13, 9, 4), pytest.param(7, 16, 0, 3, marks=SLOW),
    (5, 13, 6, 4), (6, 11, 5, 512), pytest.param(4, 9, 2, 2, marks=SLOW),
]  # fmt: skip


@pytest.mark.parametrize("tq, length, position, block_size", CACHED)
def test_cached_attention_reads_the_filled_slots_only(tq, length, position, block_size):
    """Queries at positions p..p+Tq−1 over a cache filled up to p+Tq−1 equal causal attention
    over those slots (the float64 reference with Tq < Tk alignment); the empty slots hold NaN
    and are never used; the position may be traced (one compiled function for all)."""
    q, k, v, _ = _inputs(7, 2, tq, length, 3, 8, 5)
    filled = position + tq
    empty = jnp.arange(length)[None, :, None, None] >= filled
    k_cache, v_cache = jnp.where(empty, jnp.nan, k), jnp.where(empty, jnp.nan, v)
    fn = jax.jit(functools.partial(cached_softmax_attention, block_size=block_size, scale=0.4))
    o = fn(q, k_cache, v_cache, jnp.int32(position))
    expected, _ = np_attention(q, k[:, :filled], v[:, :filled], causal=True, scale=0.4)
    assert o.shape == (2, tq, 3, 5) and o.dtype == jnp.float32
    np.testing.assert_allclose(o, expected, rtol=1e-5, atol=1e-6)


def test_cached_attention_bad_input():
    q, k, v, _ = _inputs(0, 1, 2, 6, 2, 4, 4)
    with pytest.raises(ValueError, match="L \\(cache length\\)"):
        cached_softmax_attention(q, k, v[:, :5], 0)
    with pytest.raises(ValueError, match="position must be a scalar"):
        cached_softmax_attention(q, k, v, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="block_size"):
        cached_softmax_attention(q, k, v, 0, block_size=0)


def test_cached_attention_nan_value_poisons_only_the_queries_that_see_it():
    q, k, v, _ = _inputs(3, 1, 6, 10, 2, 4, 4)
    v = v.at[0, 5, 1, 2].set(jnp.nan)  # slot 5 = the query at position 2 + 3
    o = cached_softmax_attention(q, k, v, 2, block_size=4)
    assert bool(jnp.all(jnp.isfinite(o[:, :3]))) and not bool(jnp.any(jnp.isfinite(o[:, 3:, 1])))
    expected, _ = np_attention(q[:, :3], k[:, :5], v[:, :5], causal=True)
    np.testing.assert_allclose(o[:, :3], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_cached_attention_long_prefill_matches_blockwise():
    """1024 queries at positions 7168.. of an 8192-slot cache (default blocks of 512): the
    trainable blockwise kernel with the decode alignment (Tq < Tk) gives the same output."""
    q, k, v, _ = _inputs(5, 1, 1024, 8192, 2, 32, 32)
    o = jax.jit(cached_softmax_attention)(q, k, v, jnp.int32(8192 - 1024))
    want = blockwise_softmax_attention(q, k, v, causal=True)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-5)

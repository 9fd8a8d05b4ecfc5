"""Feature maps against float64 NumPy kernels, FAVOR+ estimator statistics, and causality."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention.kernels import feature_maps as fm


def _normal(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def test_elementwise_maps_values_and_signs():
    x = np.array([[-30.0, -2.0, -0.5, 0.0, 0.5, 3.0]], np.float32)
    x64 = x.astype(np.float64)
    elu1 = np.asarray(fm.elu_plus_one(x))
    np.testing.assert_allclose(elu1, np.where(x64 > 0, x64 + 1, np.exp(x64)), rtol=1e-6)
    assert np.all(elu1 > 0)  # also at x = -30, where elu(x) + 1 would round to 0 in float32
    grad = jax.grad(lambda x: jnp.sum(fm.elu_plus_one(x)))(jnp.array([-30.0, -1.0, 0.5, 200.0]))
    np.testing.assert_allclose(grad, [np.exp(-30.0), np.exp(-1.0), 1.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(fm.relu(x), np.maximum(x, 0))
    np.testing.assert_array_equal(fm.identity(x), x)
    x_big = _normal(0, (3, 5, 8), 3.0)
    assert np.all(np.asarray(fm.elu_plus_one(x_big)) > 0)
    assert np.all(np.asarray(fm.relu(x_big)) >= 0)


@pytest.mark.parametrize("d", [1, 6, 16])
def test_taylor2_is_the_second_order_taylor_kernel(d):
    q, k = _normal(1, (4, 3, d), 1.5), _normal(2, (4, 3, d), 1.5)
    phi_q, phi_k = fm.taylor2(q), fm.taylor2(k)
    # the upper triangle of x⊗x: 1 + d + d(d+1)/2 features (153 at d = 16)
    assert phi_q.shape == (4, 3, 1 + d + d * (d + 1) // 2) and phi_q.dtype == jnp.float32
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = np.sum(q64 * k64, axis=-1) / np.sqrt(d)
    got = np.sum(np.asarray(phi_q, np.float64) * np.asarray(phi_k, np.float64), axis=-1)
    np.testing.assert_allclose(got, 1 + s + s**2 / 2, rtol=1e-5)

    # the same kernel values as the full form [1, x/d^{1/4}, vec(x⊗x)/(√2·√d)] (1 + d + d²)
    def full(x):
        outer = (x[..., :, None] * x[..., None, :]).reshape(*x.shape[:-1], d * d)
        return np.concatenate([np.ones_like(x[..., :1]), x / d**0.25, outer / np.sqrt(2 * d)], -1)

    np.testing.assert_allclose(got, np.sum(full(q64) * full(k64), axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(phi_q[..., 0], 1.0)
    np.testing.assert_allclose(phi_q[..., 1 : 1 + d], q / d**0.25, rtol=1e-6)


def test_taylor2_features_by_hand():
    """d = 2, x = (a, b): [1, a/2^¼, b/2^¼, a²/2, ab/√2, b²/2] (√2·√d = 2, off-diagonal ×√2)."""
    a, b = 3.0, -0.5
    want = [1.0, a / 2**0.25, b / 2**0.25, a * a / 2, a * b / np.sqrt(2), b * b / 2]
    np.testing.assert_allclose(fm.taylor2(jnp.array([a, b])), want, rtol=1e-6)


def test_taylor2_kernel_gradient():
    """∂/∂q (1 + s + s²/2) = (1 + s)·k/√d, s = q·k/√d, through the features."""
    d = 5
    q, k = _normal(4, (3, d)), _normal(5, (3, d))
    grad = jax.grad(lambda q: jnp.sum(fm.taylor2(q) * fm.taylor2(k)))(q)
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = np.sum(q64 * k64, -1, keepdims=True) / np.sqrt(d)
    np.testing.assert_allclose(grad, (1 + s) * k64 / np.sqrt(d), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "fn",
    [fm.elu_plus_one, fm.relu, fm.identity, fm.taylor2]
    + [
        functools.partial(f, projection=fm.random_projection(jax.random.key(0), 12, 8))
        for f in (fm.favor_plus, fm.trig_random_features)
    ],
)
def test_bfloat16_in_bfloat16_out(fn):
    x = _normal(3, (2, 5, 8))
    want = np.asarray(fn(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)))
    got = fn(jnp.asarray(x, jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)


D = 8  # head size for the estimator statistics
NUM_DRAWS = 2000


def _pairs():
    return _normal(10, (8, D), 0.5), _normal(11, (8, D), 0.5)


def _true_kernel(q, k):
    return np.exp(np.sum(np.asarray(q, np.float64) * np.asarray(k), axis=-1) / np.sqrt(D))


@functools.partial(jax.jit, static_argnames=("num_features", "orthogonal", "trig"))
def _estimates(seeds, q, k, *, num_features, orthogonal, trig):
    """φ(q)·φ(k) for each of `seeds` independent projections: [draws, pairs]."""

    def one(key):
        w = fm.random_projection(key, num_features, D, orthogonal=orthogonal)
        if trig:
            return jnp.sum(fm.trig_random_features(q, w) * fm.trig_random_features(k, w), -1)
        phi_q = fm.favor_plus(q, w, stabilize=False)
        return jnp.sum(phi_q * fm.favor_plus(k, w, stabilize=False), -1)

    return jax.vmap(one)(seeds)


@pytest.mark.parametrize(
    "orthogonal, trig", [(True, False), (False, False), (True, True), (False, True)]
)
def test_random_features_are_unbiased_for_exp(orthogonal, trig):
    q, k = _pairs()
    seeds = jax.random.split(jax.random.key(1), NUM_DRAWS)
    est = np.asarray(_estimates(seeds, q, k, num_features=2 * D, orthogonal=orthogonal, trig=trig))
    want = _true_kernel(q, k)
    if not trig:
        assert np.all(est > 0)  # positive random features: every single estimate is positive
    # ~2000 draws: the standard error of the mean is ~1% here; 5% is a > 3-sigma margin.
    np.testing.assert_allclose(est.mean(axis=0), want, rtol=0.05)


def test_orthogonal_projection_has_lower_mse_than_iid():
    q, k = _pairs()
    seeds = jax.random.split(jax.random.key(2), NUM_DRAWS)
    want = _true_kernel(q, k)
    rel_mse = {}
    for orthogonal in (True, False):
        est = np.asarray(_estimates(seeds, q, k, num_features=D, orthogonal=orthogonal, trig=False))
        rel_mse[orthogonal] = np.mean((est - want) ** 2 / want**2)
    # measured: ~0.20 orthogonal vs ~0.27 iid at m = d = 8
    assert rel_mse[True] < 0.9 * rel_mse[False], rel_mse


def _normalized_causal(phi_q, phi_k, v, eps=0.0):
    """Causal normalized linear attention as a masked quadratic form, [T, m] / [T, Dv]."""
    t = phi_q.shape[0]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), phi_q @ phi_k.T, 0.0)
    return (scores @ v) / (jnp.sum(scores, axis=-1, keepdims=True) + eps)


def _favor_attention(q, k, v, w, *, stabilize, eps=0.0):
    phi_q = fm.favor_plus(q, w, stabilize=stabilize, is_query=True)
    phi_k = fm.favor_plus(k, w, stabilize=stabilize, is_query=False)
    return _normalized_causal(phi_q, phi_k, v, eps)


def _np_favor_attention(q, k, v, w):
    """float64 unstabilized FAVOR+ causal attention."""
    q, k, v, w = (np.asarray(a, np.float64) for a in (q, k, v, w))
    d = q.shape[-1]

    def phi(x):
        xs = x * d**-0.25
        return np.exp(xs @ w.T - 0.5 * np.sum(xs**2, -1, keepdims=True)) / np.sqrt(w.shape[0])

    scores = np.tril(phi(q) @ phi(k).T)
    return scores @ v / scores.sum(-1, keepdims=True)


def test_stabilized_favor_equals_unstabilized_in_normalized_attention():
    d, m, t = 16, 32, 7
    w = fm.random_projection(jax.random.key(3), m, d)
    q, k, v = _normal(20, (t, d)), _normal(21, (t, d)), _normal(22, (t, 4))
    # At this head size the key shift is zero: stabilized keys are the unstabilized ones.
    np.testing.assert_array_equal(
        fm.favor_plus(k, w, is_query=False), fm.favor_plus(k, w, stabilize=False)
    )
    want = _np_favor_attention(q, k, v, w)
    for stabilize in (True, False):
        o = _favor_attention(q, k, v, w, stabilize=stabilize)
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)

    # Long projection rows (max |w|²/2 ≈ 117 > 80): keys are shifted by one constant, which
    # cancels; a key at k' = w_i reaches the exponent bound |w_i|²/2 and overflows unstabilized.
    w_long = 3.0 * w
    ratio = fm.favor_plus(k, w_long, is_query=False) / fm.favor_plus(k, w_long, stabilize=False)
    np.testing.assert_allclose(ratio, np.full(ratio.shape, ratio[0, 0]), rtol=1e-5)
    assert float(ratio[0, 0]) < 1e-10
    np.testing.assert_allclose(
        _favor_attention(q, k, v, w_long, stabilize=True),
        _np_favor_attention(q, k, v, w_long),
        rtol=1e-5,
        atol=1e-6,
    )
    longest = int(jnp.argmax(jnp.sum(w_long**2, axis=-1)))
    k_hot = k.at[2].set(w_long[longest] * d**0.25)
    assert not np.all(np.isfinite(fm.favor_plus(k_hot, w_long, stabilize=False)))
    assert not np.all(np.isfinite(_favor_attention(q, k_hot, v, w_long, stabilize=False)))
    phi_k = fm.favor_plus(k_hot, w_long, is_query=False)
    assert float(jnp.max(phi_k)) <= 1.0001 * np.exp(80.0) / np.sqrt(m)
    np.testing.assert_allclose(
        _favor_attention(q, k_hot, v, w_long, stabilize=True),
        _np_favor_attention(q, k_hot, v, w_long),
        rtol=1e-5,
        atol=1e-6,
    )
    # queries: the per-token max makes each token's largest feature exactly 1/√m
    phi_q = fm.favor_plus(q * 5.0, w_long, is_query=True)
    np.testing.assert_allclose(jnp.max(phi_q, axis=-1), 1 / np.sqrt(m), rtol=1e-6)


def test_stabilized_favor_is_causal():
    """o_t neither changes with nor has a gradient towards q_s, k_s, v_s for s > t."""
    d, m, t = 4, 8, 6
    w = fm.random_projection(jax.random.key(4), m, d)
    q, k, v = _normal(30, (t, d)), _normal(31, (t, d)), _normal(32, (t, 3))
    attend = jax.jit(functools.partial(_favor_attention, w=w, stabilize=True, eps=1e-6))
    future = np.arange(t)[None, :] > np.arange(t)[:, None]  # [t, s]: s > t
    for argnum in range(3):
        jac = np.asarray(jax.jacrev(attend, argnums=argnum)(q, k, v))  # [t, Dv, s, dim]
        assert np.all(jac.transpose(0, 2, 1, 3)[future] == 0.0)
        assert np.any(jac.transpose(0, 2, 1, 3)[~future] != 0.0)
    o = attend(q, k, v)
    for s in range(1, t):  # a huge future key would dominate any max taken over time
        o_changed = attend(q.at[s:].mul(30.0), k.at[s:].mul(30.0), v.at[s:].add(5.0))
        np.testing.assert_array_equal(o_changed[:s], o[:s])


def test_random_projection_structure():
    d, m = 8, 20
    w = np.asarray(fm.random_projection(jax.random.key(5), m, d), np.float64)
    assert w.shape == (m, d) and fm.random_projection(jax.random.key(5), m, d).dtype == jnp.float32
    directions = w / np.linalg.norm(w, axis=-1, keepdims=True)
    for start in range(0, m, d):  # orthonormal directions within each block of d rows
        block = directions[start : start + d]
        np.testing.assert_allclose(block @ block.T, np.eye(len(block)), atol=1e-5)
    assert abs(directions[0] @ directions[d]) > 1e-3  # separate blocks are independent
    # rows scaled by chi(d) norms: E|w|² = d; iid rows are Gaussian with the same second moment
    many = np.asarray(fm.random_projection(jax.random.key(6), 512, d))
    iid = np.asarray(fm.random_projection(jax.random.key(6), 512, d, orthogonal=False))
    assert iid.shape == (512, d) and iid.dtype == np.float32
    for rows in (many, iid):
        assert abs(np.mean(np.sum(rows**2, axis=-1)) - d) < 1.0
    assert np.std(np.linalg.norm(many, axis=-1)) > 0.3  # not all rows of norm √d


def test_get_returns_each_map_and_lists_names_for_unknown():
    for name in fm.NAMES:
        assert fm.get(name) is getattr(fm, name)
    with pytest.raises(
        ValueError, match="unknown feature map 'softmax'; allowed: elu_plus_one, .*taylor2"
    ):
        fm.get("softmax")


W84 = np.ones((8, 4), np.float32)
BAD = [
    (lambda: fm.elu_plus_one(jnp.float32(1.0)), "x must have rank >= 1"),
    (lambda: fm.taylor2(jnp.float32(1.0)), "x must have rank >= 1"),
    (lambda: fm.favor_plus(np.ones((3, 5)), W84), r"projection must have shape.*d = .*5.*\(8, 4\)"),
    (lambda: fm.favor_plus(np.ones((3, 4)), np.ones(4)), "projection must have shape"),
    (lambda: fm.trig_random_features(np.ones((3, 5)), W84), "projection must have shape"),
    (lambda: fm.random_projection(jax.random.key(0), 0, 4), "num_features must be an integer"),
    (lambda: fm.random_projection(jax.random.key(0), 4, 2.0), "dim must be an integer"),
]


@pytest.mark.parametrize("call, match", BAD)
def test_bad_input_raises_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()

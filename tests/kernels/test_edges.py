"""Kernel edges of issue 23: forward-mode autodiff (supported, or a ValueError naming the methods
that support it), static arguments passed as tracers, value checks on constants closed over under
`jit`, a zero-width `taylor2`, and float16 outputs without a normaliser. Each case crashed inside
JAX (or overflowed without a word) before it was fixed."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import (
    causal_linear_attention_loop,
    delta_rule_loop,
    linear_attention_noncausal,
    rel_err,
)

B, T, H, M, DV = 1, 6, 2, 3, 2


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    q = np.abs(rng.normal(size=(B, T, H, M))) + 0.1
    k = rng.normal(size=(B, T, H, M))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule's L2-normalised keys
    v = rng.normal(size=(B, T, H, DV))
    beta = rng.uniform(0.1, 1.9, size=(B, T, H))
    a = -rng.uniform(0.05, 0.5, size=(B, T, H))
    return tuple(x.astype(np.float32) for x in (q, k, v, beta, a))


def central_difference(f, x, dx, h=1e-5):
    """Directional derivative of a float64 NumPy function, (f(x + h·dx) − f(x − h·dx)) / 2h."""
    x, dx = np.asarray(x, np.float64), np.asarray(dx, np.float64)
    return (f(x + h * dx) - f(x - h * dx)) / (2 * h)


# ---- forward mode ----


def test_forward_mode_through_the_plain_jax_methods():
    q, k, v, beta, a = arrays()
    dq = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)
    want = central_difference(
        lambda x: causal_linear_attention_loop(x, np.abs(k) + 0.1, v, a)[0], q, dq
    )
    for method in ("chunk_parallel", "scan", "associative_scan", "quadratic"):
        f = functools.partial(
            K.causal_linear_attention, k=np.abs(k) + 0.1, v=v, log_decay=a, method=method
        )
        _, tangent = jax.jit(lambda x, dx, f=f: jax.jvp(f, (x,), (dx,)))(q, dq)
        assert rel_err(tangent, want) < 1e-4, method
    want = central_difference(lambda x: delta_rule_loop(x, k, v, beta, a)[0], q, dq)
    for method in K.DELTA_METHODS:
        f = functools.partial(K.delta_rule, k=k, v=v, beta=beta, log_decay=a, method=method)
        _, tangent = jax.jit(lambda x, dx, f=f: jax.jvp(f, (x,), (dx,)))(q, dq)
        assert rel_err(tangent, want) < 1e-4, method


def test_forward_mode_through_a_custom_vjp_names_the_alternatives():
    q, k, v, *_ = arrays()
    with pytest.raises(ValueError, match=r'method="chunk" supports reverse-mode.*"chunk_parallel"'):
        jax.jvp(lambda x: K.causal_linear_attention(x, k, v, method="chunk"), (q,), (q,))
    with pytest.raises(ValueError, match="use softmax_attention"):
        jax.jacfwd(lambda x: K.blockwise_softmax_attention(x, k, v, causal=True))(q)
    # reverse mode is untouched by the guard
    grad = jax.jit(jax.grad(lambda x: K.causal_linear_attention(x, k, v, method="chunk").sum()))(q)
    assert np.all(np.isfinite(grad))


# ---- static arguments passed as tracers ----


def test_traced_static_arguments_raise_naming_them():
    q, k, v, beta, _ = arrays()
    state = K.LinearAttentionState.zeros(B, H, M, DV)
    cases = {
        "return_state": lambda x: K.causal_linear_attention(q, k, v, return_state=x > 0),
        "eps": lambda x: K.causal_linear_attention(q, k, v, eps=x),
        "normalize": lambda x: K.linear_attention(q, k, v, normalize=x > 0),
        "causal": lambda x: K.softmax_attention(q, k, v, causal=x > 0),
    }
    cases_delta = {
        "return_state": lambda x: K.delta_rule(q, k, v, beta, return_state=x > 0),
        "eps": lambda x: K.recurrent_step(state, q[:, 0], k[:, 0], v[:, 0], eps=x),
    }
    k2, v2, beta2 = k[:, :, :, None], v[:, :, :, None], beta[:, :, :, None]
    cases_new = {
        "return_state": lambda x: K.dplr_delta_rule(q, k, v, -k, k, return_state=x > 0),
    }
    cases_product = {
        "return_state": lambda x: K.delta_product(q, k2, v2, beta2, return_state=x > 0),
    }
    for name, f in [
        *cases.items(),
        *cases_delta.items(),
        *cases_new.items(),
        *cases_product.items(),
    ]:
        with pytest.raises(ValueError, match=rf"^{name} is a static argument"):
            jax.jit(f)(jnp.float32(1e-6))


# ---- value checks on concrete constants closed over under jit ----


def kernel_calls(asarray):
    """Every public kernel, with every array argument (values, decays, ids, states, scales,
    positions) built by `asarray` outside the traced function."""
    q, k, v, beta, a = (asarray(x) for x in arrays())
    seg = asarray(np.array([[0, 0, 0, 1, 1, 1]], np.int32))
    s0 = K.LinearAttentionState(asarray(np.full((B, H, M, DV), 0.1, np.float32)), None)
    z0 = K.LinearAttentionState(s0.kv, asarray(np.full((B, H, M), 0.2, np.float32)))
    scale, pos = asarray(np.float32(0.5)), asarray(np.int32(2))
    proj = asarray(np.random.default_rng(2).normal(size=(4, M)).astype(np.float32))
    fm = K.feature_maps
    # DPLR as the delta rule writes it (a = −k, b = β k); DeltaProduct with two steps per token
    ka, kb = asarray(-np.asarray(k)), asarray(0.5 * np.asarray(k))
    k2 = asarray(np.stack([np.asarray(k), np.roll(np.asarray(k), 1, axis=1)], axis=3))
    v2 = asarray(np.stack([np.asarray(v), -np.asarray(v)], axis=3))
    beta2 = asarray(np.stack([np.asarray(beta), 2.0 - np.asarray(beta)], axis=3))
    return {
        "dplr_delta_rule": lambda: K.dplr_delta_rule(
            q, k, v, ka, kb, log_decay=a, segment_ids=seg, initial_state=s0, chunk_size=4
        ),
        "dplr_delta_rule_step": lambda: K.dplr_delta_rule_step(
            s0, q[:, 0], k[:, 0], v[:, 0], ka[:, 0], kb[:, 0], log_decay=a[:, 0]
        ),
        "delta_product": lambda: K.delta_product(
            q, k2, v2, beta2, log_decay=a, segment_ids=seg, initial_state=s0, chunk_size=4
        ),
        "delta_product_step": lambda: K.delta_product_step(
            s0, q[:, 0], k2[:, 0], v2[:, 0], beta2[:, 0], log_decay=a[:, 0]
        ),
        "linear_attention": lambda: K.linear_attention(q, k, v),
        "causal_linear_attention": lambda: K.causal_linear_attention(
            q, k, v, log_decay=a, segment_ids=seg, initial_state=z0, chunk_size=4
        ),
        "recurrent_step": lambda: K.recurrent_step(
            z0, q[:, 0], k[:, 0], v[:, 0], log_decay=a[:, 0]
        ),
        "delta_rule": lambda: K.delta_rule(
            q, k, v, beta, log_decay=a, segment_ids=seg, initial_state=s0, chunk_size=4
        ),
        "delta_rule_step": lambda: K.delta_rule_step(
            s0, q[:, 0], k[:, 0], v[:, 0], beta[:, 0], log_decay=a[:, 0]
        ),
        "softmax_attention": lambda: K.softmax_attention(
            q, k, v, causal=True, scale=scale, segment_ids=seg
        ),
        "blockwise_softmax_attention": lambda: K.blockwise_softmax_attention(
            q, k, v, causal=True, scale=scale, segment_ids=seg, block_size=4
        ),
        "sliding_window_attention": lambda: K.sliding_window_attention(
            q, k, v, window=3, scale=scale, position=pos
        ),
        "cached_softmax_attention": lambda: K.cached_softmax_attention(
            q[:, :1], k, v, pos, scale=scale, block_size=4
        ),
        "elu_plus_one": lambda: fm.elu_plus_one(q),
        "relu": lambda: fm.relu(k),
        "identity": lambda: fm.identity(q),
        "taylor2": lambda: fm.taylor2(k),
        "favor_plus": lambda: fm.favor_plus(k, proj, is_query=True),
        "trig_random_features": lambda: fm.trig_random_features(k, proj),
    }


def test_every_kernel_under_jit_with_every_array_closed_over():
    # NumPy constants and JAX constants give the same numbers; two calls against float64 loops
    with_numpy, with_jax = kernel_calls(np.asarray), kernel_calls(jnp.asarray)
    outputs = {}
    for name, call in with_numpy.items():
        outputs[name] = jax.jit(call)()
        for x, y in zip(
            jax.tree.leaves(outputs[name]), jax.tree.leaves(jax.jit(with_jax[name])()), strict=True
        ):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6, err_msg=name)
    q, k, v, beta, a = arrays()
    a_reset = a.copy()
    a_reset[:, 3] = -np.inf  # the document boundary of `seg`
    kv0, z0 = np.full((B, H, M, DV), 0.1), np.full((B, H, M), 0.2)
    want = causal_linear_attention_loop(q, k, v, a_reset, kv0=kv0, k_sum0=z0)[0]
    assert rel_err(outputs["causal_linear_attention"], want) < 1e-4
    want = delta_rule_loop(q, k, v, beta, a_reset, s0=kv0)[0]
    assert rel_err(outputs["delta_rule"], want) < 1e-4


def test_closed_over_constants_are_still_checked():
    q, k, v, beta, a = arrays()
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
        jax.jit(lambda: K.delta_rule(q, k, v, beta + 2.0))()
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        jax.jit(lambda x: K.causal_linear_attention(x, k, v, log_decay=-a))(q)


# ---- shapes and dtypes ----


def test_taylor2_zero_width_raises():
    with pytest.raises(
        ValueError, match=r"taylor2 needs a feature axis of width >= 1.*\(2, 3, 0\)"
    ):
        K.feature_maps.taylor2(jnp.zeros((2, 3, 0)))


def test_float16_without_normaliser_is_inf_only_where_the_true_value_overflows():
    # k = v = 200: every float32 state entry passes float16's 65504 from the 2nd token on, while
    # q = 1e-3 keeps the outputs small; the last query (q = 1) reads a true value > 65504.
    q = np.full((1, T, 1, 2), 1e-3, np.float16)
    q[:, -1] = 1.0
    k = np.full((1, T, 1, 2), 200.0, np.float16)
    v = np.stack([np.full((1, T, 1), 200.0), np.full((1, T, 1), -100.0)], -1).astype(np.float16)
    want = causal_linear_attention_loop(q, k, v, normalize=False)[0]
    overflow = np.abs(want) > 65504
    assert overflow[:, -1].all() and not overflow[:, :-1].any()
    for method in K.METHODS:
        f = functools.partial(K.causal_linear_attention, method=method, normalize=False)
        o = jax.jit(f)(q, k, v)
        assert o.dtype == jnp.float16
        o = np.asarray(o, np.float64)
        assert np.array_equal(np.isinf(o), overflow), method
        assert np.array_equal(np.sign(o[overflow]), np.sign(want[overflow])), method
        assert rel_err(o[~overflow], want[~overflow]) < 1e-3, method
    # non-causal: every output reads all tokens; q = 1e-3 rows stay finite, q = 1 overflows
    o = np.asarray(K.linear_attention(q, k, v, normalize=False), np.float64)
    want = linear_attention_noncausal(q, k, v, normalize=False)
    overflow = np.abs(want) > 65504
    assert np.array_equal(np.isinf(o), overflow) and overflow.any() and not overflow.all()
    assert rel_err(o[~overflow], want[~overflow]) < 1e-3

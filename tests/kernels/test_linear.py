"""Causal and non-causal linear attention: every method against the float64 recurrence, the
quadratic form and hand-computed cases; gradients, causality, decoding steps, dtypes, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from linear_attention import kernels as K
from tests.kernels.reference import (
    causal_linear_attention_loop,
    linear_attention_noncausal,
    rel_err,
)

METHODS = K.METHODS
B, T, H, M, DV, CHUNK = 2, 13, 2, 3, 4, 4  # T is not a multiple of the chunk size


@functools.partial(jax.jit, static_argnames=("method", "normalize", "return_state", "chunk_size"))
def run(
    q, k, v, log_decay, kv0, k_sum0, *, method, normalize=True, return_state=True, chunk_size=CHUNK
):
    state = None if kv0 is None else K.LinearAttentionState(kv0, k_sum0)
    return K.causal_linear_attention(
        q,
        k,
        v,
        log_decay=log_decay,
        normalize=normalize,
        method=method,
        chunk_size=chunk_size,
        initial_state=state,
        return_state=return_state,
    )


def make_inputs(seed=0, T=T, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = np.abs(rng.normal(size=(B, T, H, M))) + 0.1
    k = np.abs(rng.normal(size=(B, T, H, M))) + 0.1
    v = rng.normal(size=(B, T, H, DV))
    decays = {
        "none": None,
        "per_head": np.log(np.array([0.9, 0.6])),  # RetNet: a fixed decay per head, shape [H]
        "per_token": -rng.uniform(0.0, 1.5, size=(B, T, H)),  # Mamba-2 / GLA: data dependent
    }
    kv0 = rng.normal(size=(B, H, M, DV))
    k_sum0 = np.abs(rng.normal(size=(B, H, M))) + 0.5
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)  # noqa: E731
    return (
        cast(q),
        cast(k),
        cast(v),
        {name: None if a is None else jnp.asarray(a, jnp.float32) for name, a in decays.items()},
        cast(kv0),
        cast(k_sum0),
    )


# ---- the seed's worked example, and the same with a decay ----


def worked_example(decay=None):
    """φ(k1)=[1,0], v1=[1,0]; φ(k2)=[0,1], v2=[0,2]; φ(q)=[3,1] at the second position."""
    k = jnp.array([[1.0, 0.0], [0.0, 1.0]])[None, :, None, :]
    v = jnp.array([[1.0, 0.0], [0.0, 2.0]])[None, :, None, :]
    q = jnp.array([[1.0, 1.0], [3.0, 1.0]])[None, :, None, :]
    log_decay = None if decay is None else jnp.full((1,), np.log(decay))
    return q, k, v, log_decay


@pytest.mark.parametrize("method", METHODS)
def test_worked_example_causal(method):
    q, k, v, _ = worked_example()
    o = K.causal_linear_attention(q, k, v, method=method, chunk_size=1, eps=1e-12)
    np.testing.assert_allclose(o[0, 1, 0], [0.75, 0.5], rtol=1e-6)
    # At the first position only (k1, v1) is visible: o = v1.
    np.testing.assert_allclose(o[0, 0, 0], [1.0, 0.0], rtol=1e-6)
    # With decay 0.5: S = [[0.5, 0], [0, 2]], z = [0.5, 1]; o = [1.5, 2] / 2.5.
    q, k, v, log_decay = worked_example(decay=0.5)
    o = K.causal_linear_attention(q, k, v, log_decay=log_decay, method=method, eps=1e-12)
    np.testing.assert_allclose(o[0, 1, 0], [0.6, 0.8], rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_worked_example_gradient(method):
    # o_0 = q_0 / (q_0 + q_1) at the second position: do_0/dq = [q_1, -q_0] / (q_0 + q_1)^2.
    q, k, v, _ = worked_example()
    grad = jax.jit(
        jax.grad(
            lambda q: K.causal_linear_attention(q, k, v, method=method, chunk_size=1, eps=1e-12)[
                0, 1, 0, 0
            ]
        )
    )(q)
    np.testing.assert_allclose(grad[0, 1, 0], [1 / 16, -3 / 16], rtol=1e-5)
    np.testing.assert_allclose(grad[0, 0, 0], [0.0, 0.0], atol=0)


def test_worked_example_noncausal():
    q, k, v, _ = worked_example()
    o = K.linear_attention(q, k, v, eps=1e-12)
    np.testing.assert_allclose(o[0, 1, 0], [0.75, 0.5], rtol=1e-6)
    np.testing.assert_allclose(o[0, 0, 0], [0.5, 1.0], rtol=1e-6)  # [1, 2] / 2


# ---- every method against the float64 recurrence and the quadratic form ----


# The (normalize, initial state) pairs, split in two halves that each take both values of each:
# the default run checks one half with every decay and method, `-m slow` the other half.
HALVES = [
    ((True, True), (False, False)),
    pytest.param(((True, False), (False, True)), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("pairs", HALVES, ids=["half0", "half1"])
@pytest.mark.parametrize("method", METHODS)
def test_matches_float64_recurrence(method, pairs):
    q, k, v, decays, kv0, k_sum0 = make_inputs()
    for decay_name, log_decay in decays.items():
        for normalize, with_init in pairs:
            init = (kv0, k_sum0) if with_init else (None, None)
            o, state = run(q, k, v, log_decay, *init, method=method, normalize=normalize)
            ref_o, ref_kv, ref_sum = causal_linear_attention_loop(
                q, k, v, log_decay, *init, normalize=normalize
            )
            where = f"{method} decay={decay_name} normalize={normalize} init={with_init}"
            assert rel_err(o, ref_o) < 1e-5, where
            assert rel_err(state.kv, ref_kv) < 1e-5, where
            assert rel_err(state.k_sum, ref_sum) < 1e-5, where
            if method != "quadratic":
                o_quad = run(q, k, v, log_decay, *init, method="quadratic", normalize=normalize)[0]
                assert rel_err(o, o_quad) < 1e-4, where


@pytest.mark.parametrize("method", ["chunk", "chunk_parallel"])
@pytest.mark.parametrize("chunk_size", [1, 5, 13, 64])
def test_chunk_sizes_agree(chunk_size, method):
    q, k, v, decays, kv0, k_sum0 = make_inputs(seed=1)
    o, state = run(q, k, v, decays["per_token"], kv0, k_sum0, method=method, chunk_size=chunk_size)
    ref_o, ref_kv, _ = causal_linear_attention_loop(q, k, v, decays["per_token"], kv0, k_sum0)
    assert rel_err(o, ref_o) < 1e-5
    assert rel_err(state.kv, ref_kv) < 1e-5


def test_without_return_state_gives_same_output():
    q, k, v, decays, kv0, k_sum0 = make_inputs()
    for method in METHODS:
        o = run(
            q,
            k,
            v,
            decays["per_head"],
            kv0,
            k_sum0,
            method=method,
            return_state=False,
            normalize=False,
        )
        o_state, _ = run(q, k, v, decays["per_head"], kv0, k_sum0, method=method, normalize=False)
        np.testing.assert_allclose(o, o_state, rtol=1e-6, atol=1e-6)


def test_noncausal_matches_reference():
    q, k, v, *_ = make_inputs()
    for normalize in (True, False):
        o = K.linear_attention(q, k, v, normalize=normalize)
        assert rel_err(o, linear_attention_noncausal(q, k, v, normalize=normalize)) < 1e-5
    # Queries and keys of different lengths (cross attention).
    o = K.linear_attention(q[:, :5], k, v)
    assert o.shape == (B, 5, H, DV)
    assert rel_err(o, linear_attention_noncausal(q[:, :5], k, v)) < 1e-5


# ---- gradients ----


def loss_fn(method, normalize):
    def loss(q, k, v, log_decay, kv0, k_sum0):
        o, state = run(q, k, v, log_decay, kv0, k_sum0, method=method, normalize=normalize)
        # Fixed random weights make every output and state entry matter differently.
        w_o = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        w_s = jnp.sin(jnp.arange(state.kv.size, dtype=jnp.float32)).reshape(state.kv.shape)
        return jnp.sum(o * w_o) + jnp.sum(state.kv * w_s) + 0.3 * jnp.sum(state.k_sum)

    return jax.jit(jax.grad(loss, argnums=range(6)))


@pytest.mark.parametrize("pairs", HALVES, ids=["half0", "half1"])
@pytest.mark.parametrize("method", ["chunk", "chunk_parallel", "scan", "associative_scan"])
def test_gradients_match_quadratic(method, pairs):
    q, k, v, decays, kv0, k_sum0 = make_inputs(seed=2)
    names = ("q", "k", "v", "log_decay", "kv0", "k_sum0")
    # (normalize, with a decay) pairs: the same halves
    for normalize, decayed in pairs:
        decay_name = "per_token" if decayed else "none"
        args = (q, k, v, decays[decay_name], kv0, k_sum0)
        grads = loss_fn(method, normalize)(*args)
        ref = loss_fn("quadratic", normalize)(*args)
        for name, g, r in zip(names, grads, ref, strict=True):
            if r is None:
                assert g is None
                continue
            assert rel_err(g, r) < 1e-4, f"d{name} {method} {decay_name} {normalize}"


def test_gradient_of_fixed_per_head_decay():
    q, k, v, decays, kv0, k_sum0 = make_inputs(seed=3)
    a = decays["per_head"]
    grads = {
        method: jax.grad(
            lambda a, m=method: jnp.sum(run(q, k, v, a, kv0, k_sum0, method=m)[0] * v[..., :1])
        )(a)
        for method in METHODS
    }
    assert grads["quadratic"].shape == (H,)
    for method in METHODS:
        assert rel_err(grads[method], grads["quadratic"]) < 1e-4, method


def test_chunk_custom_vjp_numerically():
    q, k, v, decays, kv0, k_sum0 = make_inputs(seed=4, T=7)

    def f(q, k, v, a, kv0, k_sum0):
        o, state = K.causal_linear_attention(
            q,
            k,
            v,
            log_decay=a,
            method="chunk",
            chunk_size=3,
            initial_state=K.LinearAttentionState(kv0, k_sum0),
            return_state=True,
        )
        return o, state.kv, state.k_sum

    check_grads(
        jax.jit(f),
        (q, k, v, decays["per_token"], kv0, k_sum0),
        order=1,
        modes=["rev"],
        atol=2e-2,
        rtol=2e-2,
    )


@pytest.mark.parametrize("method", METHODS)
def test_causality_by_gradients(method):
    q, k, v, decays, kv0, k_sum0 = make_inputs(seed=5, T=6)

    def out(k, v):
        return run(
            q,
            k,
            v,
            decays["per_token"],
            None,
            None,
            method=method,
            return_state=False,
            chunk_size=4,
        )

    jac_k, jac_v = jax.jacrev(out, argnums=(0, 1))(k, v)  # [B,T,H,Dv, B,S,H,*]
    for jac in (jac_k, jac_v):
        per_ts = np.abs(np.asarray(jac)).sum(axis=(0, 2, 3, 4, 6, 7))  # [T, S]
        assert np.all(per_ts[np.triu_indices(6, k=1)] == 0.0), method
        assert np.all(np.diag(per_ts) > 0), method


def test_chunk_gradient_keeps_no_state_per_token():
    T_long, Hl, Ml = 4096, 2, 32
    shape = jax.ShapeDtypeStruct((1, T_long, Hl, Ml), jnp.float32)
    decay = jax.ShapeDtypeStruct((1, T_long, Hl), jnp.float32)

    def temp_bytes(method):
        grad = jax.grad(
            lambda q, k, v, a: jnp.sum(
                K.causal_linear_attention(q, k, v, log_decay=a, method=method, chunk_size=64)
            ),
            argnums=(0, 1, 2, 3),
        )
        return (
            jax.jit(grad)
            .lower(shape, shape, shape, decay)
            .compile()
            .memory_analysis()
            .temp_size_in_bytes
        )

    per_token_states = T_long * Hl * Ml * Ml * 4
    chunk = temp_bytes("chunk")
    assert chunk < per_token_states / 4, (chunk, per_token_states)
    # The plain scan's autodiff does keep one: the bound above is not vacuous.
    assert temp_bytes("scan") > per_token_states


# ---- decoding ----


def test_recurrent_step_matches_whole_sequence():
    q, k, v, decays, kv0, k_sum0 = make_inputs(seed=6)
    step = jax.jit(K.recurrent_step)
    for decay_name in ("none", "per_head", "per_token"):
        a = decays[decay_name]
        o_full, final = run(q, k, v, a, kv0, k_sum0, method="chunk")
        state = K.LinearAttentionState(kv0, k_sum0)
        outs = []
        for t in range(T):
            a_t = None if a is None else (a if a.ndim == 1 else a[:, t])
            o_t, state = step(state, q[:, t], k[:, t], v[:, t], log_decay=a_t)
            outs.append(o_t)
        assert rel_err(jnp.stack(outs, 1), o_full) < 1e-5, decay_name
        assert rel_err(state.kv, final.kv) < 1e-5
        assert rel_err(state.k_sum, final.k_sum) < 1e-5


def test_prefill_then_steps_continue_the_sequence():
    q, k, v, decays, *_ = make_inputs(seed=7)
    a = decays["per_token"]
    o_full = run(q, k, v, a, None, None, method="chunk", return_state=False)
    _, state = run(q[:, :9], k[:, :9], v[:, :9], a[:, :9], None, None, method="chunk")
    o_rest, _ = run(q[:, 9:], k[:, 9:], v[:, 9:], a[:, 9:], state.kv, state.k_sum, method="scan")
    assert rel_err(o_rest, o_full[:, 9:]) < 1e-5


def test_state_zeros_and_size():
    state = K.LinearAttentionState.zeros(2, 3, 4, 5)
    assert state.kv.shape == (2, 3, 4, 5) and state.k_sum.shape == (2, 3, 4)
    assert state.kv.dtype == jnp.float32
    assert state.size_bytes == (2 * 3 * 4 * 5 + 2 * 3 * 4) * 4


# ---- dtypes and long sequences ----


@pytest.mark.parametrize("method", METHODS)
def test_bfloat16_inputs(method):
    q, k, v, decays, kv0, k_sum0 = make_inputs(seed=8)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    o, state = run(*bf, decays["per_token"], kv0, k_sum0, method=method)
    assert o.dtype == jnp.bfloat16
    assert state.kv.dtype == jnp.float32 and state.k_sum.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(o, np.float32)))
    ref = run(
        *(x.astype(jnp.float32) for x in bf), decays["per_token"], kv0, k_sum0, method=method
    )[0]
    assert rel_err(o, ref) < 2e-2


def test_long_sequence_stays_finite():
    T_long = 65536
    rng = np.random.default_rng(9)
    q = jnp.asarray(np.abs(rng.normal(size=(1, T_long, 1, 4))), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, T_long, 1, 4)), jnp.float32)
    a = jnp.asarray(-rng.uniform(0, 0.1, size=(1, T_long, 1)), jnp.float32)
    for log_decay in (None, a):
        o, state = K.causal_linear_attention(q, q, v, log_decay=log_decay, return_state=True)
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(state.kv))
        # A normalised output is a convex combination of values.
        assert float(jnp.max(jnp.abs(o))) <= float(jnp.max(jnp.abs(v))) + 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("method", ["chunk", "chunk_parallel", "associative_scan"])
def test_long_sequence_methods_match_the_scan(method):
    """T = 32768 with a data-dependent decay and wider heads: every fast method against the
    scan recurrence (float32 everywhere; relative error as for short sequences)."""
    t_long = 32768
    rng = np.random.default_rng(10)
    q, k = (jnp.asarray(np.abs(rng.normal(size=(1, t_long, 2, 16))), jnp.float32) for _ in "qk")
    v = jnp.asarray(rng.normal(size=(1, t_long, 2, 16)), jnp.float32)
    a = jnp.asarray(-rng.uniform(0, 0.05, size=(1, t_long, 2)), jnp.float32)
    want, want_state = K.causal_linear_attention(
        q, k, v, log_decay=a, method="scan", return_state=True
    )
    got, state = K.causal_linear_attention(q, k, v, log_decay=a, method=method, return_state=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.kv, want_state.kv, rtol=1e-4, atol=1e-4)


# ---- bad input ----


def test_bad_input_raises_naming_the_argument():
    q, k, v, decays, kv0, k_sum0 = make_inputs()
    cla = K.causal_linear_attention
    cases = [
        (lambda: cla(q[0], k, v), "q must have rank 4"),
        (lambda: cla(q, k[..., None], v), "k must have rank 4"),
        (lambda: cla(q, k, v[:1]), r"q / k / v disagree on B \(batch\)"),
        (lambda: cla(q, k[:, :5], v), r"q / k / v disagree on T \(time\)"),
        (lambda: cla(q, k[:, :, :1], v), r"q / k / v disagree on H \(heads\)"),
        (lambda: cla(q, k[..., :2], v), r"q / k disagree on M \(feature width\)"),
        (lambda: cla(q, k, v, method="fft"), "method"),
        (lambda: cla(q, k, v, chunk_size=0), "chunk_size"),
        (lambda: cla(q, k, v, chunk_size=2.5), "chunk_size"),
        (lambda: cla(q, k, v, log_decay=jnp.zeros((B, T, 5))), "log_decay of shape"),
        (lambda: cla(q, k, v, log_decay=jnp.zeros((T,))), "log_decay of shape"),
        (lambda: cla(q, k, v, log_decay=jnp.full((H,), 0.1)), "log_decay must be <= 0"),
        (
            lambda: cla(q, k, v, initial_state=K.LinearAttentionState(kv0[:, :, :1], k_sum0)),
            "initial_state",
        ),
        (lambda: cla(q, k, v, initial_state=(kv0, k_sum0)), "initial_state"),
        (lambda: cla(q[:, :0], k[:, :0], v[:, :0]), "at least one time step"),
        (lambda: K.linear_attention(q, k, v[:, :4]), r"k / v disagree on Tk \(key length\)"),
        (lambda: K.linear_attention(q[..., 0], k, v), "q must have rank 4"),
    ]
    state = K.LinearAttentionState(kv0, k_sum0)
    cases += [
        (lambda: K.recurrent_step(state, q[:, 0], k[:, 0], v), "v must have rank 3"),
        (
            lambda: K.recurrent_step(state, q[:, 0, :1], k[:, 0], v[:, 0]),
            r"q / k / v disagree on H \(heads\)",
        ),
        (
            lambda: K.recurrent_step(state._replace(kv=kv0[..., :1]), q[:, 0], k[:, 0], v[:, 0]),
            "state has kv",
        ),
        (
            lambda: K.recurrent_step(state, q[:, 0], k[:, 0], v[:, 0], log_decay=jnp.ones(H)),
            "log_decay must be <= 0",
        ),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            fn()


def test_positive_decay_check_is_skipped_under_jit_without_error():
    # Under jit the values are unknown; the shape is still checked.
    q, k, v, *_ = make_inputs()
    f = jax.jit(lambda a: K.causal_linear_attention(q, k, v, log_decay=a))
    assert f(jnp.full((H,), -0.1)).shape == v.shape
    with pytest.raises(ValueError, match="log_decay of shape"):
        f(jnp.zeros((3,)))

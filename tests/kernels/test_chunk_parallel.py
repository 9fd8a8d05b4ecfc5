"""The all-chunks-at-once form (`method="chunk_parallel"`) on what `test_linear.py` does not cover:
decays per key dimension, resets (−inf log decays), strong decays, chunk sizes, and a gradient
that keeps one state per chunk. References: a float64 NumPy loop and the quadratic form."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from linear_attention import kernels as K
from linear_attention.kernels.linear.chunk_parallel import causal_chunk_parallel
from tests.kernels.reference import causal_linear_attention_loop, rel_err

B, T, H, M, DV = 2, 13, 2, 3, 4


def inputs(seed, T=T):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q, k = jnp.abs(f(B, T, H, M)) + 0.1, jnp.abs(f(B, T, H, M)) + 0.1
    return q, k, f(B, T, H, DV), f(B, H, M, DV), rng


kernel = jax.jit(causal_chunk_parallel, static_argnames="chunk_size")


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 64])  # T=13: not a multiple; C ≥ T
def test_decay_per_key_dimension_with_resets_and_strong_decays(chunk_size):
    q, k, v, s0, rng = inputs(0)
    a = -rng.uniform(0.0, 1.5, size=(B, T, H, M))
    a[:, 3, 0, 1] = a[1, 8, :, :] = -np.inf  # a gate of exactly 0 for one dimension; a reset
    a[0, 5:9, 1] = -30.0  # strong decays
    a = jnp.asarray(a, jnp.float32)
    o, s = kernel(q, k, v, a, s0, chunk_size=chunk_size)
    ref_o, ref_s, _ = causal_linear_attention_loop(q, k, v, a, kv0=s0, normalize=False)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
    assert rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5
    # A decay per key dimension that is the same for every m is a decay per head.
    a_head = a[..., 0]
    a_same = jnp.broadcast_to(a_head[..., None], a.shape)
    o4, s4 = kernel(q, k, v, a_same, s0, chunk_size=chunk_size)
    o3, s3 = kernel(q, k, v, a_head, s0, chunk_size=chunk_size)
    assert rel_err(o4, o3) < 1e-6 and rel_err(s4, s3) < 1e-6


@pytest.mark.parametrize("normalize", [True, False])
def test_resets_through_the_dispatcher(normalize):
    q, k, v, s0, rng = inputs(1, T=11)
    a = -rng.uniform(0.0, 30.0, size=(B, 11, H))
    a[:, [0, 4, 9]] = -np.inf
    a = jnp.asarray(a, jnp.float32)
    state = K.LinearAttentionState(s0, jnp.abs(s0[..., 0]) + 0.5)

    def f(q, k, v, a):
        return K.causal_linear_attention(
            q, k, v, log_decay=a, method="chunk_parallel", chunk_size=4, normalize=normalize,
            initial_state=state, return_state=True,
        )  # fmt: skip

    o, final = jax.jit(f)(q, k, v, a)
    ref_o, ref_kv, ref_sum = causal_linear_attention_loop(
        q, k, v, a, state.kv, state.k_sum, normalize=normalize
    )
    assert rel_err(o, ref_o) < 1e-5 and rel_err(final.kv, ref_kv) < 1e-5
    assert rel_err(final.k_sum, ref_sum) < 1e-5
    # Gradients are finite; none crosses a reset: a token before t=4 does not move o after it.
    grads = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x)[0][:, 4:] ** 2), argnums=(0, 1, 2, 3)))(
        q, k, v, a
    )
    for g in grads:
        assert np.all(np.isfinite(g))
    for g in grads[1:3]:
        assert np.all(np.asarray(g)[:, :4] == 0.0)
    assert np.all(np.asarray(grads[3])[:, :5] == 0.0)  # the reset at t=4 included


def test_gradient_numerically_with_decay_per_key_dimension():
    q, k, v, s0, rng = inputs(2, T=7)
    a = jnp.asarray(-rng.uniform(0.1, 1.0, size=(B, 7, H, M)), jnp.float32)
    check_grads(
        jax.jit(lambda *x: causal_chunk_parallel(*x, chunk_size=3)),
        (q, k, v, a, s0), order=1, modes=["rev"], atol=2e-2, rtol=2e-2,
    )  # fmt: skip


def test_gradients_match_quadratic_with_per_head_decay_and_state():
    q, k, v, s0, rng = inputs(3)
    a = jnp.asarray(-rng.uniform(0.0, 2.0, size=(B, T, H)), jnp.float32)
    w = jnp.cos(jnp.arange(B * T * H * DV, dtype=jnp.float32)).reshape(B, T, H, DV)

    def loss(method, q, k, v, a, s0):
        state = K.LinearAttentionState(s0, jnp.abs(s0[..., 0]) + 0.5)
        o, final = K.causal_linear_attention(
            q, k, v, log_decay=a, method=method, chunk_size=4, initial_state=state,
            return_state=True,
        )  # fmt: skip
        return jnp.sum(o * w) + jnp.sum(jnp.sin(final.kv)) + jnp.sum(final.k_sum)

    for a_in in (a, a[0, 0]):  # [B, T, H] and [H]
        args = (q, k, v, a_in, s0)
        got = jax.jit(jax.grad(lambda *x: loss("chunk_parallel", *x), argnums=range(5)))(*args)
        ref = jax.jit(jax.grad(lambda *x: loss("quadratic", *x), argnums=range(5)))(*args)
        for g, r in zip(got, ref, strict=True):
            assert rel_err(g, r) < 1e-4


def test_gradient_keeps_no_state_per_token():
    # Its gradient's temporaries are a few per-token vectors, the C×C scores of every chunk and
    # one state per chunk: ~(4C + 10(M + Dv)) floats per token, against M·Dv for a state per token.
    T_long, Hl, Ml = 4096, 2, 64
    shape = jax.ShapeDtypeStruct((1, T_long, Hl, Ml), jnp.float32)
    decay = jax.ShapeDtypeStruct((1, T_long, Hl), jnp.float32)

    def temp_bytes(method):
        def loss(q, k, v, a):
            return jnp.sum(K.causal_linear_attention(q, k, v, log_decay=a, method=method))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        return grad.lower(shape, shape, shape, decay).compile().memory_analysis().temp_size_in_bytes

    per_token_states = T_long * Hl * Ml * Ml * 4
    assert temp_bytes("chunk_parallel") < per_token_states / 3
    assert temp_bytes("associative_scan") > per_token_states  # the bound is not vacuous


def test_decay_per_key_dimension_needs_no_full_decay_per_chunk():
    # A [C, C, M] decay per chunk would be T·C·M floats; the sub-block factorisation keeps
    # [C/c, C, M] + [C/c, c, c, M] per chunk (c = 16): (C/c + c)·M = 20·M per token at C = 64.
    T_long, Hl, Ml, C = 2048, 2, 64, 64
    shape = jax.ShapeDtypeStruct((1, T_long, Hl, Ml), jnp.float32)
    f = jax.jit(functools.partial(causal_chunk_parallel, chunk_size=C))
    compiled = f.lower(
        shape, shape, shape, shape, jax.ShapeDtypeStruct((1, Hl, Ml, Ml), jnp.float32)
    )
    temp = compiled.compile().memory_analysis().temp_size_in_bytes
    full_decay = T_long * Hl * C * Ml * 4
    assert temp < full_decay  # the full form: 2.1 times full_decay (a decay and a product)

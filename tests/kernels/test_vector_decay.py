"""Decay per key dimension (GLA, `[B, T, H, M]`) and packed rows (`segment_ids`) in causal linear
attention: every method against the float64 recurrence, gradients against the quadratic form,
strong and −inf decays, decoding steps, and bad shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import causal_linear_attention_loop, rel_err

METHODS = K.METHODS
B, T, H, M, DV = 2, 21, 2, 3, 2


@functools.partial(
    jax.jit, static_argnames=("method", "normalize", "chunk_size", "with_state", "with_segments")
)
def run(
    q,
    k,
    v,
    a,
    kv0,
    k_sum0,
    seg,
    *,
    method,
    normalize=True,
    chunk_size=8,
    with_state=True,
    with_segments=False,
):
    state = K.LinearAttentionState(kv0, k_sum0) if with_state else None
    return K.causal_linear_attention(
        q,
        k,
        v,
        log_decay=a,
        normalize=normalize,
        method=method,
        chunk_size=chunk_size,
        initial_state=state,
        return_state=True,
        segment_ids=seg if with_segments else None,
    )


def inputs(seed=0, strong=False, T=T):
    rng = np.random.default_rng(seed)
    q = np.abs(rng.normal(size=(B, T, H, M))) + 0.1
    k = np.abs(rng.normal(size=(B, T, H, M))) + 0.1
    v = rng.normal(size=(B, T, H, DV))
    a = -rng.uniform(0.0, 1.5, size=(B, T, H, M))
    if strong:  # −30 per token in one dimension every few tokens, and resets (−inf)
        a[:, ::3, :, 1] = -30.0
        a[0, 7, 0, :] = -np.inf  # a full reset
        a[1, 12, 1, 2] = -np.inf  # one dimension only
    kv0 = rng.normal(size=(B, H, M, DV))
    k_sum0 = np.abs(rng.normal(size=(B, H, M))) + 0.5
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, a, kv0, k_sum0))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("strong", [False, True])
def test_vector_decay_matches_float64_recurrence(method, strong):
    q, k, v, a, kv0, k_sum0 = inputs(seed=1, strong=strong)
    for normalize in (True, False):
        for with_state in (True, False):
            o, state = run(
                q,
                k,
                v,
                a,
                kv0,
                k_sum0,
                None,
                method=method,
                normalize=normalize,
                with_state=with_state,
            )
            init = (kv0, k_sum0) if with_state else (None, None)
            ref_o, ref_kv, ref_sum = causal_linear_attention_loop(
                q, k, v, a, *init, normalize=normalize
            )
            where = f"{method} normalize={normalize} init={with_state}"
            assert np.all(np.isfinite(o)), where
            assert rel_err(o, ref_o) < 1e-5, where
            assert rel_err(state.kv, ref_kv) < 1e-5, where
            assert rel_err(state.k_sum, ref_sum) < 1e-5, where


@pytest.mark.parametrize("chunk_size", [1, 4, 13, 32])  # sub-blocks of 1, 4, 13 and 16 tokens
def test_vector_decay_chunk_sizes(chunk_size):
    q, k, v, a, kv0, k_sum0 = inputs(seed=2, strong=True, T=40)
    o, state = run(q, k, v, a, kv0, k_sum0, None, method="chunk", chunk_size=chunk_size)
    ref_o, ref_kv, _ = causal_linear_attention_loop(q, k, v, a, kv0, k_sum0)
    assert rel_err(o, ref_o) < 1e-5
    assert rel_err(state.kv, ref_kv) < 1e-5


def test_vector_decay_equal_across_dimensions_is_the_scalar_decay():
    q, k, v, a, kv0, k_sum0 = inputs(seed=3)
    a_BTH = a[..., 0]
    o_vec, s_vec = run(
        q, k, v, jnp.repeat(a_BTH[..., None], M, -1), kv0, k_sum0, None, method="chunk"
    )
    o_sca, s_sca = run(q, k, v, a_BTH, kv0, k_sum0, None, method="chunk")
    assert rel_err(o_vec, o_sca) < 1e-6 and rel_err(s_vec.kv, s_sca.kv) < 1e-6


def grad_fn(method, with_segments=False):
    def loss(q, k, v, a, kv0, k_sum0, seg):
        o, state = run(
            q, k, v, a, kv0, k_sum0, seg, method=method, chunk_size=8, with_segments=with_segments
        )
        w_o = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        w_s = jnp.sin(jnp.arange(state.kv.size, dtype=jnp.float32)).reshape(state.kv.shape)
        return jnp.sum(o * w_o) + jnp.sum(state.kv * w_s) + 0.3 * jnp.sum(state.k_sum)

    return jax.jit(jax.grad(loss, argnums=range(6)))


@pytest.mark.parametrize("method", ["chunk", "scan", "associative_scan"])
def test_vector_decay_gradients_match_quadratic(method):
    q, k, v, a, kv0, k_sum0 = inputs(seed=4)
    a = a.at[:, ::4, :, 0].set(-30.0)
    grads = grad_fn(method)(q, k, v, a, kv0, k_sum0, None)
    ref = grad_fn("quadratic")(q, k, v, a, kv0, k_sum0, None)
    for name, g, r in zip(("q", "k", "v", "log_decay", "kv0", "k_sum0"), grads, ref, strict=True):
        assert g.shape == r.shape and rel_err(g, r) < 1e-4, (method, name)


def test_vector_decay_gradient_by_finite_differences():
    # The closed form dL/dB = q·dq − k·dk per key dimension, against central differences (f64
    # reference loss), in the chunk method with sub-blocks of 4 tokens.
    q, k, v, a, kv0, k_sum0 = inputs(seed=5, T=9)
    idx = [(0, 2, 1, 0), (1, 6, 0, 2), (0, 8, 1, 1)]
    g = jax.jit(
        jax.grad(
            lambda a: jnp.sum(
                run(q, k, v, a, kv0, k_sum0, None, method="chunk", chunk_size=4)[0] * v[..., :1]
            )
        )
    )(a)
    for i in idx:
        h = 1e-4
        f = [
            np.sum(
                causal_linear_attention_loop(q, k, v, np.asarray(a, np.float64) + dx, kv0, k_sum0)[
                    0
                ]
                * np.asarray(v)[..., :1]
            )
            for dx in (
                np.eye(a.size)[np.ravel_multi_index(i, a.shape)].reshape(a.shape) * s
                for s in (h, -h)
            )
        ]
        assert abs(float(g[i]) - (f[0] - f[1]) / (2 * h)) < 1e-3 * max(1.0, abs(float(g[i])))


def test_recurrent_step_with_vector_decay():
    q, k, v, a, kv0, k_sum0 = inputs(seed=6, strong=True)
    step = jax.jit(K.recurrent_step)
    state = K.LinearAttentionState(kv0, k_sum0)
    outs = []
    for t in range(T):
        o_t, state = step(state, q[:, t], k[:, t], v[:, t], log_decay=a[:, t])
        outs.append(o_t)
    ref_o, ref_kv, ref_sum = causal_linear_attention_loop(q, k, v, a, kv0, k_sum0)
    assert rel_err(jnp.stack(outs, 1), ref_o) < 1e-5
    assert rel_err(state.kv, ref_kv) < 1e-5 and rel_err(state.k_sum, ref_sum) < 1e-5


# ---- packed rows ----

SEG = np.array([[0] * 5 + [1] * 9 + [2] * 7, [4] * 3 + [9] * 18])  # [B, T]


# Every method with the per-key decay; the scalar and absent decays through the two chunk forms
# (their own reset paths) in the default run, through the other methods under `-m slow`.
SEGMENT_CASES = [
    (decay, method)
    if decay == "vector" or method in ("chunk", "chunk_parallel")
    else pytest.param(decay, method, marks=pytest.mark.slow)
    for decay in ("none", "head", "vector")
    for method in METHODS
]


@pytest.mark.parametrize("decay, method", SEGMENT_CASES)
def test_segments_equal_each_document_alone(decay, method):
    q, k, v, a, kv0, k_sum0 = inputs(seed=7)
    a = {"none": None, "head": a[..., 0], "vector": a}[decay]
    seg = jnp.asarray(SEG, jnp.int32)
    o, state = run(q, k, v, a, kv0, k_sum0, seg, method=method, with_segments=True)
    ref_o, ref_kv, ref_sum = causal_linear_attention_loop(q, k, v, a, kv0, k_sum0, segment_ids=SEG)
    assert rel_err(o, ref_o) < 1e-5 and rel_err(state.kv, ref_kv) < 1e-5
    assert rel_err(state.k_sum, ref_sum) < 1e-5
    # the second document of row 0, alone and from an empty state
    doc = slice(5, 14)
    a_doc = None if a is None else (a[:1, doc] if a.ndim > 1 else a)
    o_doc = K.causal_linear_attention(
        q[:1, doc], k[:1, doc], v[:1, doc], log_decay=a_doc, method=method, chunk_size=8
    )
    assert rel_err(o[:1, doc], o_doc) < 1e-5


def test_segment_gradients_do_not_cross_a_boundary():
    q, k, v, a, kv0, k_sum0 = inputs(seed=8, T=12)
    seg = jnp.asarray([[0] * 6 + [1] * 6] * B, jnp.int32)

    def second_doc(k, v, a, method):
        o = run(q, k, v, a, kv0, k_sum0, seg, method=method, chunk_size=4, with_segments=True)
        return jnp.sum(o[0][:, 6:] ** 2)

    def doc_grads(method):
        return jax.jit(jax.grad(functools.partial(second_doc, method=method), (0, 1, 2)))(k, v, a)

    ref = doc_grads("quadratic")
    for method in METHODS:
        grads = doc_grads(method)
        for g in grads:
            assert np.all(np.isfinite(g)), method
            assert np.all(np.asarray(g)[:, :6] == 0.0), method
        # and the gradient inside the document agrees with the quadratic method's
        for g, r in zip(grads, ref, strict=True):
            assert rel_err(g, r) < 1e-4, method


def test_segments_and_vector_decay_through_the_chunk_with_long_strong_decays():
    # −30 per token in every key dimension: finite, and each output is its own token's value
    # (normalised, exp(−30) ≈ 1e−13 of anything earlier)
    T_long = 4096
    rng = np.random.default_rng(9)
    q = jnp.asarray(np.abs(rng.normal(size=(1, T_long, 1, 4))) + 0.1, jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, T_long, 1, 2)), jnp.float32)
    a = jnp.full((1, T_long, 1, 4), -30.0).at[..., 0].set(-0.01)
    seg = jnp.asarray(np.repeat(np.arange(T_long // 100 + 1), 100)[None, :T_long], jnp.int32)
    o = K.causal_linear_attention(q, q, v, log_decay=a, segment_ids=seg)
    assert np.all(np.isfinite(o))
    ref_o = causal_linear_attention_loop(
        q[:, :300], q[:, :300], v[:, :300], a[:, :300], segment_ids=seg[:, :300]
    )[0]
    assert rel_err(o[:, :300], ref_o) < 1e-5


@pytest.mark.slow
def test_vector_decay_65536_tokens_strong_decays_finite():
    T_long = 65536
    rng = np.random.default_rng(10)
    q = jnp.asarray(np.abs(rng.normal(size=(1, T_long, 1, 4))), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, T_long, 1, 4)), jnp.float32)
    a = jnp.asarray(-rng.uniform(0, 30, size=(1, T_long, 1, 4)), jnp.float32)
    o, state = K.causal_linear_attention(q, q, v, log_decay=a, return_state=True)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(state.kv))
    ref_o = causal_linear_attention_loop(q[:, -64:], q[:, -64:], v[:, -64:], a[:, -64:])[0]
    # 64 tokens back every weight is below exp(−30·64·…) relative: the tail is self-contained
    assert rel_err(o[:, -32:], ref_o[:, -32:]) < 1e-4


# ---- bad input ----


def test_bad_vector_decay_and_segments_raise():
    q, k, v, a, kv0, k_sum0 = inputs()
    cla = K.causal_linear_attention
    state = K.LinearAttentionState(kv0, k_sum0)
    cases = [
        (lambda: cla(q, k, v, log_decay=a[..., :2]), r"log_decay of shape .* does not broadcast"),
        (lambda: cla(q, k, v, log_decay=a[..., None]), "has rank 5"),
        (lambda: cla(q, k, v, log_decay=a[:, :, 0, 0]), "has rank 2"),  # [B, T] is ambiguous
        (lambda: cla(q, k, v, segment_ids=jnp.zeros((B, T - 1), jnp.int32)), "segment_ids"),
        (lambda: cla(q, k, v, segment_ids=jnp.zeros((B, T), jnp.float32)), "integers"),
        (
            lambda: cla(q, k, v, segment_ids=jnp.zeros((B * T,), jnp.int32)),
            rf"segment_ids must be integers of shape \[B, T\] = .*, got shape \({B * T},\)",
        ),
        (
            lambda: K.recurrent_step(state, q[:, 0], k[:, 0], v[:, 0], log_decay=a[:, 0, :, :2]),
            "log_decay of shape",
        ),
        (
            lambda: K.recurrent_step(state, q[:, 0], k[:, 0], v[:, 0], log_decay=a[:, :1]),
            "has rank 4",
        ),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            fn()

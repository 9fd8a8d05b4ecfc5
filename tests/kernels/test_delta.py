"""The delta rule: both methods against the float64 recurrence and a hand-computed case;
gradients against autodiff of the scan, causality, decoding steps, resets and segment ids,
bfloat16, a long sequence, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import delta_rule_loop, rel_err

B, T, H, KD, DV = 2, 37, 2, 3, 4
# (method, chunk_size): 16 does not divide T; 64 ≥ T is a single chunk
METHODS = [("scan", 64), ("chunk", 1), ("chunk", 16), ("chunk", 64)]


@functools.partial(jax.jit, static_argnames=("method", "chunk_size", "return_state"))
def run(q, k, v, beta, log_decay, s0, *, method, chunk_size, return_state=True):
    state = None if s0 is None else K.LinearAttentionState(s0, None)
    return K.delta_rule(
        q,
        k,
        v,
        beta,
        log_decay=log_decay,
        method=method,
        chunk_size=chunk_size,
        initial_state=state,
        return_state=return_state,
    )


delta_rule = jax.jit(K.delta_rule, static_argnames=("method", "chunk_size", "return_state"))


def make_inputs(seed=0, T=T, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, KD))
    k = rng.normal(size=(B, T, H, KD))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # as the mixers feed it
    v = rng.normal(size=(B, T, H, DV))
    beta = rng.uniform(0.05, 1.95, size=(B, T, H))  # β > 1: negative eigenvalues
    per_token = -rng.uniform(0.0, 1.0, size=(B, T, H))
    per_token[0, 5, 1] = per_token[1, min(20, T - 1)] = -np.inf  # resets
    decays = {"none": None, "per_head": np.log([0.9, 0.6]), "per_token": per_token}
    s0 = rng.normal(size=(B, H, KD, DV))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    decays = {n: None if a is None else jnp.asarray(a, jnp.float32) for n, a in decays.items()}
    return cast(q), cast(k), cast(v), jnp.asarray(beta, jnp.float32), decays, cast(s0)


@pytest.mark.parametrize("decay", ["none", "per_head", "per_token"])
@pytest.mark.parametrize("method, chunk_size", METHODS)
def test_matches_float64_recurrence(method, chunk_size, decay):
    q, k, v, beta, decays, s0 = make_inputs()
    o, state = run(q, k, v, beta, decays[decay], s0, method=method, chunk_size=chunk_size)
    o_ref, s_ref = delta_rule_loop(q, k, v, beta, decays[decay], s0)
    assert o.dtype == jnp.float32 and state.kv.dtype == jnp.float32 and state.k_sum is None
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(state.kv, s_ref) < 1e-5


@pytest.mark.parametrize("method", ["scan", "chunk"])
def test_zero_initial_state_is_the_default(method):
    q, k, v, beta, decays, _ = make_inputs(1)
    o = run(q, k, v, beta, decays["per_token"], None, method=method, chunk_size=16)[0]
    o_ref, _ = delta_rule_loop(q, k, v, beta, decays["per_token"])
    assert rel_err(o, o_ref) < 1e-5
    o_only = delta_rule(q, k, v, beta, log_decay=decays["per_token"], method=method)
    np.testing.assert_allclose(o_only, o, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decay", [None, 0.5])
@pytest.mark.parametrize("method, chunk_size", [("scan", 1), ("chunk", 1), ("chunk", 2)])
def test_hand_computed_two_tokens(method, chunk_size, decay):
    """k1 = k2 = [1,0], v1 = [1,0], v2 = [0,2], β = (1, ½), q1 = [1,1], q2 = [3,1], γ2 = decay.

    S1 = k1v1ᵀ = [[1,0],[0,0]];  S2 = γ(I − ½k2k2ᵀ)S1 + ½k2v2ᵀ = [[γ/2, 1],[0, 0]];
    o1 = S1ᵀq1 = [1, 0];  o2 = S2ᵀq2 = [3γ/2, 3]   (γ = 1 without decay).
    """
    k = jnp.array([[1.0, 0.0], [1.0, 0.0]])[None, :, None]
    v = jnp.array([[1.0, 0.0], [0.0, 2.0]])[None, :, None]
    q = jnp.array([[1.0, 1.0], [3.0, 1.0]])[None, :, None]
    beta = jnp.array([1.0, 0.5])[None, :, None]
    log_decay = None if decay is None else jnp.log(jnp.array([1.0, decay]))[None, :, None]
    o, state = K.delta_rule(
        q, k, v, beta, log_decay=log_decay, method=method, chunk_size=chunk_size, return_state=True
    )
    g = 1.0 if decay is None else decay
    np.testing.assert_allclose(o[0, :, 0], [[1.0, 0.0], [1.5 * g, 3.0]], rtol=1e-6)
    np.testing.assert_allclose(state.kv[0, 0], [[g / 2, 1.0], [0.0, 0.0]], rtol=1e-6)


def _loss(method, chunk_size, cotangent):
    def loss(q, k, v, beta, log_decay, s0):
        o, state = K.delta_rule(
            q,
            k,
            v,
            beta,
            log_decay=log_decay,
            method=method,
            chunk_size=chunk_size,
            initial_state=K.LinearAttentionState(s0, None),
            return_state=True,
        )
        return jnp.vdot(o, cotangent) + jnp.sum(jnp.sin(state.kv))

    return jax.jit(jax.grad(loss, argnums=range(6)))


@pytest.mark.parametrize("decay", ["none", "per_token"])
@pytest.mark.parametrize("chunk_size", [1, 16])
def test_chunk_gradients_match_autodiff_of_scan(chunk_size, decay):
    q, k, v, beta, decays, s0 = make_inputs(2)
    a = decays[decay]
    if a is None:  # a zero log decay: the gradient of DeltaNet w.r.t. a (at a = 0) also counts
        a = jnp.zeros((B, T, H), jnp.float32)
    g = jax.random.normal(jax.random.key(0), (B, T, H, DV))
    ref = _loss("scan", 64, g)(q, k, v, beta, a, s0)
    got = _loss("chunk", chunk_size, g)(q, k, v, beta, a, s0)
    for name, x, r in zip(("q", "k", "v", "beta", "log_decay", "s0"), got, ref, strict=True):
        assert np.all(np.isfinite(x)), name
        assert rel_err(x, r) < 1e-4, name
    if decay == "per_token":  # a reset cuts every path through it: no gradient to its log decay
        assert got[4][1, 20, 0] == 0.0


def test_causal_by_gradients():
    q, k, v, beta, decays, s0 = make_inputs(3, T=20)
    t = 9

    def out_t(q, k, v, beta, a):
        o = delta_rule(q, k, v, beta, log_decay=a, chunk_size=8, initial_state=None)
        return jnp.sum(o[:, t])

    grads = jax.jit(jax.grad(out_t, argnums=range(5)))(q, k, v, beta, decays["per_token"][:, :20])
    for name, g in zip(("q", "k", "v", "beta", "log_decay"), grads, strict=True):
        assert np.all(np.asarray(g)[:, t + 1 :] == 0.0), name
        assert np.any(np.asarray(g)[:, : t + 1] != 0.0), name


@pytest.mark.parametrize("decay", ["none", "per_token"])
def test_step_token_by_token_equals_the_sequence(decay):
    q, k, v, beta, decays, s0 = make_inputs(4, T=12)
    a = None if decays[decay] is None else decays[decay][:, :12]
    o_seq, s_seq = run(q, k, v, beta, a, s0, method="chunk", chunk_size=8)
    step = jax.jit(K.delta_rule_step)
    state = K.LinearAttentionState(s0, None)
    outs = []
    for t in range(12):
        o_t, state = step(
            state, q[:, t], k[:, t], v[:, t], beta[:, t], log_decay=None if a is None else a[:, t]
        )
        outs.append(o_t)
    np.testing.assert_allclose(np.stack(outs, 1), o_seq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.kv, s_seq.kv, rtol=1e-5, atol=1e-5)
    assert state.k_sum is None and state.size_bytes == B * H * KD * DV * 4


def test_segment_ids_equal_each_document_alone():
    q, k, v, beta, decays, s0 = make_inputs(5, T=23)
    a = decays["per_token"][:, :23].at[:, :].set(jnp.maximum(decays["per_token"][:, :23], -2.0))
    ids = np.zeros((B, 23), np.int32)
    ids[0, 7:] = 1
    ids[0, 15:] = 4  # documents [0, 7), [7, 15), [15, 23) in row 0
    ids[1, 11:] = 2  # and [0, 11), [11, 23) in row 1
    state0 = K.LinearAttentionState(s0, None)
    kw = dict(log_decay=a, initial_state=state0, return_state=True)
    for method, chunk_size in (("scan", 64), ("chunk", 4), ("chunk", 64)):
        o, state = delta_rule(
            q, k, v, beta, method=method, chunk_size=chunk_size, segment_ids=ids, **kw
        )
        for b, bounds in ((0, (0, 7, 15, 23)), (1, (0, 11, 23))):
            for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                # the initial state flows into the first document only
                o_ref, s_ref = delta_rule_loop(
                    *(x[b : b + 1, lo:hi] for x in (q, k, v, beta, a)),
                    s0=s0[b : b + 1] if i == 0 else None,
                )
                np.testing.assert_allclose(o[b, lo:hi], o_ref[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(state.kv[b], s_ref[0], rtol=1e-5, atol=1e-5)
    # a reset is a log decay of −inf: the same numbers
    starts = jnp.asarray(np.diff(ids, axis=1, prepend=ids[:, :1]) != 0)[..., None]
    o_inf = delta_rule(q, k, v, beta, log_decay=jnp.where(starts, -jnp.inf, a), chunk_size=4)
    o_seg = delta_rule(q, k, v, beta, log_decay=a, chunk_size=4, segment_ids=ids)
    np.testing.assert_array_equal(o_inf, o_seg)


def test_gradients_through_resets_are_finite():
    q, k, v, beta, _, s0 = make_inputs(6, T=16)
    ids = jnp.asarray(np.repeat([[0] * 5 + [1] * 6 + [2] * 5], B, axis=0))
    a = jnp.full((B, 16, H), -jnp.inf).at[:, 1::3].set(-0.3)  # mostly resets: worst case

    def loss(q, k, v, beta, a, s0, method):
        o = delta_rule(
            q,
            k,
            v,
            beta,
            log_decay=a,
            method=method,
            chunk_size=8,
            segment_ids=ids,
            initial_state=K.LinearAttentionState(s0, None),
        )
        return jnp.sum(o**2)

    grad = jax.jit(jax.grad(loss, argnums=range(6)), static_argnums=6)
    ref = grad(q, k, v, beta, a, s0, "scan")
    got = grad(q, k, v, beta, a, s0, "chunk")
    for x, r in zip(got, ref, strict=True):
        assert np.all(np.isfinite(x))
        np.testing.assert_allclose(x, r, rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs():
    q, k, v, beta, decays, s0 = make_inputs(7, dtype=jnp.bfloat16)
    o, state = run(q, k, v, beta, decays["per_token"], s0, method="chunk", chunk_size=16)
    assert o.dtype == jnp.bfloat16 and state.kv.dtype == jnp.float32
    o_ref, _ = delta_rule_loop(q.astype(jnp.float32), k, v, beta, decays["per_token"], s0)
    assert rel_err(o.astype(jnp.float32), o_ref) < 2e-2


def test_long_sequence_is_finite():
    """T = 16384, no decay, β near 2 (reflections): the state stays bounded."""
    T_long = 16384
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq, (1, T_long, 1, 4))
    k = jax.random.normal(kk, (1, T_long, 1, 4))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(kv, (1, T_long, 1, 4))
    beta = jnp.full((1, T_long, 1), 1.99)
    o, state = jax.jit(functools.partial(K.delta_rule, return_state=True))(q, k, v, beta)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(state.kv))
    assert float(jnp.max(jnp.abs(state.kv))) < 100.0


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=np.zeros((B, T, KD))), "q must have rank 4"),
        (dict(k=np.zeros((B, T, H, KD + 1))), r"q / k disagree on K \(key width\)"),
        (dict(v=np.zeros((B, T + 1, H, DV))), r"q / k / v / beta disagree on T \(time\)"),
        (dict(beta=np.zeros((B, T, H + 1))), r"q / k / v / beta disagree on H \(heads\)"),
        (dict(beta=np.zeros((B, T))), "beta must have rank 3"),
        (dict(beta=np.full((B, T, H), 2.5)), "beta must lie in"),
        (dict(log_decay=np.full((H,), 0.1)), "log_decay must be <= 0"),
        (dict(log_decay=np.zeros((T,))), "log_decay of shape"),
        (dict(method="quadratic"), "unknown method 'quadratic'"),
        (dict(chunk_size=0), "chunk_size must be an integer"),
        (dict(initial_state=K.LinearAttentionState.zeros(B, H, KD, DV)), "k_sum must be None"),
        (
            dict(initial_state=K.LinearAttentionState(np.zeros((B, H, DV, KD)), None)),
            r"initial_state.kv has shape",
        ),
        (
            dict(segment_ids=np.zeros((B, T + 1), np.int32)),
            rf"segment_ids must be integers of shape \[B, T\] = \({B}, {T}\), got shape",
        ),
        (dict(segment_ids=np.zeros((B, T), np.float32)), "segment_ids must be integers"),
    ],
)
def test_bad_inputs_raise(change, match):
    q, k, v, beta, _, _ = make_inputs()
    args = dict(q=q, k=k, v=v, beta=beta)
    args.update({n: change.pop(n) for n in list(change) if n in args})
    with pytest.raises(ValueError, match=match):
        K.delta_rule(args["q"], args["k"], args["v"], args["beta"], **change)


def test_step_bad_inputs_raise():
    state = K.LinearAttentionState(jnp.zeros((B, H, KD, DV)), None)
    q = k = jnp.zeros((B, H, KD))
    v = jnp.zeros((B, H, DV))
    with pytest.raises(ValueError, match="beta must have rank 2"):
        K.delta_rule_step(state, q, k, v, jnp.zeros((B, H, 1)))
    with pytest.raises(ValueError, match="state.kv has shape"):
        K.delta_rule_step(state, q, k, jnp.zeros((B, H, DV + 1)), jnp.zeros((B, H)))
    with pytest.raises(ValueError, match="state.k_sum must be None"):
        K.delta_rule_step(K.LinearAttentionState.zeros(B, H, KD, DV), q, k, v, jnp.zeros((B, H)))

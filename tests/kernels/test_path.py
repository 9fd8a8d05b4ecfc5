"""PaTH attention: both methods, the cached decoding path and the gradients (q, k, v, w, β and the
gate) against the float64 token-by-token loop of `reference.py`, with resets, packed rows and T
not a multiple of the block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from linear_attention.kernels.softmax.gated_cache import empty_cache
from tests.kernels.reference import path_attention_loop, rel_err

B, T, H, D, DV = 2, 11, 2, 4, 3
SEGMENTS = jnp.asarray([[0] * 4 + [1] * 7, [5] * 9 + [2] * 2], jnp.int32)


def inputs(seed=0, t=T):
    keys = jax.random.split(jax.random.key(seed), 6)
    q, k, w = (jax.random.normal(x, (B, t, H, D)) for x in keys[:3])
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    v = jax.random.normal(keys[3], (B, t, H, DV))
    beta = 2.0 * jax.nn.sigmoid(2.0 * jax.random.normal(keys[4], (B, t, H)))  # (0, 2)
    a = jax.nn.log_sigmoid(jax.random.normal(keys[5], (B, t, H)) + 1.0)
    return q, k, v, w, beta, a


@jax.jit(static_argnames=("method", "block_size"))
def run(q, k, v, w, beta, a, seg, *, method, block_size):
    return K.path_attention(
        q, k, v, w, beta, a, method=method, block_size=block_size, segment_ids=seg
    )


@pytest.mark.parametrize("method", K.PATH.supported)
@pytest.mark.parametrize("case", ["gate", "no_gate", "reset", "segments", "reflections"])
def test_matches_the_float64_loop(method, case):
    """T = 11 with blocks of 4: three blocks, the last one short."""
    q, k, v, w, beta, a = inputs()
    seg = None
    if case == "no_gate":
        a = None
    if case == "reset":  # a reset mid-sequence on one head of one row
        a = a.at[0, 6, 1].set(-jnp.inf)
    if case == "segments":
        seg = SEGMENTS
    if case == "reflections":  # β = 2: every H_t is an exact reflection (norm-preserving)
        beta = jnp.full_like(beta, 2.0)
    out = run(q, k, v, w, beta, a, seg, method=method, block_size=4)
    want = path_attention_loop(q, k, v, w, beta, a, segment_ids=seg)
    assert out.shape == (B, T, H, DV) and out.dtype == jnp.float32
    assert rel_err(out, want) < 1e-5
    # the transforms matter: with β = 0 (H = I) this is FoX, which differs
    fox = path_attention_loop(q, k, v, w, 0.0 * beta, a, segment_ids=seg)
    assert rel_err(fox, want) > 1e-2


def test_beta_zero_is_forgetting_attention():
    q, k, v, w, beta, a = inputs(seed=1)
    out = run(q, k, v, w, jnp.zeros_like(beta), a, SEGMENTS, method="chunk", block_size=3)
    fox = jax.jit(K.forgetting_attention, static_argnames="method")(
        q, k, v, a, method="quadratic", segment_ids=SEGMENTS
    )
    assert rel_err(out, fox) < 1e-5


def test_gradients_match_the_float64_loop():
    """Both methods' gradients agree (q, k, v, w, β, the gate; blocks of 3 and 8 over T = 7), the
    blockwise one matches central differences of the float64 loop in w, β and the gate."""
    t = 7
    q, k, v, w, beta, a = inputs(seed=3, t=t)
    a = a.at[1, 4, 0].set(-jnp.inf)  # a reset: no gradient may cross it
    proj = jax.random.normal(jax.random.key(9), (B, t, H, DV))

    def loss(method, block_size=3):
        def f(*args):
            return jnp.sum(K.path_attention(*args, method=method, block_size=block_size) * proj)

        return jax.jit(jax.grad(f, argnums=tuple(range(6))))

    grads = loss("chunk")(q, k, v, w, beta, a)
    ref = loss("quadratic")(q, k, v, w, beta, a)
    one_block = loss("chunk", 8)(q, k, v, w, beta, a)  # T ≤ block: the in-block terms only
    for g, r, g1 in zip(grads, ref, one_block, strict=True):
        assert rel_err(g, r) < 1e-5 and rel_err(g1, r) < 1e-5
    args64 = [np.asarray(x, np.float64) for x in (q, k, v, w, beta, a)]
    eps = 1e-6
    for arg, idx in [(3, (0, 2, 1, 3)), (3, (1, 6, 0, 0)), (4, (0, 5, 1)), (4, (1, 2, 0)),
                     (5, (0, 3, 0)), (1, (1, 1, 1, 2))]:  # fmt: skip
        up, down = [x.copy() for x in args64], [x.copy() for x in args64]
        up[arg][idx] += eps
        down[arg][idx] -= eps
        fd = (
            np.sum(path_attention_loop(*up) * np.asarray(proj))
            - np.sum(path_attention_loop(*down) * np.asarray(proj))
        ) / (2 * eps)
        assert abs(float(grads[arg][idx]) - fd) < 1e-4 * max(1.0, abs(fd)), (arg, idx)


@pytest.mark.parametrize("method", K.PATH.supported)
def test_no_gradient_crosses_a_reset(method):
    """Queries after a reset (row 1, head 0, reset at t = 4) depend on nothing before it, nor
    on H_4 (P_ij uses H_{j+1} … H_i only): those cotangents vanish; the others do not."""
    t = 7
    q, k, v, w, beta, a = inputs(seed=5, t=t)
    a = a.at[1, 4, 0].set(-jnp.inf)

    def f(*args):
        return jnp.sum(K.path_attention(*args, method=method, block_size=3)[1, 4:, 0])

    grads = jax.jit(jax.grad(f, argnums=tuple(range(6))))(q, k, v, w, beta, a)
    for i, g in enumerate(grads):
        before = 5 if i in (3, 4) else 4  # w and β of the reset token itself are unused
        assert float(jnp.abs(g[1, :before, 0]).max()) < 1e-7, i
        assert float(jnp.abs(g[1, 4:, 0]).max()) > 1e-4 or i in (0, 5), i
    assert float(jnp.abs(grads[0][1, 4:, 0]).max()) > 1e-4  # the queries after it
    assert float(jnp.abs(grads[5][1, 5:, 0]).max()) > 1e-4  # the gates after it


def test_cached_prefill_and_steps_equal_the_full_pass():
    q, k, v, w, beta, a = inputs(seed=4)
    a = a.at[1, 8, 0].set(-jnp.inf)  # a reset among the decoded tokens
    full = path_attention_loop(q, k, v, w, beta, a)
    cache = empty_cache(B, 16, H, D, DV, jnp.float32)
    cached = jax.jit(K.cached_path_attention)
    head, cache = cached(cache, 0, q[:, :5], k[:, :5], v[:, :5], w[:, :5], beta[:, :5], a[:, :5])
    outs = [head]
    step = jax.jit(K.path_attention_step)
    for t in range(5, 8):
        o, cache = step(cache, t, q[:, t], k[:, t], v[:, t], w[:, t], beta[:, t], a[:, t])
        outs.append(o[:, None])
    # a second prefill from a filled cache (the new queries are carried back to its end)
    tail, cache = cached(cache, 8, q[:, 8:], k[:, 8:], v[:, 8:], w[:, 8:], beta[:, 8:], a[:, 8:])
    outs.append(tail)
    assert rel_err(jnp.concatenate(outs, axis=1), full) < 1e-5
    # the stored keys are the keys transported to the last token: H_{T−1} ⋯ H_{j+1} k_j
    k64, w64, b64 = (np.asarray(x, np.float64) for x in (k, w, beta))
    moved = k64[0, 2, 1]
    for t in range(3, T):
        moved = moved - b64[0, t, 1] * (w64[0, t, 1] @ moved) * w64[0, t, 1]
    np.testing.assert_allclose(cache.k[0, 2, 1], moved, rtol=1e-5, atol=1e-6)
    # overflowing the cache gives NaN, not wrong numbers
    o, _ = step(cache, 16, q[:, 0], k[:, 0], v[:, 0], w[:, 0], beta[:, 0], a[:, 0])
    assert bool(jnp.all(jnp.isnan(o)))


def test_bfloat16_inputs_and_bad_input():
    q, k, v, w, beta, a = inputs()
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    out = jax.jit(K.path_attention)(bf(q), bf(k), bf(v), w, beta, a)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, path_attention_loop(q, k, v, w, beta, a)) < 3e-2
    with pytest.raises(ValueError, match="unknown method 'scan'; allowed: chunk, quadratic$"):
        K.path_attention(q, k, v, w, beta, a, method="scan")
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        K.path_attention(q, k, v, w, beta, jnp.abs(a))
    with pytest.raises(ValueError, match="no sequence-parallel form"):
        K.path_attention(q, k, v, w, beta, a, axis_name="seq")
    with pytest.raises(ValueError, match=r"beta must have rank 3 \[B, T, H\]"):
        K.path_attention(q, k, v, w, beta[..., None], a)
    with pytest.raises(ValueError, match="q / k / w disagree on D"):
        K.path_attention(q, k, v, w[..., :2], beta, a)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        K.path_attention(q, k, v, w, beta, a, block_size=0)


def test_a_time_split_over_path_is_refused_by_the_config():
    from linear_attention.training import experiment_config
    from tests.training.conftest import load_config

    config = load_config("mqar", "smoke")
    config.model.mixer = "path"
    config.mesh.num_devices, config.mesh.seq = 2, 2
    with pytest.raises(ValueError, match=r"config.mesh.seq = 2 splits the time axis.*path"):
        experiment_config(config)

"""Log-linear attention: every method, states, decoding steps and gradients against the float64
Fenwick loop of `reference.py` (a binary counter of blocks, written apart from the kernels'
bit arithmetic), with resets, packed rows, T not a multiple of the chunk and T crossing several
levels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from linear_attention.kernels.log_linear.log_linear import empty_state
from tests.kernels.reference import log_linear_attention_loop, rel_err

B, H, D, DV, L = 2, 2, 4, 3, 7  # L = 7 covers positions below 64
T = 37  # crosses levels 1..6; not a multiple of the chunks below


def inputs(seed=0, t=T, strong=False):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k = (jax.random.normal(x, (B, t, H, D)) for x in keys[:2])
    v = jax.random.normal(keys[2], (B, t, H, DV))
    a = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, t, H)) + 2.0)
    if strong:  # −30 per token on one head: only the newest keys count there
        a = a.at[:, :, 1].set(-30.0)
    lam = jax.nn.softplus(jax.random.normal(keys[4], (B, t, H, L)))
    return q, k, v, a, lam


@functools.partial(jax.jit, static_argnames=("method", "chunk_size"))
def run(q, k, v, a, lam, seg=None, s0=None, position=0, *, method, chunk_size=8):
    return K.log_linear_attention(
        q, k, v, a, lam, segment_ids=seg, method=method, chunk_size=chunk_size,
        initial_state=s0, position=position, return_state=True,
    )  # fmt: skip


CASES = ["plain", "strong", "reset", "segments", "state"]


@pytest.mark.parametrize("method", K.LOG_LINEAR_METHODS)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_loop(method, case):
    q, k, v, a, lam = inputs(strong=case == "strong")
    seg, s0, position = None, None, 0
    if case == "reset":  # a reset mid-sequence on one head of one row
        a = a.at[0, 19, 1].set(-jnp.inf)
    if case == "segments":
        seg = jnp.asarray([[0] * 13 + [1] * 24, [5] * 30 + [2] * 7], jnp.int32)
    if case == "state":  # the state of 21 earlier tokens (set bits 16, 4, 1: not chunk-aligned)
        position = jnp.int32(21)
        s0 = jax.random.normal(jax.random.key(7), (B, H, L, D, DV))
        s0 = s0 * ((21 >> jnp.arange(L)) & 1)[:, None, None]  # a slot per set bit of 21
        q, k, v, a, lam = (x[:, : 64 - 21] for x in (q, k, v, a, lam))
    o, s = run(q, k, v, a, lam, seg, s0, position, method=method)
    o_ref, s_ref = log_linear_attention_loop(
        q, k, v, a, lam, segment_ids=seg, s0=s0, position=int(position)
    )
    assert o.shape == o_ref.shape and o.dtype == jnp.float32
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


@pytest.mark.parametrize("chunk_size, t", [(1, 5), (2, 16), (16, 64), (64, 1)])
def test_chunk_sizes_and_lengths(chunk_size, t):
    """Power-of-two chunks, T below, at and past one chunk, up to the capacity 2^(L−1)."""
    q, k, v, a, lam = inputs(seed=t, t=t)
    o, s = run(q, k, v, a, lam, method="chunk", chunk_size=chunk_size)
    o_ref, s_ref = log_linear_attention_loop(q, k, v, a, lam)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


def test_the_levels_are_the_fenwick_buckets():
    """One key at a time: query t reads key j with λ_t at level bit_length(t ⊕ j) exactly (no
    decay, unit products), e.g. t = 6 reads keys 4, 5 at level 2 and 0..3 at level 3."""
    t_len = 8
    q = jnp.ones((1, t_len, 1, 1))
    v = jnp.ones((1, t_len, 1, 1))
    lam = jnp.broadcast_to(10.0 ** jnp.arange(4.0), (1, t_len, 1, 4))
    attend = jax.jit(
        lambda k: K.log_linear_attention(q, k, v, None, lam, method="chunk", chunk_size=2)
    )
    for j in range(t_len):
        o = attend(jnp.zeros((1, t_len, 1, 1)).at[0, j].set(1.0))[0, :, 0, 0]
        want = [0.0 if t < j else 10.0 ** (t ^ j).bit_length() for t in range(t_len)]
        np.testing.assert_allclose(o, want, rtol=1e-6)


def test_steps_equal_the_full_pass_and_the_prefill():
    q, k, v, a, lam = inputs(seed=4)
    a = a.at[1, 26, 0].set(-jnp.inf)  # a reset among the decoded tokens
    full, s_full = run(q, k, v, a, lam, method="chunk")
    split = 11
    head, s_head = run(*(x[:, :split] for x in (q, k, v, a, lam)), method="chunk")
    outs, state = [head], s_head
    step = jax.jit(K.log_linear_attention_step)
    for t in range(split, T):
        o, state = step(state, jnp.int32(t), q[:, t], k[:, t], v[:, t], a[:, t], lam[:, t])
        outs.append(o[:, None])
    assert rel_err(jnp.concatenate(outs, 1), full) < 1e-5
    assert rel_err(state, s_full) < 1e-5
    # a prefill of the rest from the state at `split` (traced position) gives the same
    tail, s_tail = run(*(x[:, split:] for x in (q, k, v, a, lam)), None, s_head,
                       jnp.int32(split), method="chunk")  # fmt: skip
    assert rel_err(jnp.concatenate([head, tail], 1), full) < 1e-5
    assert rel_err(s_tail, s_full) < 1e-5


def test_gradients_match_the_quadratic_form_and_finite_differences():
    q, k, v, a, lam = inputs(seed=3, t=21)
    a = a.at[0, 12, 1].set(-jnp.inf)
    w = jax.random.normal(jax.random.key(9), (B, 21, H, DV))
    ws = jax.random.normal(jax.random.key(10), (B, H, L, D, DV))

    def loss(method):
        def f(q, k, v, a, lam):
            o, s = K.log_linear_attention(
                q, k, v, a, lam, method=method, chunk_size=4, return_state=True
            )
            return jnp.sum(o * w) + jnp.sum(s * ws)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))

    ref = loss("quadratic")(q, k, v, a, lam)
    for g, r in zip(loss("chunk")(q, k, v, a, lam), ref, strict=True):
        assert rel_err(g, r) < 1e-4
    # the decay's and the level weights' gradients against central differences of the loop
    args64 = [np.asarray(x, np.float64) for x in (q, k, v, a, lam)]

    def loop_loss(a64, lam64):
        o, s = log_linear_attention_loop(*args64[:3], a64, lam64)
        return np.sum(o * np.asarray(w)) + np.sum(s * np.asarray(ws))

    eps = 1e-6
    for which, idx in [(3, (0, 2, 0)), (3, (1, 15, 1)), (4, (0, 7, 1, 3)), (4, (1, 20, 0, 5))]:
        up, down = [x.copy() for x in args64[3:]], [x.copy() for x in args64[3:]]
        up[which - 3][idx] += eps
        down[which - 3][idx] -= eps
        fd = (loop_loss(*up) - loop_loss(*down)) / (2 * eps)
        assert abs(float(ref[which][idx]) - fd) < 1e-4 * max(1.0, abs(fd)), (which, idx)
    # nothing crosses the reset on head 1 of row 0: keys before it get no gradient from after
    assert float(jnp.abs(ref[3][0, 13:, 1]).max()) > 0


def test_bfloat16_inputs():
    q, k, v, a, lam = inputs(seed=5, t=20)
    want = log_linear_attention_loop(q, k, v, a, lam)[0]
    o, s = run(*(x.astype(jnp.bfloat16) for x in (q, k, v)), a, lam.astype(jnp.bfloat16),
               method="chunk")  # fmt: skip
    assert s.dtype == jnp.float32
    assert o.dtype == jnp.bfloat16 and rel_err(o, want) < 3e-2


def test_past_the_capacity_the_outputs_are_nan():
    q, k, v, a, lam = inputs(seed=6, t=8)
    lam4 = lam[..., :4]  # 4 levels: positions below 8
    o, s = run(q, k, v, a, lam4, None, None, jnp.int32(3), method="chunk", chunk_size=2)
    assert np.isnan(o[:, 5:]).all() and not np.isnan(o[:, :5]).any() and np.isnan(s).all()
    state = empty_state(B, H, 4, D, DV)
    step = jax.jit(K.log_linear_attention_step)
    o, _ = step(state, jnp.int32(8), q[:, 0], k[:, 0], v[:, 0], a[:, 0], lam4[:, 0])
    assert np.isnan(o).all()


def test_bad_inputs_raise():
    q, k, v, a, lam = inputs(seed=1, t=9)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        K.log_linear_attention(q, k, v, a, lam, chunk_size=12)
    with pytest.raises(ValueError, match="unknown method 'blockwise'"):
        K.log_linear_attention(q, k, v, a, lam, method="blockwise")
    with pytest.raises(ValueError, match="no sequence-parallel form"):
        K.log_linear_attention(q, k, v, a, lam, axis_name="seq")
    with pytest.raises(ValueError, match=r"L=3 levels, which cover positions below 2\^\(L-1\) = 4"):
        K.log_linear_attention(q, k, v, a, lam[..., :3])
    with pytest.raises(ValueError, match=r"level_weights must have rank 4 \[B, T, H, L\]"):
        K.log_linear_attention(q, k, v, a, lam[..., 0])
    with pytest.raises(ValueError, match=r"initial_state must be the level states"):
        K.log_linear_attention(q, k, v, a, lam, initial_state=jnp.zeros((B, H, D, DV)))
    with pytest.raises(ValueError, match="position must be an integer >= 0"):
        K.log_linear_attention(q, k, v, a, lam, position=-1)
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        K.log_linear_attention(q, k, v, -a, lam)

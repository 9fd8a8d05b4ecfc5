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
from tests.kernels.reference import log_linear_attention_loop, rel_err
from tests.scripts import checked_names, run_on_cpu_devices

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
def run(q, k, v, a, lam, seg=None, state=None, *, method, chunk_size=8):
    return K.log_linear_attention(
        q, k, v, a, lam, segment_ids=seg, method=method, chunk_size=chunk_size,
        initial_state=state, return_state=True,
    )  # fmt: skip


def check(out, ref, tol=1e-4):
    (o, state), (o_ref, s_ref, p_ref) = out, ref
    assert o.shape == o_ref.shape and state.levels.dtype == jnp.float32
    assert rel_err(o, o_ref) < tol and rel_err(state.levels, s_ref) < tol
    np.testing.assert_array_equal(state.position, p_ref)


def a_state(position):
    """A state at `position [B, H]`: a random level state per set bit of the position."""
    levels = jax.random.normal(jax.random.key(7), (B, H, L, D, DV))
    bits = (position[..., None] >> np.arange(L)) & 1
    return K.LogLinearState(levels * bits[..., None, None], jnp.asarray(position, jnp.int32))


CASES = ["plain", "strong", "reset", "segments", "state"]


@pytest.mark.parametrize("method", K.LOG_LINEAR_METHODS)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_loop(method, case):
    q, k, v, a, lam = inputs(strong=case == "strong")
    seg, state = None, None
    if case == "reset":  # a reset mid-sequence on one head of one row: that head restarts
        a = a.at[0, 19, 1].set(-jnp.inf)
    if case == "segments":
        seg = jnp.asarray([[0] * 13 + [1] * 24, [5] * 30 + [2] * 7], jnp.int32)
    if case == "state":  # earlier tokens per row and head (not chunk-aligned), then 27 more
        state = a_state(np.array([[21, 5], [0, 36]]))
        q, k, v, a, lam = (x[:, :27] for x in (q, k, v, a, lam))
    ref = log_linear_attention_loop(
        q, k, v, a, lam, segment_ids=seg,
        s0=None if state is None else state.levels,
        position=None if state is None else state.position,
    )  # fmt: skip
    check(run(q, k, v, a, lam, seg, state, method=method), ref)


@pytest.mark.parametrize("chunk_size, t", [(1, 5), (3, 16), (16, 64), (64, 1)])
def test_chunk_sizes_and_lengths(chunk_size, t):
    """Chunks of any size, T below, at and past one chunk, up to the capacity 2^(L−1)."""
    q, k, v, a, lam = inputs(seed=t, t=t)
    check(run(q, k, v, a, lam, method="chunk", chunk_size=chunk_size),
          log_linear_attention_loop(q, k, v, a, lam))  # fmt: skip


def test_the_levels_are_the_fenwick_buckets():
    """One key at a time: query t reads key j with λ_t at level bit_length(t ⊕ j) exactly (no
    decay, unit products), e.g. t = 6 reads keys 4, 5 at level 2 and 0..3 at level 3."""
    t_len = 8
    q = jnp.ones((1, t_len, 1, 1))
    v = jnp.ones((1, t_len, 1, 1))
    lam = jnp.broadcast_to(10.0 ** jnp.arange(4.0), (1, t_len, 1, 4))
    attend = jax.jit(
        lambda k: K.log_linear_attention(q, k, v, None, lam, method="chunk", chunk_size=3)
    )
    for j in range(t_len):
        o = attend(jnp.zeros((1, t_len, 1, 1)).at[0, j].set(1.0))[0, :, 0, 0]
        want = [0.0 if t < j else 10.0 ** (t ^ j).bit_length() for t in range(t_len)]
        np.testing.assert_allclose(o, want, rtol=1e-6)


def test_packed_documents_are_each_alone():
    """A document starting mid-row is bucketed from its own start: the outputs of a packed row
    equal those of the document alone (FLA's variable-length form)."""
    q, k, v, a, lam = inputs(seed=2, t=20)
    seg = jnp.asarray([[0] * 7 + [1] * 13] * B, jnp.int32)
    packed, _ = run(q, k, v, a, lam, seg, method="chunk", chunk_size=4)
    alone, _ = run(*(x[:, 7:] for x in (q, k, v, a, lam)), method="chunk", chunk_size=4)
    assert rel_err(packed[:, 7:], alone) < 1e-5


def test_steps_equal_the_full_pass_and_the_prefill():
    q, k, v, a, lam = inputs(seed=4)
    a = a.at[1, 26, 0].set(-jnp.inf)  # a reset among the decoded tokens
    full = run(q, k, v, a, lam, method="chunk")
    split = 11
    head, s_head = run(*(x[:, :split] for x in (q, k, v, a, lam)), method="chunk")
    outs, state = [head], s_head
    step = jax.jit(K.log_linear_attention_step)
    for t in range(split, T):
        o, state = step(state, q[:, t], k[:, t], v[:, t], a[:, t], lam[:, t])
        outs.append(o[:, None])
    ref = log_linear_attention_loop(q, k, v, a, lam)
    check((jnp.concatenate(outs, 1), state), ref, tol=1e-5)
    check(full, ref, tol=1e-5)
    # a prefill of the rest from the state at `split` gives the same
    tail, s_tail = run(*(x[:, split:] for x in (q, k, v, a, lam)), None, s_head, method="chunk")
    check((jnp.concatenate([head, tail], 1), s_tail), ref, tol=1e-5)


def test_gradients_match_the_quadratic_form_and_finite_differences():
    q, k, v, a, lam = inputs(seed=3, t=21)
    a = a.at[0, 12, 1].set(-jnp.inf)
    state = a_state(np.array([[5, 2], [9, 0]]))
    w = jax.random.normal(jax.random.key(9), (B, 21, H, DV))
    ws = jax.random.normal(jax.random.key(10), (B, H, L, D, DV))

    def loss(method):
        def f(q, k, v, a, lam, s0):
            o, s = K.log_linear_attention(
                q, k, v, a, lam, method=method, chunk_size=4, return_state=True,
                initial_state=K.LogLinearState(s0, state.position),
            )  # fmt: skip
            return jnp.sum(o * w) + jnp.sum(s.levels * ws)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))

    ref = loss("quadratic")(q, k, v, a, lam, state.levels)
    for g, r in zip(loss("chunk")(q, k, v, a, lam, state.levels), ref, strict=True):
        assert rel_err(g, r) < 1e-4
    # the decay's and the level weights' gradients against central differences of the loop
    args64 = [np.asarray(x, np.float64) for x in (q, k, v, a, lam)]

    def loop_loss(a64, lam64):
        o, s, _ = log_linear_attention_loop(*args64[:3], a64, lam64, s0=state.levels,
                                            position=state.position)  # fmt: skip
        return np.sum(o * np.asarray(w)) + np.sum(s * np.asarray(ws))

    eps = 1e-6
    for which, idx in [(3, (0, 2, 0)), (3, (1, 15, 1)), (4, (0, 7, 1, 3)), (4, (1, 20, 0, 5))]:
        up, down = [x.copy() for x in args64[3:]], [x.copy() for x in args64[3:]]
        up[which - 3][idx] += eps
        down[which - 3][idx] -= eps
        fd = (loop_loss(*up) - loop_loss(*down)) / (2 * eps)
        assert abs(float(ref[which][idx]) - fd) < 1e-4 * max(1.0, abs(fd)), (which, idx)
    # keys before the reset on head 1 of row 0 get no gradient from the outputs after it
    assert float(jnp.abs(ref[3][0, 13:, 1]).max()) > 0


def test_bfloat16_inputs():
    q, k, v, a, lam = inputs(seed=5, t=20)
    want = log_linear_attention_loop(q, k, v, a, lam)[0]
    (o, s) = run(*(x.astype(jnp.bfloat16) for x in (q, k, v)), a, lam.astype(jnp.bfloat16),
                 method="chunk")  # fmt: skip
    assert o.dtype == jnp.bfloat16 and s.levels.dtype == jnp.float32
    assert rel_err(o, want) < 3e-2


def test_past_the_capacity_the_outputs_are_nan():
    q, k, v, a, lam = inputs(seed=6, t=8)
    lam4 = lam[..., :4]  # 4 levels: positions below 8
    state = K.LogLinearState.zeros(B, H, 4, D, DV)._replace(position=jnp.full((B, H), 3))
    o, s = run(q, k, v, a, lam4, None, state, method="chunk", chunk_size=2)
    assert np.isnan(o[:, 5:]).all() and not np.isnan(o[:, :5]).any()
    assert np.isnan(s.levels).all()
    step = jax.jit(K.log_linear_attention_step)
    o, _ = step(state._replace(position=jnp.full((B, H), 8)), q[:, 0], k[:, 0], v[:, 0], a[:, 0],
                lam4[:, 0])  # fmt: skip
    assert np.isnan(o).all()


def test_bad_inputs_raise():
    q, k, v, a, lam = inputs(seed=1, t=9)
    with pytest.raises(ValueError, match="unknown method 'blockwise'"):
        K.log_linear_attention(q, k, v, a, lam, method="blockwise")
    with pytest.raises(ValueError, match=r"L=4 levels, which cover positions below 2\^\(L-1\) = 8"):
        K.log_linear_attention(q, k, v, a, lam[..., :4])
    with pytest.raises(ValueError, match=r"level_weights must have rank 4 \[B, T, H, L\]"):
        K.log_linear_attention(q, k, v, a, lam[..., 0])
    with pytest.raises(ValueError, match="initial_state must be a LogLinearState"):
        K.log_linear_attention(q, k, v, a, lam, initial_state=jnp.zeros((B, H, L, D, DV)))
    bad = K.LogLinearState(jnp.zeros((B, H, L, D, DV)), jnp.zeros((B,), jnp.int32))
    with pytest.raises(ValueError, match=r"initial_state.position must be \[B, H\]"):
        K.log_linear_attention(q, k, v, a, lam, initial_state=bad)
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        K.log_linear_attention(q, k, v, -a, lam)


def main():
    """The time split (run in a subprocess with 8 CPU devices): 4 spans of 8 tokens, documents
    starting at a span edge and inside spans, a reset on one head, an initial state at
    positions that are not multiples of a span."""
    from tests.kernels.test_sequence_parallel import check, check_nan

    assert jax.device_count() == 8, jax.devices()
    q, k, v, a, lam = inputs(seed=11, t=32)
    a = a.at[1, 20, 0].set(-jnp.inf)
    seg = jnp.asarray([[0] * 8 + [1] * 11 + [2] * 13, [4] * 32], jnp.int32)
    position = jnp.asarray([[5, 0], [3, 12]], jnp.int32)
    bits = (np.asarray(position)[..., None] >> np.arange(L)) & 1
    s0 = jax.random.normal(jax.random.key(5), (B, H, L, D, DV)) * bits[..., None, None]
    xs = {"q": q, "k": k, "v": v, "a": a, "lam": lam, "s0": s0}

    def attend(xs, seg, *, axis_name, method):
        return K.log_linear_attention(
            xs["q"], xs["k"], xs["v"], xs["a"], xs["lam"], segment_ids=seg, method=method,
            chunk_size=4, initial_state=K.LogLinearState(xs["s0"], position), return_state=True,
            axis_name=axis_name,
        )  # fmt: skip

    out = check("chunk/segments/state/n=4", functools.partial(attend, method="chunk"), xs, seg, 4)
    check("scan/n=2", functools.partial(attend, method="scan"), xs, None, 2)
    starts = np.pad(np.diff(np.asarray(seg), axis=1) != 0, ((0, 0), (1, 0)))
    a_ref = np.where(starts[..., None], -np.inf, np.asarray(a))
    o_ref, s_ref, p_ref = log_linear_attention_loop(q, k, v, a_ref, lam, s0=s0, position=position)
    assert rel_err(out[0], o_ref) < 1e-4 and rel_err(out[1].levels, s_ref) < 1e-4
    np.testing.assert_array_equal(out[1].position, p_ref)
    print("CHECKED loop/chunk/segments/state/n=4", flush=True)
    # a NaN value in span 0 (row 0, t = 2) stops at the document start at 8 (a span edge), a NaN
    # decay in span 1 (t = 12) at 19 (inside span 2), as unsplit; finite equal gradients elsewhere
    nan_xs = {**xs, "v": v.at[0, 2, 1, 0].set(jnp.nan), "a": a.at[0, 12, 0].set(jnp.nan)}
    kernel = functools.partial(attend, method="chunk")
    check_nan("nan/chunk/segments/state/n=4", kernel, nan_xs, seg, 4)


def test_split_over_devices_equals_unsplit():
    out = run_on_cpu_devices("from tests.kernels.test_log_linear import main; main()", 8)
    assert checked_names(out) == [
        "chunk/segments/state/n=4",
        "scan/n=2",
        "loop/chunk/segments/state/n=4",
        "nan/chunk/segments/state/n=4",
    ]

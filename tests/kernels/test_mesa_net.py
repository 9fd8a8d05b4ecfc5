"""MesaNet (`kernels.mesa_net`): the chunked CG form, the token-by-token CG form and the exact
solve against the float64 loop of `reference.py` (resets, packed rows, T not a multiple of the
chunk, an initial state, the final state), the implicit gradient against central differences of
that loop and against autodiff of the exact solve, decoding step by step, and the time split
over forced CPU devices (a subprocess)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import mesa_net_loop, rel_err
from tests.scripts import checked_names, run_on_cpu_devices

B, T, H, D, DV = 2, 11, 2, 4, 3  # T = 11 with chunks of 4: a partial last chunk
SEGMENTS = np.asarray([[0] * 4 + [1] * 7, [5] * 9 + [2] * 2], np.int32)
STEPS = 12  # CG iterations: 3·K, converged to float32 rounding here

run = jax.jit(K.mesa_net, static_argnames=("method", "chunk_size", "cg_steps", "return_state"))


def unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def inputs(seed=0, t=T):
    keys = jax.random.split(jax.random.key(seed), 8)
    q, k = (unit(jax.random.normal(x, (B, t, H, D))) for x in keys[:2])
    v = jax.random.normal(keys[2], (B, t, H, DV))
    a = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, t, H)) + 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, t, H)))
    lam = jax.nn.softplus(jax.random.normal(keys[5], (H, D))) + 0.25
    kk0 = jax.random.normal(keys[6], (B, H, D, D))
    kk0 = 0.5 * kk0 @ jnp.swapaxes(kk0, -1, -2)  # a positive semi-definite H_kk
    kv0 = jax.random.normal(keys[7], (B, H, D, DV))
    return q, k, v, a, beta, lam, K.MesaNetState(kk0, kv0)


@pytest.mark.parametrize("method", K.MESA_NET.supported)
@pytest.mark.parametrize("case", ["state_and_reset", "segments", "no_decay"])
def test_matches_the_float64_loop(method, case):
    q, k, v, a, beta, lam, s0 = inputs()
    seg = init = None
    if case == "state_and_reset":  # an initial state, and a reset mid-chunk on one head
        a, init = a.at[0, 6, 1].set(-jnp.inf), s0
    if case == "segments":
        seg = jnp.asarray(SEGMENTS)
    if case == "no_decay":
        a = None
    o, state = run(q, k, v, a, beta, lam, segment_ids=seg, initial_state=init, method=method,
                   chunk_size=4, cg_steps=STEPS, return_state=True)  # fmt: skip
    o_ref, kk_ref, kv_ref = mesa_net_loop(
        q, k, v, a, beta, lam, *(s0 if init is not None else (None, None)), segment_ids=seg
    )
    assert o.shape == (B, T, H, DV) and o.dtype == jnp.float32
    for x, ref in ((o, o_ref), (state.kk, kk_ref), (state.kv, kv_ref)):
        assert rel_err(x, ref) < 1e-5


def test_few_cg_steps_give_the_same_iterates_in_both_cg_forms():
    """At 2 iterations (far from converged) the chunked and token-by-token CG agree: they are
    one algorithm per token, so `cg_steps` means the same thing in training and decoding."""
    q, k, v, a, beta, lam, s0 = inputs(seed=1)
    kw = dict(initial_state=s0, chunk_size=4, cg_steps=2)
    chunk = run(q, k, v, a, beta, lam, method="chunk", **kw)
    loop = run(q, k, v, a, beta, lam, method="scan", **kw)
    exact = mesa_net_loop(q, k, v, a, beta, lam, *s0)[0]
    assert rel_err(chunk, loop) < 1e-5
    assert rel_err(chunk, exact) > 1e-3  # truly unconverged: the check above is not vacuous


def test_gradients_against_finite_differences_and_the_exact_solve():
    t = 7
    q, k, v, a, beta, lam, s0 = inputs(seed=3, t=t)
    a = a.at[1, 4, 0].set(-jnp.inf)
    w_o = jax.random.normal(jax.random.key(9), (B, t, H, DV))
    w_kk = jax.random.normal(jax.random.key(10), (B, H, D, D))
    w_kv = jax.random.normal(jax.random.key(11), (B, H, D, DV))
    args = (q, k, v, a, beta, lam, s0.kk, s0.kv)

    def loss(method):
        def f(q, k, v, a, beta, lam, kk0, kv0):
            o, s = K.mesa_net(q, k, v, a, beta, lam, initial_state=K.MesaNetState(kk0, kv0),
                              method=method, chunk_size=3, cg_steps=STEPS,
                              return_state=True)  # fmt: skip
            return jnp.sum(o * w_o) + jnp.sum(s.kk * w_kk) + jnp.sum(s.kv * w_kv)

        return jax.jit(jax.grad(f, argnums=tuple(range(8))))

    grads = loss("chunk")(*args)
    for g, r in zip(grads, loss("exact")(*args), strict=True):
        assert rel_err(g, r) < 1e-4
    # central differences of the float64 loop, every entry of every input (a reset: none)
    np_args = [np.array(x, np.float64) for x in args]
    w64 = [np.asarray(w, np.float64) for w in (w_o, w_kk, w_kv)]

    def loop_loss(xs):
        return sum(np.sum(x * w) for x, w in zip(mesa_net_loop(*xs), w64, strict=True))

    eps = 1e-6
    for i, g in enumerate(grads):
        fd = np.zeros_like(np_args[i])
        for idx in np.ndindex(fd.shape):
            if np.isneginf(np_args[i][idx]):
                continue  # (the kernel gives a reset's log decay a zero cotangent)
            up, down = list(np_args), list(np_args)
            up[i], down[i] = np_args[i].copy(), np_args[i].copy()
            up[i][idx] += eps
            down[i][idx] -= eps
            fd[idx] = (loop_loss(up) - loop_loss(down)) / (2 * eps)
        assert rel_err(g, fd) < 1e-4, (i, rel_err(g, fd))


def test_prefill_then_steps_equal_the_full_pass():
    q, k, v, a, beta, lam, s0 = inputs(seed=4)
    a = a.at[1, 8, 0].set(-jnp.inf)  # a reset among the decoded tokens
    full, final = run(q, k, v, a, beta, lam, initial_state=s0, chunk_size=4, cg_steps=STEPS,
                      return_state=True)  # fmt: skip
    head, state = run(q[:, :5], k[:, :5], v[:, :5], a[:, :5], beta[:, :5], lam, initial_state=s0,
                      chunk_size=4, cg_steps=STEPS, return_state=True)  # fmt: skip
    step = jax.jit(functools.partial(K.mesa_net_step, cg_steps=STEPS))
    outs = [head]
    for t in range(5, T):
        o, state = step(state, q[:, t], k[:, t], v[:, t], a[:, t], beta[:, t], lam)
        outs.append(o[:, None])
    assert rel_err(jnp.concatenate(outs, axis=1), full) < 1e-5
    assert rel_err(state.kk, final.kk) < 1e-6 and rel_err(state.kv, final.kv) < 1e-6
    exact = jax.jit(functools.partial(K.mesa_net_step, cg_steps=None))
    o_exact, _ = exact(state, q[:, 0], k[:, 0], v[:, 0], a[:, 0], beta[:, 0], lam)
    o_cg, _ = step(state, q[:, 0], k[:, 0], v[:, 0], a[:, 0], beta[:, 0], lam)
    assert rel_err(o_cg, o_exact) < 1e-5


def test_bfloat16_inputs_and_bad_input():
    q, k, v, a, beta, lam, _ = inputs()
    out = run(*(x.astype(jnp.bfloat16) for x in (q, k, v)), a, beta, lam, chunk_size=4)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, mesa_net_loop(q, k, v, a, beta, lam)[0]) < 3e-2
    bad = "unknown method 'quadratic'; allowed: chunk, scan, exact$"
    with pytest.raises(ValueError, match=bad):
        K.mesa_net(q, k, v, a, beta, lam, method="quadratic")
    with pytest.raises(ValueError, match="lambda_ must be > 0"):
        K.mesa_net(q, k, v, a, beta, lam.at[0, 0].set(0.0))
    with pytest.raises(ValueError, match=r"lambda_ must have shape \[H, K\]"):
        K.mesa_net(q, k, v, a, beta, lam[0])
    with pytest.raises(ValueError, match="beta must be >= 0"):
        K.mesa_net(q, k, v, a, -beta, lam)
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        K.mesa_net(q, k, v, jnp.abs(a), beta, lam)
    with pytest.raises(ValueError, match="cg_steps must be an integer >= 1"):
        K.mesa_net(q, k, v, a, beta, lam, cg_steps=0)
    with pytest.raises(ValueError, match='method="scan" or "exact"'):  # forward mode
        jax.jvp(lambda q: K.mesa_net(q, k, v, a, beta, lam, chunk_size=4), (q,), (q,))
    with pytest.raises(ValueError, match="initial_state must be a MesaNetState"):
        K.mesa_net(q, k, v, a, beta, lam, initial_state=K.LinearAttentionState(None, None))


def main():
    """The time split (run in a subprocess with 8 CPU devices)."""
    from tests.kernels.test_sequence_parallel import check, check_nan

    assert jax.device_count() == 8, jax.devices()
    Bs, Ts = 2, 24
    seg = jnp.asarray(  # boundaries at shard edges (6, 12 of 4 shards) and inside shards
        [[0] * 6 + [1] * 6 + [2] * 3 + [3] * 9, [5] * 7 + [6] * 10 + [7] * 7], jnp.int32
    )
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    kk0 = f(Bs, H, D, D)

    def mesa(xs, seg, *, axis_name, method):
        return K.mesa_net(
            xs["q"], xs["k"], xs["v"], xs["a"], xs["beta"], xs["lam"],
            initial_state=K.MesaNetState(xs["s0"], xs["z0"]), segment_ids=seg, method=method,
            chunk_size=4, cg_steps=STEPS, return_state=True, axis_name=axis_name,
        )  # fmt: skip

    xs = {
        "q": unit(f(Bs, Ts, H, D)),
        "k": unit(f(Bs, Ts, H, D)),
        "v": f(Bs, Ts, H, DV),
        "a": -0.3 * jnp.abs(f(Bs, Ts, H)),
        "beta": jax.nn.sigmoid(f(Bs, Ts, H)),
        "lam": jax.nn.softplus(f(H, D)) + 0.25,
        "s0": 0.5 * kk0 @ jnp.swapaxes(kk0, -1, -2),
        "z0": f(Bs, H, D, DV),
    }
    out = check("chunk/segments/n=4", functools.partial(mesa, method="chunk"), xs, seg, 4)
    o_ref, kk_ref, kv_ref = mesa_net_loop(
        xs["q"], xs["k"], xs["v"], xs["a"], xs["beta"], xs["lam"], xs["s0"], xs["z0"],
        segment_ids=np.asarray(seg),
    )  # fmt: skip
    for x, ref in ((out[0], o_ref), (out[1].kk, kk_ref), (out[1].kv, kv_ref)):
        assert rel_err(x, ref) <= 1e-4, rel_err(x, ref)
    print("CHECKED loop/chunk/segments/n=4", flush=True)
    # a NaN value in shard 0 (row 0, t = 2) stops at the document start at 6 (a shard edge), a
    # NaN decay in shard 2 (row 1, t = 13) at 17, as unsplit; finite equal gradients elsewhere
    nan_xs = {
        **xs,
        "v": xs["v"].at[0, 2, 0, 1].set(jnp.nan),
        "a": xs["a"].at[1, 13, 1].set(jnp.nan),
    }
    check_nan("nan/chunk/segments/n=4", functools.partial(mesa, method="chunk"), nan_xs, seg, 4)


def test_split_over_devices_equals_unsplit():
    out = run_on_cpu_devices("from tests.kernels.test_mesa_net import main; main()", 8)
    assert checked_names(out) == [
        "chunk/segments/n=4", "loop/chunk/segments/n=4", "nan/chunk/segments/n=4"
    ]  # fmt: skip

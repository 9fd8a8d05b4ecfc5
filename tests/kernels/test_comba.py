"""Comba (`K.comba`): both methods against the float64 loop of the recurrence — outputs, final
state and the gradient of every input (by finite differences of the loop) — across packed rows,
an initial state, a decay of −inf, T = 1 and T not a multiple of the chunk; the step form
token by token; bfloat16 inputs; the method check; time split over 4 CPU devices (under
`-m slow`). The agreement with FLA's `naive_recurrent_comba` is experiments/peer_check.py's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import comba_loop, finite_difference_grads, rel_err
from tests.scripts import checked_names, run_on_cpu_devices

B, T, H, Kd, V = 2, 7, 2, 3, 2
SEGMENTS = np.array([[0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 2, 3, 3]], np.int32)
METHODS = ("chunk", "scan")
NAMES = ("q", "k", "v", "p", "beta", "g", "h0")


def inputs(seed=0, T=T):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(B, T, H, Kd))
    return {
        "q": rng.normal(size=(B, T, H, Kd)),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.normal(size=(B, T, H, V)),
        "p": 0.8 * rng.normal(size=(B, T, H, Kd)) / np.sqrt(Kd),
        "beta": rng.uniform(0.1, 1.0, size=(B, T, H)),
        "g": -rng.uniform(0.01, 1.0, size=(B, T, H)),
        "h0": rng.normal(size=(B, H, Kd, V)),
    }


def f32(xs):
    return [jnp.asarray(xs[k], jnp.float32) for k in NAMES]


@functools.cache
def kernel(method, segments, chunk_size=4):
    seg = jnp.asarray(SEGMENTS) if segments else None

    def run(q, k, v, p, beta, g, h0):
        o, state = K.comba(
            q, k, v, p, beta, log_decay=g, method=method, chunk_size=chunk_size,
            initial_state=K.LinearAttentionState(h0, None), return_state=True, segment_ids=seg,
        )  # fmt: skip
        return o, state.kv

    return jax.jit(run)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("segments", [False, True])
def test_matches_loop(method, segments):
    """T = 7 in chunks of 4 (a partial last chunk), an initial state, packed rows."""
    xs = inputs()
    o, h = kernel(method, segments)(*f32(xs))
    o_ref, h_ref = comba_loop(**xs, segment_ids=SEGMENTS if segments else None)
    assert o.dtype == h.dtype == jnp.float32
    assert rel_err(o, o_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5, (rel_err(o, o_ref), method)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_match_finite_differences(method):
    """The gradient of every input (q, k, v, p, β, g, the initial state) of
    Σ w_o ⊙ o + Σ w_S ⊙ S, packed rows, against central differences of the float64 loop."""
    xs = inputs(3)
    rng = np.random.default_rng(4)
    wo, wh = rng.normal(size=(B, T, H, V)), rng.normal(size=(B, H, Kd, V))

    def loss_ref(**kw):
        o, h = comba_loop(**kw, segment_ids=SEGMENTS)
        return np.sum(wo * o) + np.sum(wh * h)

    fd = finite_difference_grads(loss_ref, xs)
    run = kernel(method, True)

    def loss(*args):
        o, h = run(*args)
        return jnp.sum(wo * o) + jnp.sum(wh * h)

    grads = jax.grad(loss, argnums=tuple(range(len(NAMES))))(*f32(xs))
    for name, g in zip(NAMES, grads, strict=True):
        assert rel_err(g, fd[name]) < 1e-5, (name, rel_err(g, fd[name]))


@pytest.mark.parametrize("method", METHODS)
def test_one_token_and_a_reset_by_the_decay(method):
    """T = 1; and a −inf log decay mid-row zeroes the state (γ = 0 removes both terms that read
    it), as a document start does."""
    xs = inputs(5, T=1)
    o, h = kernel(method, False)(*f32(xs))
    o_ref, h_ref = comba_loop(**xs)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5
    xs = inputs(6)
    xs["g"][:, 3] = -np.inf
    o, h = kernel(method, False)(*f32(xs))
    cut = {k: (x[:, 3:] if x.ndim > 1 and k != "h0" else x) for k, x in xs.items()}
    del cut["h0"]
    o_ref, h_ref = comba_loop(**cut)  # from token 3 on, as a sequence of its own
    assert rel_err(o[:, 3:], o_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_step_reproduces_scan():
    xs = {k: jnp.asarray(v, jnp.float32) for k, v in inputs(7).items()}
    state = K.LinearAttentionState(xs["h0"], None)
    step = jax.jit(K.comba_step)
    outs = []
    for t in range(T):
        o, state = step(state, *(xs[n][:, t] for n in NAMES[:5]), log_decay=xs["g"][:, t])
        outs.append(o)
    o_ref, h_ref = comba_loop(*(xs[n] for n in NAMES[:5]), g=xs["g"], h0=xs["h0"])
    assert rel_err(jnp.stack(outs, 1), o_ref) < 1e-5 and rel_err(state.kv, h_ref) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_bfloat16_inputs(method):
    """bfloat16 q, k, v, p: the output in bfloat16, the state float32, near the float32 run."""
    xs = inputs(8)
    args = f32(xs)
    args16 = [a.astype(jnp.bfloat16) if i < 4 else a for i, a in enumerate(args)]
    o16, h16 = kernel(method, False)(*args16)
    o32, h32 = kernel(method, False)(*args)
    assert o16.dtype == jnp.bfloat16 and h16.dtype == jnp.float32
    assert rel_err(o16, o32) < 3e-2 and rel_err(h16, h32) < 3e-2


def test_bad_method_and_shapes_raise():
    xs = f32(inputs())
    with pytest.raises(ValueError, match="method"):
        K.comba(*xs[:5], method="associative_scan")
    with pytest.raises(ValueError, match="beta"):
        K.comba(*xs[:4], xs[4][..., None])


SPLIT = r"""
import jax.numpy as jnp, numpy as np
from linear_attention import kernels as K
from tests.kernels.reference import comba_loop, rel_err
from tests.kernels.test_comba import inputs
from tests.kernels.test_sequence_parallel import check

seg = jnp.asarray([[0, 0, 1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 4, 4, 4]], jnp.int32)
xs = {k: jnp.asarray(v, jnp.float32) for k, v in inputs(9, T=8).items()}
xs["s0"] = xs.pop("h0")
for method in ("chunk", "scan"):
    def kernel(xs, seg, *, axis_name):
        o, s = K.comba(xs["q"], xs["k"], xs["v"], xs["p"], xs["beta"], log_decay=xs["g"],
                       method=method, chunk_size=2, segment_ids=seg, axis_name=axis_name,
                       initial_state=K.LinearAttentionState(xs["s0"], None), return_state=True)
        return o, s.kv
    o, h = check(f"comba/{method}/n=4", kernel, xs, seg, 4)
    o_ref, h_ref = comba_loop(*(xs[k] for k in ("q", "k", "v", "p", "beta")), g=xs["g"],
                              h0=xs["s0"], segment_ids=np.asarray(seg))
    assert rel_err(o, o_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5, rel_err(o, o_ref)
    print("CHECKED comba loop", flush=True)
"""


@pytest.mark.slow
def test_time_split_over_four_devices():
    """Both methods split over 4 devices vs unsplit (outputs, gradients of every input, the
    global final state) and vs the float64 loop, packed rows, from an initial state."""
    assert len(checked_names(run_on_cpu_devices(SPLIT, 4))) >= 2

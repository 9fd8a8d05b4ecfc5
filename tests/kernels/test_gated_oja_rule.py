"""The gated Oja rule (`K.gated_oja_rule`, the scan form): against the float64 loop of the
recurrence — outputs, final state and the gradient of every input (by finite differences of the
loop) — across packed rows, an initial state, a per-value-channel decay with a −inf, T = 1; the
step form token by token; bfloat16 inputs with a float32 state; the refusals (method,
axis_name, shapes)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import finite_difference_grads, gated_oja_loop, rel_err

B, T, H, Kd, V = 2, 6, 2, 3, 2
SEGMENTS = np.array([[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 3, 3]], np.int32)
NAMES = ("q", "k", "v", "beta", "g", "h0")


def inputs(seed=0, T=T):
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(B, T, H, V))
    return {
        "q": rng.normal(size=(B, T, H, Kd)),
        "k": rng.normal(size=(B, T, H, Kd)),
        "v": v / np.linalg.norm(v, axis=-1, keepdims=True),  # unit inputs: a stable rule
        "beta": rng.uniform(0.1, 1.0, size=(B, T, H)),
        "g": -rng.uniform(0.01, 1.0, size=(B, T, H, V)),
        "h0": rng.normal(size=(B, H, Kd, V)),
    }


def f32(xs):
    return [jnp.asarray(xs[k], jnp.float32) for k in NAMES]


@functools.cache
def kernel(segments):
    seg = jnp.asarray(SEGMENTS) if segments else None

    def run(q, k, v, beta, g, h0):
        o, state = K.gated_oja_rule(
            q, k, v, beta, log_decay=g, initial_state=K.LinearAttentionState(h0, None),
            return_state=True, segment_ids=seg,
        )  # fmt: skip
        return o, state.kv

    return jax.jit(run)


@pytest.mark.parametrize("segments", [False, True])
def test_matches_loop(segments):
    xs = inputs()
    o, h = kernel(segments)(*f32(xs))
    o_ref, h_ref = gated_oja_loop(**xs, segment_ids=SEGMENTS if segments else None)
    assert o.dtype == h.dtype == jnp.float32
    assert rel_err(o, o_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5, (rel_err(o, o_ref),)


def test_gradients_match_finite_differences():
    """The gradient of every input (q, k, v, β, g, the initial state) of Σ w_o ⊙ o + Σ w_S ⊙ S,
    packed rows, against central differences of the float64 loop."""
    xs = inputs(3)
    rng = np.random.default_rng(4)
    wo, wh = rng.normal(size=(B, T, H, V)), rng.normal(size=(B, H, Kd, V))

    def loss_ref(**kw):
        o, h = gated_oja_loop(**kw, segment_ids=SEGMENTS)
        return np.sum(wo * o) + np.sum(wh * h)

    fd = finite_difference_grads(loss_ref, xs)

    def loss(*args):
        o, h = kernel(True)(*args)
        return jnp.sum(wo * o) + jnp.sum(wh * h)

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(NAMES)))))(*f32(xs))
    for name, g in zip(NAMES, grads, strict=True):
        assert rel_err(g, fd[name]) < 1e-5, (name, rel_err(g, fd[name]))


def test_one_token_and_a_reset_by_the_decay():
    """T = 1; and a −inf log decay in every value channel mid-row zeroes the state, as a
    document start does (a NaN initial state included: the decay selects, never multiplies)."""
    xs = inputs(5, T=1)
    o, h = kernel(False)(*f32(xs))
    o_ref, h_ref = gated_oja_loop(**xs)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5
    xs = inputs(6)
    xs["g"][:, 3] = -np.inf
    xs["h0"][0, 0, 0, 0] = np.nan
    o, h = kernel(False)(*f32(xs))
    cut = {k: x[:, 3:] for k, x in xs.items() if k != "h0"}
    o_ref, h_ref = gated_oja_loop(**cut)  # from token 3 on, as a sequence of its own
    assert rel_err(o[:, 3:], o_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_step_reproduces_the_loop_and_decays_broadcast():
    """The step token by token, with a per-head `[B, H]` decay, equals the loop with that decay
    on every value channel; the sequence form with a `[H]` decay equals the loop too."""
    xs = {k: jnp.asarray(v, jnp.float32) for k, v in inputs(7).items()}
    g_BTH = xs["g"][..., 0]
    state = K.LinearAttentionState(xs["h0"], None)
    step = jax.jit(K.gated_oja_rule_step)
    outs = []
    for t in range(T):
        o, state = step(state, *(xs[n][:, t] for n in NAMES[:4]), log_decay=g_BTH[:, t])
        outs.append(o)
    g_full = np.broadcast_to(np.asarray(g_BTH)[..., None], (B, T, H, V))
    o_ref, h_ref = gated_oja_loop(*(xs[n] for n in NAMES[:4]), g=g_full, h0=xs["h0"])
    assert rel_err(jnp.stack(outs, 1), o_ref) < 1e-5 and rel_err(state.kv, h_ref) < 1e-5
    fixed = jnp.asarray([-0.1, -0.5])
    o = K.gated_oja_rule(*(xs[n] for n in NAMES[:4]), log_decay=fixed, scale=0.7)
    g_fixed = np.broadcast_to(np.asarray(fixed)[:, None], (B, T, H, V))
    assert rel_err(o, gated_oja_loop(*(xs[n] for n in NAMES[:4]), g=g_fixed, scale=0.7)[0]) < 1e-5


def test_bfloat16_inputs():
    """bfloat16 q, k, v: the output in bfloat16, the state float32, near the float32 run."""
    args = f32(inputs(8))
    args16 = [a.astype(jnp.bfloat16) if i < 3 else a for i, a in enumerate(args)]
    o16, h16 = kernel(False)(*args16)
    o32, h32 = kernel(False)(*args)
    assert o16.dtype == jnp.bfloat16 and h16.dtype == jnp.float32
    assert rel_err(o16, o32) < 3e-2 and rel_err(h16, h32) < 3e-2


def test_refusals():
    xs = f32(inputs())
    with pytest.raises(ValueError, match="method"):
        K.gated_oja_rule(*xs[:4], method="chunk")
    with pytest.raises(ValueError, match="axis_name"):
        K.gated_oja_rule(*xs[:4], axis_name="seq")
    with pytest.raises(ValueError, match="beta"):
        K.gated_oja_rule(*xs[:3], xs[3][..., None])
    with pytest.raises(ValueError, match="log_decay"):  # a decay per key channel: not taken
        K.gated_oja_rule(*xs[:4], log_decay=jnp.zeros((B, T, H, Kd)))
    with pytest.raises(ValueError, match="log_decay"):  # > 0: a growing state
        K.gated_oja_rule(*xs[:4], log_decay=jnp.full((H,), 0.5))

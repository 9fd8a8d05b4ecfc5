"""The generalised delta rule: KDA (a decay per key channel) with grouped value heads,
`dplr_delta_rule` (RWKV-7) and `delta_product` (Gated DeltaProduct), each method against its
float64 NumPy loop — strong decays (−30 per token on some channels), resets, an initial state,
T not a multiple of the chunk — plus chunk gradients against autodiff of the scan, decoding
steps against the sequence, segment ids, bfloat16 and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import delta_product_loop, dplr_loop, kda_loop, rel_err

B, T, H, HV, KD, DV, N = 2, 19, 2, 4, 4, 3, 2
KERNELS = ("kda", "dplr", "product")
# (method, chunk_size): 5 and 16 do not divide T (DeltaProduct: T·n = 38 sub-tokens); the
# gradient test runs the chunk form at 18 (two sub-blocks of 9 per chunk) and checks its
# outputs against the float64 loop as well, so chunk 16 (one sub-block) is in the slow run only
SLOW = pytest.mark.slow
METHODS = [("scan", 64), ("chunk", 5), pytest.param("chunk", 16, marks=SLOW)]
GRAD_CHUNK = 18


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(kernel, seed=0, T=T):
    """Float32 inputs of `kernel` as a dict (the order of the kernel's arguments) and s0."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, KD))
    if kernel == "kda":
        xs = dict(
            q=q,
            k=unit(rng.normal(size=(B, T, H, KD))),
            v=rng.normal(size=(B, T, HV, DV)),
            beta=rng.uniform(0.05, 1.95, size=(B, T, HV)),
        )
        a = -rng.uniform(0.0, 1.0, size=(B, T, HV, KD))
        heads = HV
    elif kernel == "dplr":
        kappa = unit(rng.normal(size=(B, T, H, KD)))
        xs = dict(
            q=q,
            k=0.5 * rng.normal(size=(B, T, H, KD)),
            v=rng.normal(size=(B, T, H, DV)),
            a=-kappa,  # RWKV-7: a = −κ̂, b = κ̂ ⊙ in-context rate
            b=kappa * rng.uniform(0.0, 1.0, size=(B, T, H, KD)),
        )
        a = -rng.uniform(0.0, 1.0, size=(B, T, H, KD))
        heads = H
    else:
        xs = dict(
            q=q,
            k=unit(rng.normal(size=(B, T, H, N, KD))),
            v=rng.normal(size=(B, T, H, N, DV)),
            beta=rng.uniform(0.05, 1.95, size=(B, T, H, N)),
        )
        a = -rng.uniform(0.0, 1.0, size=(B, T, H))
        heads = H
    if a.ndim == 4:
        a[..., 0] = -30.0  # a strong decay on one key channel: exact and finite
    a[0, min(5, T - 1), 1] = a[1, min(13, T - 1), 0] = -np.inf  # resets
    xs["log_decay"] = a
    xs = {name: jnp.asarray(x, jnp.float32) for name, x in xs.items()}
    return xs, jnp.asarray(rng.normal(size=(B, heads, KD, DV)), jnp.float32)


FUNCTIONS = {"kda": K.delta_rule, "dplr": K.dplr_delta_rule, "product": K.delta_product}
STEPS = {"kda": K.delta_rule_step, "dplr": K.dplr_delta_rule_step, "product": K.delta_product_step}
LOOPS = {"kda": kda_loop, "dplr": dplr_loop, "product": delta_product_loop}
# positional arguments in order (a dict through `jit` comes back with sorted keys)
ARGS = {"kda": ("q", "k", "v", "beta"), "dplr": ("q", "k", "v", "a", "b")}
ARGS["product"] = ARGS["kda"]


def call(kernel, xs, s0, *, method, chunk_size, segment_ids=None):
    return FUNCTIONS[kernel](
        *(xs[n] for n in ARGS[kernel]),
        log_decay=xs.get("log_decay"),
        method=method,
        chunk_size=chunk_size,
        initial_state=None if s0 is None else K.LinearAttentionState(s0, None),
        return_state=True,
        segment_ids=segment_ids,
    )


run = jax.jit(call, static_argnames=("kernel", "method", "chunk_size"))


def reference(kernel, xs, s0, segment_ids=None):
    args = (xs[n] for n in ARGS[kernel])
    return LOOPS[kernel](*args, xs.get("log_decay"), s0, segment_ids=segment_ids)


@pytest.mark.parametrize("method, chunk_size", METHODS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_float64_recurrence(kernel, method, chunk_size):
    xs, s0 = make_inputs(kernel)
    o, state = run(kernel, xs, s0, method=method, chunk_size=chunk_size)
    o_ref, s_ref = reference(kernel, xs, s0)
    assert o.dtype == jnp.float32 and state.kv.dtype == jnp.float32 and state.k_sum is None
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(state.kv))
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(state.kv, s_ref) < 1e-5


def _other_decays(kernel, xs):
    """The other accepted log-decay shapes of each kernel (None, per head, per token)."""
    a = xs["log_decay"]
    per_token = a[..., 0] if a.ndim == 4 else a
    heads = per_token.shape[2]
    return {
        "none": None,
        "fixed": jnp.log(jnp.linspace(0.5, 0.95, heads)),
        "per_head": jnp.maximum(per_token, -3.0),
    }


@pytest.mark.parametrize(
    "kernel, decay",
    # no decay takes the per-head path with zeros (DPLR) or the plain delta rule's (tested in
    # test_delta.py): slow run only
    [("kda", "per_head"), pytest.param("dplr", "none", marks=SLOW), ("dplr", "per_head"),
     pytest.param("product", "none", marks=SLOW), ("product", "fixed")],
)  # fmt: skip
def test_other_decay_shapes_match_float64(kernel, decay):
    xs, s0 = make_inputs(kernel, seed=1)
    xs["log_decay"] = _other_decays(kernel, xs)[decay]
    if xs["log_decay"] is None:
        del xs["log_decay"]
    o, state = run(kernel, xs, s0, method="chunk", chunk_size=8)
    o_ref, s_ref = reference(kernel, xs, s0)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(state.kv, s_ref) < 1e-5


def test_kda_with_equal_channels_is_gated_deltanet():
    """A per-key decay equal on every channel takes the per-key chunk path and must give the
    per-head (Gated DeltaNet) numbers."""
    xs, s0 = make_inputs("kda", seed=2)
    per_head = jnp.maximum(xs["log_decay"][..., 0], -3.0)
    got = run("kda", {**xs, "log_decay": jnp.repeat(per_head[..., None], KD, -1)}, s0,
              method="chunk", chunk_size=8)  # fmt: skip
    want = run("kda", {**xs, "log_decay": per_head}, s0, method="chunk", chunk_size=8)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1].kv, want[1].kv, rtol=1e-5, atol=1e-5)


def _grad(kernel, method, chunk_size):
    """Outputs, final state and the gradients of a loss reading both, in one compiled call."""

    def loss(xs, s0, g):
        o, state = call(kernel, xs, s0, method=method, chunk_size=chunk_size)
        return jnp.vdot(o, g) + jnp.sum(jnp.sin(state.kv)), (o, state.kv)

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("kernel", KERNELS)
def test_chunk_gradients_match_autodiff_of_scan(kernel):
    """Gradients to every input (log decay and initial state included), strong decays and
    resets: the chunk form (KDA and DPLR: hand-written VJPs keeping one state per chunk;
    DeltaProduct: remat) against autodiff through the scan. Chunks of 18 tokens are cut into
    two sub-blocks of 9 (the off-diagonal factorisation, −30 per token on one channel) and T = 19
    leaves a padded second chunk; the chunk outputs are checked against the float64 loop."""
    xs, s0 = make_inputs(kernel, seed=3)
    heads = s0.shape[1]
    g = jax.random.normal(jax.random.key(0), (B, T, heads, DV))
    ref, _ = _grad(kernel, "scan", 64)(xs, s0, g)
    got, (o, s_final) = _grad(kernel, "chunk", GRAD_CHUNK)(xs, s0, g)
    o_ref, s_ref = reference(kernel, xs, s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s_final, s_ref) < 1e-5
    names = sorted(xs)
    for name, x, r in zip([*names, "s0"], [*(got[0][n] for n in names), got[1]],
                          [*(ref[0][n] for n in names), ref[1]], strict=True):  # fmt: skip
        assert np.all(np.isfinite(x)), name
        assert rel_err(x, r) < 1e-4, (name, rel_err(x, r))


def _step_inputs(kernel, xs, t):
    log_decay = xs.get("log_decay")
    args = [xs[n][:, t] for n in ARGS[kernel]]
    return args, None if log_decay is None else log_decay[:, t]


@pytest.mark.parametrize("kernel", KERNELS)
def test_step_token_by_token_equals_the_sequence(kernel):
    xs, s0 = make_inputs(kernel, seed=4)
    o_seq, s_seq = run(kernel, xs, s0, method="chunk", chunk_size=5)  # compiled above already
    step = jax.jit(STEPS[kernel])
    state = K.LinearAttentionState(s0, None)
    outs = []
    for t in range(T):
        args, a_t = _step_inputs(kernel, xs, t)
        o_t, state = step(state, *args, log_decay=a_t)
        outs.append(o_t)
    np.testing.assert_allclose(np.stack(outs, 1), o_seq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.kv, s_seq.kv, rtol=1e-5, atol=1e-5)


SEGMENTS = np.array([[0] * 7 + [1] * 8 + [4] * 4, [2] * 11 + [3] * 8], np.int32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_segment_ids_match_float64(kernel):
    """Packed rows: the state is zeroed before every new document (for DPLR both the diagonal
    and the low-rank read), the initial state flows into the first document only."""
    xs, s0 = make_inputs(kernel, seed=5)
    ids = jnp.asarray(SEGMENTS)
    o_ref, s_ref = reference(kernel, xs, s0, segment_ids=SEGMENTS)
    # (the resets are folded into the inputs before the method is picked: one method suffices)
    o, state = run(kernel, xs, s0, method="chunk", chunk_size=4, segment_ids=ids)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(state.kv, s_ref) < 1e-5


@pytest.mark.parametrize(
    "kernel",
    # the same float32 cast at entry for all three: two of them only in the slow run
    ["kda", *(pytest.param(name, marks=pytest.mark.slow) for name in ("dplr", "product"))],
)
def test_bfloat16_inputs(kernel):
    xs, s0 = make_inputs(kernel, seed=6)
    low = {n: x if n in ("beta", "log_decay") else x.astype(jnp.bfloat16) for n, x in xs.items()}
    o, state = run(kernel, low, s0, method="chunk", chunk_size=16)
    assert o.dtype == jnp.bfloat16 and state.kv.dtype == jnp.float32
    o_ref, _ = reference(kernel, {n: x.astype(jnp.float32) for n, x in low.items()}, s0)
    assert rel_err(o.astype(jnp.float32), o_ref) < 2e-2


def test_grouped_value_heads_read_their_query_key_head():
    """HV = 2H: value heads 2i and 2i+1 read q/k head i — the same as running each value head
    with its q/k head copied (HV = H)."""
    xs, s0 = make_inputs("kda", seed=7)
    o = run("kda", xs, s0, method="chunk", chunk_size=8)[0]
    copied = {**xs, "q": jnp.repeat(xs["q"], 2, axis=2), "k": jnp.repeat(xs["k"], 2, axis=2)}
    o_copied = run("kda", copied, s0, method="scan", chunk_size=64)[0]
    np.testing.assert_allclose(o, o_copied, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kernel, change, match",
    [
        (
            "kda",
            dict(v=np.zeros((B, T, 3, DV)), beta=np.zeros((B, T, 3))),
            r"v has 3 value heads, not a multiple of the 2",
        ),
        ("kda", dict(beta=np.zeros((B, T, H))), r"v / beta disagree on HV"),
        ("kda", dict(log_decay=np.zeros((B, T, HV, KD + 1))), "log_decay of shape"),
        ("kda", dict(log_decay=np.full((B, T, HV, KD), 0.5)), "log_decay must be <= 0"),
        ("dplr", dict(b=np.zeros((B, T, H, KD + 1))), r"disagree on K \(key width\)"),
        ("dplr", dict(a=np.zeros((B, T, H))), "a must have rank 4"),
        ("dplr", dict(method="quadratic"), "unknown method 'quadratic'"),
        ("product", dict(beta=np.full((B, T, H, N), 2.5)), "beta must lie in"),
        ("product", dict(k=np.zeros((B, T, H, N + 1, KD))), r"disagree on n"),
        ("product", dict(log_decay=np.zeros((B, T, H, KD))), "log_decay of shape"),
        ("product", dict(chunk_size=0), "chunk_size must be an integer"),
    ],
)
def test_bad_inputs_raise(kernel, change, match):
    xs, s0 = make_inputs(kernel)
    xs.update({n: change.pop(n) for n in list(change) if n in xs or n == "log_decay"})
    with pytest.raises(ValueError, match=match):
        FUNCTIONS[kernel](*(xs[n] for n in ARGS[kernel]), log_decay=xs["log_decay"], **change)


def test_step_bad_inputs_raise():
    xs, s0 = make_inputs("dplr", T=2)
    args, _ = _step_inputs("dplr", xs, 0)
    state = K.LinearAttentionState(s0, None)
    with pytest.raises(ValueError, match="state.kv has shape"):
        K.dplr_delta_rule_step(K.LinearAttentionState(s0[:, :1], None), *args)
    with pytest.raises(ValueError, match="log_decay of shape"):
        K.dplr_delta_rule_step(state, *args, log_decay=jnp.zeros((B, H, KD + 1)))
    xs, s0 = make_inputs("product", T=2)
    args, _ = _step_inputs("product", xs, 0)
    with pytest.raises(ValueError, match="beta must lie in"):
        K.delta_product_step(K.LinearAttentionState(s0, None), *args[:3], 3.0 * args[3])

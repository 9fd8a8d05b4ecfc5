"""A NaN stays where it arose (issue 75): every kernel and every method, with one NaN entry of q,
k, v, the log decay or a per-token gate at a mid-chunk position s of document 0 of a packed row.

The recurrence carries a NaN at s to the outputs of its own head at t ≥ s up to the next reset,
and nowhere else: every output before s, every output of the next document, the other head and
the other batch row stay finite and EQUAL the run without the NaN (selection, never a product
with 0, so no number changes), and output s itself is NaN (the NaN is reported where it arose).

T = 32 in chunks (blocks) of 16: document 0 is t < 11 (its end inside the NaN's chunk, so a
chunk mixes the two documents), the NaN at s = 5, document 1 runs on into the second chunk.
Each kernel × method is jitted once and run on the clean inputs and on each poisoned one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K

B, T, H, D, DV, N, L = 2, 32, 2, 4, 4, 2, 6
CHUNK, DOC_END, S = 16, 11, 5
SEGMENTS = jnp.asarray([[0] * DOC_END + [1] * (T - DOC_END)] * B, jnp.int32)


def _inputs(seed=0):
    """Every input any kernel reads, float32, in its allowed range."""
    ks = iter(jax.random.split(jax.random.key(seed), 16))
    normal = lambda *shape: jax.random.normal(next(ks), shape)  # noqa: E731
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    kappa = unit(normal(B, T, H, D))
    return {
        "q": normal(B, T, H, D),
        "k": unit(normal(B, T, H, D)),
        "v": normal(B, T, H, DV),
        "log_decay": jax.nn.log_sigmoid(normal(B, T, H) + 2.0),
        "log_decay_per_key": jax.nn.log_sigmoid(normal(B, T, H, D) + 2.0),
        "beta": jax.nn.sigmoid(normal(B, T, H)),
        "w": unit(normal(B, T, H, D)),
        "a": -kappa,
        "b": kappa * jax.nn.sigmoid(normal(B, T, H, D)),
        "k_n": unit(normal(B, T, H, N, D)),
        "v_n": normal(B, T, H, N, DV),
        "beta_n": jax.nn.sigmoid(normal(B, T, H, N)),
        "level_weights": jax.nn.softplus(normal(B, T, H, L)),
        "lambda_": jax.nn.softplus(normal(H, D)) + 0.5,
    }


def _phi(x):
    return jax.nn.elu(x) + 1.0


# "pallas_gpu": method="pallas" under pallas_interpret("gpu"), in chunks of 64 (wgmma's rows):
# one chunk holds both documents and the NaN.
def _method(m):
    return "pallas" if m == "pallas_gpu" else m


def _chunk(m):
    return 64 if m == "pallas_gpu" else CHUNK


# name -> (methods, the inputs read (poisoned one at a time), kernel(x, method, seg) -> o)
KERNELS = {
    "causal_linear_attention": (
        K.METHODS + K.PALLAS_METHODS,
        ("q", "k", "v", "log_decay"),
        lambda x, m, seg: K.causal_linear_attention(
            _phi(x["q"]),
            _phi(x["k"]),
            x["v"],
            log_decay=x["log_decay"],
            method=m,
            chunk_size=CHUNK,
            segment_ids=seg,
        ),
    ),
    "causal_linear_attention/per_key": (
        ("chunk", "scan"),
        ("k", "log_decay_per_key"),
        lambda x, m, seg: K.causal_linear_attention(
            _phi(x["q"]),
            _phi(x["k"]),
            x["v"],
            log_decay=x["log_decay_per_key"],
            method=m,
            chunk_size=CHUNK,
            segment_ids=seg,
        ),
    ),
    "delta_rule": (
        K.DELTA_METHODS + ("pallas", "pallas_gpu"),
        ("q", "k", "v", "beta", "log_decay"),
        lambda x, m, seg: K.delta_rule(
            x["q"],
            x["k"],
            x["v"],
            x["beta"],
            log_decay=x["log_decay"],
            method=_method(m),
            chunk_size=_chunk(m),
            segment_ids=seg,
        ),
    ),
    "delta_rule/per_key": (
        K.DELTA_METHODS + ("pallas", "pallas_gpu"),
        ("k", "log_decay_per_key"),
        lambda x, m, seg: K.delta_rule(
            x["q"],
            x["k"],
            x["v"],
            x["beta"],
            log_decay=x["log_decay_per_key"],
            method=_method(m),
            chunk_size=_chunk(m),
            segment_ids=seg,
        ),
    ),
    "dplr_delta_rule": (
        K.DELTA_METHODS + ("pallas",),
        ("q", "k", "v", "a", "b", "log_decay_per_key"),
        lambda x, m, seg: K.dplr_delta_rule(
            x["q"],
            x["k"],
            x["v"],
            x["a"],
            x["b"],
            log_decay=x["log_decay_per_key"],
            method=m,
            chunk_size=CHUNK,
            segment_ids=seg,
        ),
    ),
    "delta_product": (
        K.DELTA_METHODS + ("pallas",),
        ("q", "k_n", "v_n", "beta_n", "log_decay"),
        lambda x, m, seg: K.delta_product(
            x["q"],
            x["k_n"],
            x["v_n"],
            x["beta_n"],
            log_decay=x["log_decay"],
            method=m,
            chunk_size=CHUNK,
            segment_ids=seg,
        ),
    ),
    "forgetting_attention": (
        K.FORGETTING.supported,
        ("q", "k", "v", "log_decay"),
        lambda x, m, seg: K.forgetting_attention(
            x["q"], x["k"], x["v"], x["log_decay"], method=m, block_size=CHUNK, segment_ids=seg
        ),
    ),
    "path_attention": (
        K.PATH.supported,
        ("q", "k", "v", "w", "beta", "log_decay"),
        lambda x, m, seg: K.path_attention(
            x["q"],
            x["k"],
            x["v"],
            x["w"],
            2.0 * x["beta"],
            x["log_decay"],
            method=m,
            block_size=CHUNK,
            segment_ids=seg,
        ),
    ),
    "mesa_net": (
        K.MESA_NET.supported,
        ("q", "k", "v", "log_decay", "beta"),
        lambda x, m, seg: K.mesa_net(
            x["q"],
            x["k"],
            x["v"],
            x["log_decay"],
            x["beta"],
            x["lambda_"],
            method=m,
            chunk_size=CHUNK,
            segment_ids=seg,
            cg_steps=8,
        ),
    ),
    "log_linear_attention": (
        K.LOG_LINEAR_METHODS,
        ("q", "k", "v", "log_decay", "level_weights"),
        lambda x, m, seg: K.log_linear_attention(
            x["q"],
            x["k"],
            x["v"],
            x["log_decay"],
            x["level_weights"],
            method=m,
            chunk_size=CHUNK,
            segment_ids=seg,
        ),
    ),
    "log_linear_delta_rule": (
        K.LOG_LINEAR_DELTA_METHODS,
        ("q", "k", "v", "beta", "log_decay", "level_weights"),
        lambda x, m, seg: K.log_linear_delta_rule(
            x["q"],
            x["k"],
            x["v"],
            x["beta"],
            x["log_decay"],
            x["level_weights"],
            method=m,
            chunk_size=CHUNK,
            segment_ids=seg,
        ),
    ),
    "softmax_attention": (
        ("quadratic", "blockwise"),
        ("q", "k", "v"),
        lambda x, m, seg: (
            K.softmax_attention(x["q"], x["k"], x["v"], causal=True, segment_ids=seg)
            if m == "quadratic"
            else K.blockwise_softmax_attention(
                x["q"], x["k"], x["v"], causal=True, block_size=CHUNK, segment_ids=seg
            )
        ),
    ),
    "sliding_window_attention": (
        ("blockwise",),
        ("q", "k", "v"),
        lambda x, m, seg: K.sliding_window_attention(
            x["q"], x["k"], x["v"], window=8, block_size=CHUNK, segment_ids=seg
        ),
    ),
}

CASES = [(name, method) for name, (methods, _, _) in KERNELS.items() for method in methods]


DECAYS = ("log_decay", "log_decay_per_key")


def _poison(x, name, value=jnp.nan):
    """x with one entry of `name` at (row 0, token S, head 1) set to `value`."""
    index = (0, S, 1) + (0,) * (x[name].ndim - 3)
    return {**x, name: x[name].at[index].set(value)}


@pytest.mark.parametrize("name, method", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_a_nan_stays_in_its_document_and_after_its_position(name, method):
    _, poisonable, kernel = KERNELS[name]
    run = jax.jit(functools.partial(kernel, m=method, seg=SEGMENTS))
    interpret = {"pallas": K.pallas_interpret(), "pallas_gpu": K.pallas_interpret("gpu")}.get(
        method, _nothing()
    )
    x = _inputs()
    with interpret:
        clean = np.asarray(run(x))
        assert np.all(np.isfinite(clean))
        for poisoned in poisonable:
            o = np.asarray(run(_poison(x, poisoned)))
            where = f"{name} {method}: NaN in {poisoned}"
            # output S reports the NaN; everything it cannot reach is finite and unchanged
            assert np.isnan(o[0, S, 1]).any(), where
            unreachable = np.ones(o.shape[:3], bool)
            unreachable[0, S:DOC_END, 1] = False
            want = clean
            if poisoned in DECAYS:
                # a chunk form may sum document 1's decays on from document 0's (exact up to
                # rounding), so a NaN decay, read as 0, leaves the run with that decay 0 exactly
                want = np.asarray(run(_poison(x, poisoned, 0.0)))
                np.testing.assert_allclose(o[unreachable], clean[unreachable], 1e-5, 1e-6)
            np.testing.assert_array_equal(o[unreachable], want[unreachable], err_msg=where)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_reset_clears_a_nan_state_in_the_decoding_steps():
    """A −inf log decay selects a zero state, NaN or not (0 · NaN would keep it): one step from
    a NaN state with a reset equals the step from zeros, in each step whose −inf decay is a
    reset (DPLR's keeps its low-rank read: there only a segment start resets)."""
    x = {k: v[:, 0] for k, v in _inputs().items() if k != "lambda_"}
    reset = jnp.full((B, H), -jnp.inf)
    nan_kv = jnp.full((B, H, D, DV), jnp.nan)
    linear = functools.partial(K.recurrent_step, q=x["q"], k=x["k"], v=x["v"], log_decay=reset)
    got = linear(K.LinearAttentionState(nan_kv, jnp.full((B, H, D), jnp.nan)))
    want = linear(K.LinearAttentionState.zeros(B, H, D, DV))
    delta = functools.partial(
        K.delta_rule_step, q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], log_decay=reset
    )
    got += delta(K.LinearAttentionState(nan_kv, None))
    want += delta(K.LinearAttentionState(jnp.zeros_like(nan_kv), None))
    mesa = functools.partial(
        K.mesa_net_step, q=x["q"], k=x["k"], v=x["v"], log_decay=reset, beta=x["beta"],
        lambda_=_inputs()["lambda_"], cg_steps=None,
    )  # fmt: skip
    got += mesa(K.MesaNetState(jnp.full((B, H, D, D), jnp.nan), nan_kv))
    want += mesa(K.MesaNetState(jnp.zeros((B, H, D, D)), jnp.zeros_like(nan_kv)))
    product = functools.partial(
        K.delta_product_step, q=x["q"], k=x["k"][:, :, None], v=x["v"][:, :, None],
        beta=x["beta"][:, :, None], log_decay=reset,
    )  # fmt: skip
    got += product(K.LinearAttentionState(nan_kv, None))
    want += product(K.LinearAttentionState(jnp.zeros_like(nan_kv), None))
    L = 3
    lam = jnp.ones((B, H, L), jnp.float32)
    nan_levels = K.LogLinearState(jnp.full((B, H, L, D, DV), jnp.nan), jnp.full((B, H), 2))
    for step, extra in (
        (K.log_linear_attention_step, ()),
        (K.log_linear_delta_rule_step, (x["beta"],)),
    ):
        args = (x["q"], x["k"], x["v"], *extra, reset, lam)
        got += step(nan_levels, *args)
        want += step(K.LogLinearState.zeros(B, H, L, D, DV), *args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# The training path of each family: a loss on the finite outputs has a finite gradient.
TRAINING = [
    ("delta_rule", "chunk", "v"),
    ("delta_rule/per_key", "chunk", "log_decay_per_key"),
    ("dplr_delta_rule", "chunk", "b"),
    ("delta_product", "chunk", "k_n"),
    ("forgetting_attention", "chunk", "log_decay"),
    ("path_attention", "chunk", "w"),
    ("mesa_net", "chunk", "v"),
    ("log_linear_attention", "chunk", "k"),
    ("log_linear_delta_rule", "chunk", "beta"),
]


@pytest.mark.parametrize("name, method, poisoned", TRAINING, ids=[t[0] for t in TRAINING])
def test_the_gradient_of_the_finite_outputs_is_finite(name, method, poisoned):
    """With a NaN input at (0, S, 1), the gradient of a loss on the finite outputs is finite at
    every other token and equals the gradient with that entry 0 (the NaN outputs, left out by
    the loss, depend on nothing; the guard's selects pass no 0·NaN back)."""
    _, _, kernel = KERNELS[name]
    x = _inputs()
    run = jax.jit(functools.partial(kernel, m=method, seg=SEGMENTS))  # (eager checks refuse NaN)
    keep = np.isfinite(np.asarray(run(_poison(x, poisoned))))
    assert not keep[0, S:DOC_END, 1].any() and keep[0, :S].all() and keep[0, DOC_END:].all()

    @jax.jit
    def grads(x):
        def loss(x):
            o = kernel(x, method, SEGMENTS)
            return jnp.sum(jnp.where(keep, jnp.cos(o), 0.0))

        return jax.grad(loss)(x)

    got, want = grads(_poison(x, poisoned)), grads(_poison(x, poisoned, 0.0))
    for key in got:
        g, w = np.asarray(got[key]), np.asarray(want[key])
        if key != "lambda_":  # the NaN token's own inputs aside
            g, w = np.delete(g, S, axis=1), np.delete(w, S, axis=1)
        assert np.all(np.isfinite(g)), (name, key)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{name}: d/d{key}")

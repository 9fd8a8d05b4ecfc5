"""The Pallas kernels (`method="pallas"`), in Pallas interpret mode on the CPU: outputs, final
states and every input's gradient against the float64 recurrence (gradients by central
differences of it in float64) and against `method="chunk"`; dispatch errors; and the Mosaic
kernels compiled for TPU v5e and v6e through libtpu."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import (
    causal_linear_attention_loop,
    delta_product_loop,
    dplr_loop,
    kda_loop,
    rel_err,
)

H, M, DV = 2, 4, 4
EPS = 1e-6


# ---- the float64 reference: outputs, states and a loss's gradient by central differences ----


def _weights(T):
    """Fixed weights of the loss: every output and state entry matters differently."""
    w_o = np.cos(np.arange(T * H * DV)).reshape(1, T, H, DV)
    w_s = np.sin(np.arange(H * M * DV)).reshape(1, H, M, DV)
    w_z = 0.3 * np.cos(np.arange(H * M) + 0.5).reshape(1, H, M)
    return w_o, w_s, w_z


def _reference_losses(args, normalize, segment_ids):
    """The loss of each batch row [P] of the float64 recurrence."""
    q, k, v, a, kv0, z0 = args
    P, T = q.shape[:2]
    seg = None if segment_ids is None else np.broadcast_to(segment_ids, (P, T))
    o, kv, z = causal_linear_attention_loop(q, k, v, a, kv0, z0, normalize, EPS, seg)
    w_o, w_s, w_z = _weights(T)
    return (o * w_o).sum((1, 2, 3)) + (kv * w_s).sum((1, 2, 3)) + (z * w_z).sum((1, 2))


def _finite_difference_grads(args, normalize, segment_ids, h=1e-6, losses=None):
    """d loss / d each input (q, k, v, log_decay, kv0, k_sum0 by default) in float64, every
    entry perturbed by ±h at once as rows of one batch (the inputs have batch 1; a `[H]` decay
    becomes `[rows, 1, H]`). `losses(batched_args)`: the loss per row (default: linear
    attention's)."""
    losses = losses or functools.partial(
        _reference_losses, normalize=normalize, segment_ids=segment_ids
    )
    args = [None if x is None else np.asarray(x, np.float64) for x in args]
    grads = []
    for i, x in enumerate(args):
        if x is None:
            grads.append(None)
            continue
        n = x.size
        flat = np.tile(x.reshape(1, -1), (2 * n, 1))
        flat[np.arange(n), np.arange(n)] += h
        flat[n + np.arange(n), np.arange(n)] -= h
        rows = flat.reshape(2 * n, *(x.shape[1:] if x.ndim > 1 else (1, x.shape[0])))
        batched = [
            rows
            if j == i
            else None
            if y is None
            else (y if y.ndim == 1 else np.broadcast_to(y, (2 * n, *y.shape[1:])))
            for j, y in enumerate(args)
        ]
        row_losses = losses(batched)
        grads.append(((row_losses[:n] - row_losses[n:]) / (2 * h)).reshape(x.shape))
    return grads


# ---- the kernels, through the public entry point ----


@functools.partial(jax.jit, static_argnames=("method", "normalize", "chunk_size"))
def _outputs_and_grads(q, k, v, a, kv0, z0, segment_ids, *, method, normalize, chunk_size):
    def loss(q, k, v, a, kv0, z0):
        o, state = K.causal_linear_attention(
            q,
            k,
            v,
            log_decay=a,
            normalize=normalize,
            method=method,
            chunk_size=chunk_size,
            initial_state=K.LinearAttentionState(kv0, z0),
            return_state=True,
            segment_ids=segment_ids,
        )
        w_o, w_s, w_z = (jnp.asarray(w, jnp.float32) for w in _weights(q.shape[1]))
        total = jnp.sum(o * w_o) + jnp.sum(state.kv * w_s) + jnp.sum(state.k_sum * w_z)
        return total, (o, state.kv, state.k_sum)

    argnums = (0, 1, 2, 4, 5) if a is None else (0, 1, 2, 3, 4, 5)
    grads, outputs = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, a, kv0, z0)
    if a is None:
        grads = (*grads[:3], None, *grads[3:])
    return outputs, grads


def _inputs(T, decay, seed=0):
    """Batch-1 float32 inputs: positive features, a log decay of the given kind, a state."""
    rng = np.random.default_rng(seed)
    q = np.abs(rng.normal(size=(1, T, H, M))) + 0.1
    k = np.abs(rng.normal(size=(1, T, H, M))) + 0.1
    v = rng.normal(size=(1, T, H, DV))
    a = {
        "none": None,
        "per_head": np.log(np.array([0.9, 0.6])),  # RetNet: fixed, [H]
        "per_token": -rng.uniform(0.0, 0.3, size=(1, T, H)),  # Mamba-2 / simple GLA
        "per_key": -rng.uniform(0.0, 0.3, size=(1, T, H, M)),  # GLA
    }[decay]
    if decay == "per_key":
        a[..., 0, 1] = -30.0  # a strong decay on one channel: exact, no overflow
    kv0 = rng.normal(size=(1, H, M, DV))
    z0 = np.abs(rng.normal(size=(1, H, M))) + 0.5
    return [None if x is None else jnp.asarray(x, jnp.float32) for x in (q, k, v, a, kv0, z0)]


def _segments(T, starts):
    """[1, T] ids with a new document at each of `starts`."""
    ids = np.zeros((1, T), np.int32)
    for s in starts:
        ids[:, s:] += 1
    return jnp.asarray(ids)


# (decay, normalize, T, chunk_size, document starts): T = 1; T not a multiple of the chunk;
# resets mid-chunk and on a chunk boundary; the per-key kind over two 16-query sub-blocks.
CASES = [
    ("none", True, 37, 16, ()),
    ("per_head", True, 37, 16, ()),
    ("per_token", False, 37, 16, (5, 16)),
    ("per_token", True, 1, 16, ()),
    ("per_key", True, 45, 32, (20, 32)),
    ("per_key", False, 45, 32, ()),
]


@pytest.mark.parametrize(("decay", "normalize", "T", "chunk_size", "starts"), CASES)
def test_matches_float64_recurrence_and_chunk(decay, normalize, T, chunk_size, starts):
    args = _inputs(T, decay)
    seg = _segments(T, starts) if starts else None
    check_pallas_against_references("tpu", args, seg, normalize, chunk_size)


def check_pallas_against_references(backend, args, seg, normalize, chunk_size):
    """`method="pallas"` (interpreted, `backend`'s kernel): outputs, final state and every
    input's gradient within 1e-4 of the float64 recurrence and of `method="chunk"`."""
    config = dict(normalize=normalize, chunk_size=chunk_size)
    with K.pallas_interpret(backend):
        (o, kv, z), grads = _outputs_and_grads(*args, seg, method="pallas", **config)
    (o_c, kv_c, z_c), grads_c = _outputs_and_grads(*args, seg, method="chunk", **config)
    seg_np = None if seg is None else np.asarray(seg)
    ref = causal_linear_attention_loop(*args, normalize=normalize, eps=EPS, segment_ids=seg_np)
    for name, x, x_c, r in zip(
        ("o", "kv", "k_sum"), (o, kv, z), (o_c, kv_c, z_c), ref, strict=True
    ):
        assert rel_err(x, r) < 1e-4, (name, rel_err(x, r))
        assert rel_err(x, x_c) < 1e-4, (name, rel_err(x, x_c))
    ref_grads = _finite_difference_grads(args, normalize, seg_np)
    names = ("q", "k", "v", "log_decay", "kv0", "k_sum0")
    for name, g, g_c, r in zip(names, grads, grads_c, ref_grads, strict=True):
        if r is None:
            assert g is None
            continue
        assert g.shape == r.shape, name
        assert rel_err(g, r) < 1e-4, (name, rel_err(g, r))
        assert rel_err(g, g_c) < 1e-4, (name, rel_err(g, g_c))


def test_bfloat16_inputs_match_chunk():
    """bfloat16 in, bfloat16 out, float32 states: as close to `chunk` as bfloat16 rounding."""
    args = _inputs(37, "per_token", seed=1)
    args = [x.astype(jnp.bfloat16) if i < 3 else x for i, x in enumerate(args)]
    config = dict(normalize=True, chunk_size=16)
    with K.pallas_interpret():
        (o, kv, z), grads = _outputs_and_grads(*args, None, method="pallas", **config)
    (o_c, kv_c, z_c), grads_c = _outputs_and_grads(*args, None, method="chunk", **config)
    assert o.dtype == jnp.bfloat16 and kv.dtype == jnp.float32
    assert rel_err(o, o_c) < 1e-2
    assert rel_err(kv, kv_c) < 1e-4  # states from the same bfloat16 inputs, in float32
    for g, g_c in zip(grads, grads_c, strict=True):
        assert g.dtype == g_c.dtype
        assert rel_err(g, g_c) < 2e-2


def test_without_state_and_non_finite_tokens_match_chunk():
    """No initial state, no returned state, and a NaN key: poisoned outputs as in `chunk`."""
    q, k, v, a, _, _ = _inputs(37, "per_token", seed=2)
    k = k.at[0, 9, 1].set(jnp.nan)
    seg = _segments(37, (20,))

    def run(method):
        return K.causal_linear_attention(
            q, k, v, log_decay=a, method=method, chunk_size=16, segment_ids=seg
        )

    with K.pallas_interpret():
        o = run("pallas")
    o_c = run("chunk")
    np.testing.assert_array_equal(np.isnan(o), np.isnan(o_c))
    assert np.isnan(o[0, 9:20, 1]).all() and not np.isnan(o[0, 20:, 1]).any()
    finite = ~np.isnan(o_c)
    assert rel_err(np.asarray(o)[finite], np.asarray(o_c)[finite]) < 1e-4


@functools.partial(jax.jit, static_argnames=("method",))
def _wide_outputs_and_grads(q, k, v, a, kv0, z0, segment_ids, *, method):
    """Outputs, final state and the gradients of a fixed-weight loss, any head sizes."""

    def loss(q, k, v, a, kv0, z0):
        o, state = K.causal_linear_attention(
            q,
            k,
            v,
            log_decay=a,
            method=method,
            chunk_size=16,
            initial_state=K.LinearAttentionState(kv0, z0),
            return_state=True,
            segment_ids=segment_ids,
        )
        w_o = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        w_s = jnp.sin(jnp.arange(state.kv.size, dtype=jnp.float32)).reshape(state.kv.shape)
        total = jnp.sum(o * w_o) + jnp.sum(state.kv * w_s) + jnp.sum(state.k_sum)
        return total, (o, state.kv, state.k_sum)

    grads, outputs = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(q, k, v, a, kv0, z0)
    return outputs, grads


@pytest.mark.parametrize(("decay", "Hw", "Mw"), [("per_token", 2, 128), ("per_key", 16, 8)])
def test_head_blocks_match_float64_and_chunk(decay, Hw, Mw):
    """The kernels read `[B, T, H, K]` as it lies, a grid step holding all H heads, or groups of
    8 (`HeadBlocks`): K = V = 128 (a vector register's lanes), and H = 16 (two groups of 8)."""
    rng = np.random.default_rng(3)
    T = 37
    q, k = (np.abs(rng.normal(size=(1, T, Hw, Mw))) / Mw**0.5 for _ in range(2))
    v = rng.normal(size=(1, T, Hw, Mw))
    shape = (1, T, Hw) if decay == "per_token" else (1, T, Hw, Mw)
    a = -rng.uniform(0.0, 0.3, size=shape)
    kv0 = rng.normal(size=(1, Hw, Mw, Mw))
    z0 = np.abs(rng.normal(size=(1, Hw, Mw))) + 0.5
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, a, kv0, z0)]
    seg = _segments(T, (20,))
    with K.pallas_interpret():
        outs, grads = _wide_outputs_and_grads(*args, seg, method="pallas")
    outs_c, grads_c = _wide_outputs_and_grads(*args, seg, method="chunk")
    ref = causal_linear_attention_loop(*args, segment_ids=np.asarray(seg))
    for name, x, x_c, r in zip(("o", "kv", "k_sum"), outs, outs_c, ref, strict=True):
        assert rel_err(x, r) < 1e-4, (name, rel_err(x, r))
        assert rel_err(x, x_c) < 1e-4, (name, rel_err(x, x_c))
    names = ("q", "k", "v", "log_decay", "kv0", "k_sum0")
    for name, g, g_c in zip(names, grads, grads_c, strict=True):
        assert rel_err(g, g_c) < 1e-4, (name, rel_err(g, g_c))


# ---- the delta rule: the forward and backward passes each one Pallas kernel ----

HV = 2 * H  # grouped value heads: value head j reads q/k head j // 2


def _delta_weights(T):
    w_o = np.cos(np.arange(T * HV * DV)).reshape(1, T, HV, DV)
    w_s = np.sin(np.arange(HV * M * DV)).reshape(1, HV, M, DV)
    return w_o, w_s


def _delta_losses(args, segment_ids):
    q, k, v, beta, a, s0 = args
    seg = None if segment_ids is None else np.broadcast_to(segment_ids, (q.shape[0], q.shape[1]))
    o, s = kda_loop(q, k, v, beta, a, s0, segment_ids=seg)
    w_o, w_s = _delta_weights(q.shape[1])
    return (o * w_o).sum((1, 2, 3)) + (s * w_s).sum((1, 2, 3))


@functools.partial(jax.jit, static_argnames=("method", "chunk_size"))
def _delta_outputs_and_grads(q, k, v, beta, a, s0, segment_ids, *, method, chunk_size=16):
    def loss(q, k, v, beta, a, s0):
        o, state = K.delta_rule(
            q,
            k,
            v,
            beta,
            log_decay=a,
            method=method,
            chunk_size=chunk_size,
            initial_state=K.LinearAttentionState(s0, None),
            return_state=True,
            segment_ids=segment_ids,
        )
        w_o, w_s = (jnp.asarray(w, jnp.float32) for w in _delta_weights(q.shape[1]))
        return jnp.sum(o * w_o) + jnp.sum(state.kv * w_s), (o, state.kv)

    argnums = (0, 1, 2, 3, 5) if a is None else (0, 1, 2, 3, 4, 5)
    grads, outputs = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, beta, a, s0)
    if a is None:
        grads = (*grads[:4], None, grads[4])
    return outputs, grads


def _delta_inputs(T, decay, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, T, H, M))
    k = rng.normal(size=(1, T, H, M))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(1, T, HV, DV))
    beta = rng.uniform(0.1, 1.9, size=(1, T, HV))  # β > 1: negative eigenvalues
    a = {
        "none": None,  # DeltaNet
        "per_token": -rng.uniform(0.0, 0.3, size=(1, T, HV)),  # Gated DeltaNet
        "per_key": -rng.uniform(0.0, 0.3, size=(1, T, HV, M)),  # KDA
    }[decay]
    if decay == "per_key":
        a[..., 0, 1] = -30.0
    s0 = rng.normal(size=(1, HV, M, DV))
    return [None if x is None else jnp.asarray(x, jnp.float32) for x in (q, k, v, beta, a, s0)]


# (decay, T, document starts, chunk): T = 1 and T not a multiple of the chunk; resets mid-chunk
# and on a chunk boundary; a −30 log decay on one key channel (per_key); chunks of 32 and 64 are
# 2 and 4 sub-blocks of 16 queries, so the kernels' block forward substitution (and, backwards,
# the block back substitution and the earlier keys' factors) runs (a reset inside a sub-block,
# one on a sub-block edge).
DELTA_CASES = [
    ("none", 37, (5, 16), 16),
    ("per_token", 1, (), 16),
    ("per_key", 37, (20, 32), 16),
    ("per_key", 45, (20, 32), 32),
    ("per_key", 50, (7, 48), 64),
]


def check_delta_pallas_against_references(backend, args, starts, chunk_size):
    """The delta rule's `pallas` on `backend` (interpreted) from an initial state: outputs, final
    state and every gradient within 1e-4 of the float64 loop (finite differences for the
    gradients) and of `chunk`."""
    T = args[0].shape[1]
    seg = _segments(T, starts) if starts else None
    run = functools.partial(_delta_outputs_and_grads, chunk_size=chunk_size)
    with K.pallas_interpret(backend):
        (o, s), grads = run(*args, seg, method="pallas")
    (o_c, s_c), grads_c = run(*args, seg, method="chunk")
    seg_np = None if seg is None else np.asarray(seg)
    ref = kda_loop(*args, segment_ids=seg_np)
    for name, x, x_c, r in zip(("o", "S"), (o, s), (o_c, s_c), ref, strict=True):
        assert rel_err(x, r) < 1e-4, (name, rel_err(x, r))
        assert rel_err(x, x_c) < 1e-4, (name, rel_err(x, x_c))
    losses = functools.partial(_delta_losses, segment_ids=seg_np)
    ref_grads = _finite_difference_grads(args, None, seg_np, losses=losses)
    names = ("q", "k", "v", "beta", "log_decay", "s0")
    for name, g, g_c, r in zip(names, grads, grads_c, ref_grads, strict=True):
        if r is None:
            assert g is None
            continue
        assert rel_err(g, r) < 1e-4, (name, rel_err(g, r))
        assert rel_err(g, g_c) < 1e-4, (name, rel_err(g, g_c))


@pytest.mark.parametrize(("decay", "T", "starts", "chunk_size"), DELTA_CASES)
def test_delta_rule_matches_float64_recurrence_and_chunk(decay, T, starts, chunk_size):
    """The forward kernel (UT transform inside it) and the backward kernel (the UT transform
    made again, its pullback inside it), from an initial state, with grouped value heads."""
    args = _delta_inputs(T, decay)
    check_delta_pallas_against_references("tpu", args, starts, chunk_size)


def test_delta_rule_bfloat16_inputs_match_chunk():
    """bfloat16 q, k, v, β in, bfloat16 out, float32 state, as close to `chunk` as bfloat16
    rounding (both read the same bfloat16 inputs)."""
    q, k, v, beta, a, s0 = _delta_inputs(21, "per_key", seed=4)
    q, k, v, beta = (x.astype(jnp.bfloat16) for x in (q, k, v, beta))
    seg = _segments(21, (9,))
    with K.pallas_interpret():
        (o, s), grads = _delta_outputs_and_grads(q, k, v, beta, a, s0, seg, method="pallas")
    (o_c, s_c), grads_c = _delta_outputs_and_grads(q, k, v, beta, a, s0, seg, method="chunk")
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_err(o, o_c) < 1e-2
    assert rel_err(s, s_c) < 1e-4
    for g, g_c in zip(grads, grads_c, strict=True):
        assert g.dtype == g_c.dtype
        assert rel_err(g, g_c) < 2e-2


# ---- DPLR (RWKV-7) and DeltaProduct: their forward and backward kernels ----


def _family_inputs(family, T, seed=0):
    """Batch-1 inputs of `dplr_delta_rule` or `delta_product` (H heads, n = 2 steps)."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.normal(size=shape)  # noqa: E731
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    s0 = f(1, H, M, DV)
    if family == "dplr":  # RWKV-7: a = −κ̂, b = κ̂ ⊙ rate, a decay per key channel
        kappa = unit(f(1, T, H, M))
        w = -rng.uniform(0.0, 0.3, size=(1, T, H, M))
        w[..., 0, 1] = -30.0
        rate = 1 / (1 + np.exp(-f(1, T, H, M)))
        args = (f(1, T, H, M), 0.5 * f(1, T, H, M), f(1, T, H, DV), -kappa, kappa * rate, w, s0)
    else:  # Gated DeltaProduct, two Householder steps per token
        k = unit(f(1, T, H, 2, M))
        beta = rng.uniform(0.1, 1.9, size=(1, T, H, 2))
        a = -rng.uniform(0.0, 0.3, size=(1, T, H))
        args = (f(1, T, H, M), k, f(1, T, H, 2, DV), beta, a, s0)
    return [jnp.asarray(x, jnp.float32) for x in args]


def _family_run(family, method, args, segment_ids, chunk_size):
    *xs, decay, s0 = args
    fn = K.dplr_delta_rule if family == "dplr" else K.delta_product
    o, state = fn(
        *xs,
        log_decay=decay,
        method=method,
        chunk_size=chunk_size,
        initial_state=K.LinearAttentionState(s0, None),
        return_state=True,
        segment_ids=segment_ids,
    )
    return o, state.kv


@functools.partial(jax.jit, static_argnames=("family", "method", "chunk_size"))
def _family_outputs_and_grads(args, segment_ids, *, family, method, chunk_size=16):
    def loss(args):
        o, s = _family_run(family, method, args, segment_ids, chunk_size)
        w_o = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
        w_s = jnp.sin(jnp.arange(s.size, dtype=jnp.float32)).reshape(s.shape)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)

    grads, outputs = jax.grad(loss, has_aux=True)(args)
    return outputs, grads


def _family_losses(family, segment_ids, args):
    loop = dplr_loop if family == "dplr" else delta_product_loop
    *xs, decay, s0 = args
    rows, T = xs[0].shape[:2]
    seg = None if segment_ids is None else np.broadcast_to(segment_ids, (rows, T))
    o, s = loop(*xs, decay, s0, segment_ids=seg)
    w_o = np.cos(np.arange(o[0].size)).reshape(o.shape[1:])
    w_s = np.sin(np.arange(s[0].size)).reshape(s.shape[1:])
    return (o * w_o).sum((1, 2, 3)) + (s * w_s).sum((1, 2, 3))


FAMILY_CASES = [
    ("dplr", 37, (20, 32), 16),
    ("dplr", 1, (), 16),
    ("dplr", 45, (20, 32), 32),  # two sub-blocks: the kernels' block substitutions
    ("dplr", 50, (7, 48), 64),  # four sub-blocks, one padded chunk, a reset on a sub-block edge
    ("product", 21, (8,), 16),
]


@pytest.mark.parametrize(("family", "T", "starts", "chunk_size"), FAMILY_CASES)
def test_dplr_and_delta_product_match_float64_recurrence_and_chunk(family, T, starts, chunk_size):
    """DPLR: resets mid-chunk (inside a sub-block) and on a chunk boundary, −30 on one channel,
    T = 1; DeltaProduct: T·n sub-tokens over two chunks, a reset mid-chunk; all from an initial
    state."""
    args = _family_inputs(family, T)
    seg = _segments(T, starts)
    run = functools.partial(_family_outputs_and_grads, family=family, chunk_size=chunk_size)
    with K.pallas_interpret():
        (o, s), grads = run(args, seg, method="pallas")
    (o_c, s_c), grads_c = run(args, seg, method="chunk")
    seg_np = np.asarray(seg)
    loop = dplr_loop if family == "dplr" else delta_product_loop
    ref = loop(*args, segment_ids=seg_np)
    for name, x, x_c, r in zip(("o", "S"), (o, s), (o_c, s_c), ref, strict=True):
        assert rel_err(x, r) < 1e-4, (name, rel_err(x, r))
        assert rel_err(x, x_c) < 1e-4, (name, rel_err(x, x_c))
    losses = functools.partial(_family_losses, family, seg_np)
    ref_grads = _finite_difference_grads(args, None, seg_np, losses=losses)
    for i, (g, g_c, r) in enumerate(zip(grads, grads_c, ref_grads, strict=True)):
        assert rel_err(g, r) < 1e-4, (i, rel_err(g, r))
        assert rel_err(g, g_c) < 1e-4, (i, rel_err(g, g_c))


def test_dplr_bfloat16_inputs_match_chunk():
    """bfloat16 q, k, v, a, b in, bfloat16 out, float32 state, as close to `chunk` as bfloat16
    rounding (both read the same bfloat16 inputs)."""
    q, k, v, a, b, w, s0 = _family_inputs("dplr", 21, seed=4)
    args = [*(x.astype(jnp.bfloat16) for x in (q, k, v, a, b)), w, s0]
    seg = _segments(21, (9,))
    run = functools.partial(_family_outputs_and_grads, family="dplr")
    with K.pallas_interpret():
        (o, s), grads = run(args, seg, method="pallas")
    (o_c, s_c), grads_c = run(args, seg, method="chunk")
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_err(o, o_c) < 1e-2
    assert rel_err(s, s_c) < 1e-4
    for g, g_c in zip(grads, grads_c, strict=True):
        assert g.dtype == g_c.dtype
        assert rel_err(g, g_c) < 2e-2


# ---- dispatch ----


def test_pallas_outside_tpu_raises_unless_interpreted():
    q, k, v, *_ = _inputs(5, "none")
    with pytest.raises(ValueError, match="target TPU.*pallas_interpret"):
        K.causal_linear_attention(q, k, v, method="pallas", chunk_size=16)
    beta = jnp.full(q.shape[:3], 0.5)
    k2, v2, beta2 = k[:, :, :, None], v[:, :, :, None], beta[..., None]
    calls = [
        lambda: K.delta_rule(q, k, v, beta, method="pallas", chunk_size=16),
        lambda: K.dplr_delta_rule(q, k, v, -k, k, method="pallas", chunk_size=16),
        lambda: K.delta_product(q, k2, v2, beta2, method="pallas", chunk_size=16),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="target TPU.*pallas_interpret"):
            call()


def test_pallas_chunk_size_must_tile():
    q, k, v, *_ = _inputs(5, "none")
    with K.pallas_interpret(), pytest.raises(ValueError, match="chunk_size must be a multiple"):
        K.causal_linear_attention(q, k, v, method="pallas", chunk_size=24)


def test_pallas_forward_mode_names_the_alternatives():
    q, k, v, *_ = _inputs(5, "none")
    f = functools.partial(K.causal_linear_attention, method="pallas", chunk_size=16)
    with K.pallas_interpret(), pytest.raises(ValueError, match="reverse-mode.*chunk_parallel"):
        jax.jvp(lambda q: f(q, k, v), (q,), (q,))


def test_unknown_method_lists_pallas():
    q, k, v, *_ = _inputs(5, "none")
    with pytest.raises(ValueError, match="unknown method 'mosaic'; allowed: .*pallas"):
        K.causal_linear_attention(q, k, v, method="mosaic")


# ---- the Mosaic kernels, compiled for TPUs through libtpu ----


def _tpu_topology(name):
    """A TPU topology from libtpu (no TPU needed), or skip with the reason."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several xdist workers
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # libtpu absent or unusable: nothing to compile with
        pytest.skip(f"no TPU compiler (libtpu) for {name}: {e}")


# Each compile takes 8-40 s on the 2-core machine: the default run compiles every kernel once
# for v5e or v6e, and each generation at least three times (linear at two decays, the delta
# rule at two, DPLR on v5e, DeltaProduct on v6e); `-m slow` compiles every kernel for both.
_SLOW = pytest.mark.slow
_DEFAULT_COMPILES = [
    ("v5e:2x2", "linear", "per_token"),
    ("v6e:2x2", "linear", "per_key"),
    ("v5e:2x2", "delta_rule", "per_token"),
    ("v6e:2x2", "delta_rule", "per_key"),
    ("v5e:2x2", "dplr_delta_rule", "per_key"),
    ("v6e:2x2", "delta_product", "per_token"),
]
COMPILE_CASES = [
    pytest.param(*case, marks=() if case in _DEFAULT_COMPILES else _SLOW)
    for case in [
        *(
            (t, "linear", d)
            for t in ("v5e:2x2", "v6e:2x2")
            for d in ("none", "per_token", "per_key")
        ),
        # the delta family: forward and backward kernels, the UT transform inside both
        *(
            (t, "delta_rule", d)
            for t in ("v5e:2x2", "v6e:2x2")
            for d in ("none", "per_token", "per_key")
        ),
        *(
            (t, kernel, d)
            for t in ("v5e:2x2", "v6e:2x2")
            for kernel, d in (("dplr_delta_rule", "per_key"), ("delta_product", "per_token"))
        ),
    ]
]


@pytest.mark.parametrize(("topology", "kernel", "decay"), COMPILE_CASES)
def test_compiles_for_tpu(topology, kernel, decay):
    """Forward and gradient in one program at B=1, T=4096, H=4, K=V=128, bfloat16, chunk 64."""
    _compile_forward_and_grads(topology, kernel, decay, T=4096, Mc=128, chunk_size=64)


# The MXU's other shapes: head dims 64 and 256, chunk 128 (10-100 s a compile here).
MXU_SHAPE_CASES = [
    pytest.param(topology, kernel, decay, Mc, chunk_size, marks=_SLOW)
    for topology in ("v5e:2x2", "v6e:2x2")
    for kernel, decay in [
        ("linear", "per_token"),
        ("linear", "per_key"),
        ("delta_rule", "per_token"),
        ("delta_rule", "per_key"),
        ("dplr_delta_rule", "per_key"),
        ("delta_product", "per_token"),
    ]
    for Mc, chunk_size in [(64, 64), (256, 64), (128, 128), (256, 128)]
]


@pytest.mark.parametrize(("topology", "kernel", "decay", "Mc", "chunk_size"), MXU_SHAPE_CASES)
def test_compiles_for_tpu_at_mxu_shapes(topology, kernel, decay, Mc, chunk_size):
    """Forward and gradient at B=1, T=2048, H=4, K=V=Mc, bfloat16, the given chunk."""
    _compile_forward_and_grads(topology, kernel, decay, T=2048, Mc=Mc, chunk_size=chunk_size)


def _compile_forward_and_grads(topology, kernel, decay, *, T, Mc, chunk_size):
    from linear_attention.kernels.primitives.pallas import pallas_mosaic

    topo = _tpu_topology(topology)
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    B, Hc = 1, 4

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    decay_shape = {"none": None, "per_token": (B, T, Hc), "per_key": (B, T, Hc, Mc)}[decay]
    a = None if decay_shape is None else spec(decay_shape, jnp.float32)
    options = dict(method="pallas", chunk_size=chunk_size)
    qkv = [spec((B, T, Hc, Mc)) for _ in range(3)]
    match kernel:  # the inputs besides q, k, v (β; DPLR's a, b), all differentiated
        case "linear":
            extra, call = (), K.causal_linear_attention
        case "delta_rule":
            extra, call = (spec((B, T, Hc)),), K.delta_rule
        case "dplr_delta_rule":
            extra, call = (spec((B, T, Hc, Mc)), spec((B, T, Hc, Mc))), K.dplr_delta_rule
        case "delta_product":  # n = 2 steps per token
            qkv[1:] = [spec((B, T, Hc, 2, Mc)) for _ in range(2)]
            extra, call = (spec((B, T, Hc, 2)),), K.delta_product
        case _:
            raise ValueError(f"unknown kernel {kernel!r}")

    def loss(q, k, v, extra, a):
        o = call(q, k, v, *extra, log_decay=a, **options)
        return jnp.sum(o.astype(jnp.float32) ** 2), o

    def forward_and_grads(q, k, v, extra, a):
        argnums = (0, 1, 2, 3) + (() if a is None else (4,))
        return jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, extra, a)

    with pallas_mosaic():
        traced = jax.jit(forward_and_grads).trace(*qkv, extra, a)
        lowered = traced.lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert "tpu_custom_call" in text  # the Mosaic kernels, not an XLA fallback
    compiled = lowered.compile()
    assert compiled.memory_analysis() is not None
    assert compiled.cost_analysis()["flops"] > 0

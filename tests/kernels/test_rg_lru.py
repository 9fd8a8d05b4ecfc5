"""Griffin's RG-LRU kernel (`K.rg_lru`): both methods against the float64 loop — outputs, final
state and the gradient of every input (by finite differences of the loop) — across packed rows,
an initial state, strong and weak decays and T = 1; the step form token by token; bfloat16
inputs; the NaN guard; the method check; and (`-m hf`) the recurrence of transformers' torch
`RecurrentGemmaRglru`. Time split over CPU devices: `test_selective_scan.py` (one subprocess
for both families)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import finite_difference_grads, rel_err, rg_lru_loop

B, T, D = 2, 7, 3
SEGMENTS = np.array([[0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 2, 3, 3]], np.int32)
METHODS = ("scan", "associative_scan")


def inputs(seed=0, T=T, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(B, T, D)),
        "log_a": -scale * rng.uniform(0.05, 1.5, size=(B, T, D)),
        "h0": rng.normal(size=(B, D)),
    }


@functools.cache
def kernel(method, segments):
    seg = jnp.asarray(SEGMENTS) if segments else None

    def run(x, log_a, h0):
        return K.rg_lru(x, log_a, initial_state=h0, segment_ids=seg, method=method)

    return jax.jit(run)


def loss_weights(T=T):
    rng = np.random.default_rng(7)
    return rng.normal(size=(B, T, D)), rng.normal(size=(B, D))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("segments", [False, True])
def test_matches_loop(method, segments):
    xs = inputs()
    y, h = kernel(method, segments)(*(jnp.asarray(v, jnp.float32) for v in xs.values()))
    y_ref, h_ref = rg_lru_loop(**xs, segment_ids=SEGMENTS if segments else None)
    assert h.dtype == jnp.float32
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_gradients_match_finite_differences(method):
    xs = inputs(1)
    wy, wh = loss_weights()

    def loss_ref(**kw):
        y, h = rg_lru_loop(**kw, segment_ids=SEGMENTS)
        return np.sum(wy * y) + np.sum(wh * h)

    run = kernel(method, True)

    def loss(x, log_a, h0):
        y, h = run(x, log_a, h0)
        return jnp.sum(wy * y) + jnp.sum(wh * h)

    args = [jnp.asarray(v, jnp.float32) for v in xs.values()]
    grads = jax.grad(loss, argnums=(0, 1, 2))(*args)
    refs = finite_difference_grads(loss_ref, xs)
    for name, g in zip(xs, grads, strict=True):
        assert rel_err(g, refs[name]) < 1e-5, (name, rel_err(g, refs[name]))


@pytest.mark.parametrize("method", METHODS)
def test_strong_and_weak_decay_and_one_token(method):
    for xs in (inputs(2, scale=40.0), inputs(3, scale=1e-5), inputs(4, T=1)):
        y, h = kernel(method, False)(*(jnp.asarray(v, jnp.float32) for v in xs.values()))
        y_ref, h_ref = rg_lru_loop(**xs)
        assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_step_reproduces_scan():
    xs = {k: np.float32(v) for k, v in inputs(5).items()}  # NumPy slices: no op per slice
    y, h = kernel("scan", False)(xs["x"], xs["log_a"], xs["h0"])
    state = xs["h0"]
    step = jax.jit(K.rg_lru_step)
    for t in range(T):
        y_t, state = step(xs["x"][:, t], xs["log_a"][:, t], state)
        np.testing.assert_allclose(y_t, y[:, t], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state, h, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_bfloat16_inputs(method):
    xs = inputs(6)
    x, log_a = (jnp.asarray(xs[k], jnp.bfloat16) for k in ("x", "log_a"))
    run = jax.jit(functools.partial(K.rg_lru, method=method))
    y, h = run(x, log_a, segment_ids=jnp.asarray(SEGMENTS))
    assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    # the loop on the rounded inputs: only the output's own rounding differs
    y_ref, h_ref = rg_lru_loop(np.float32(x), np.float32(log_a), segment_ids=SEGMENTS)
    assert rel_err(y, y_ref) < 1e-2 and rel_err(h, h_ref) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_nan_stays_in_its_channel_until_a_reset(method):
    xs = inputs(8)
    x = xs["x"].copy()
    x[0, 1, 2] = np.nan  # row 0: documents [0, 3) and [3, 7)
    y, h = kernel(method, True)(*(jnp.asarray(v, jnp.float32) for v in (x, xs["log_a"], xs["h0"])))
    bad = np.zeros((B, T, D), bool)
    bad[0, 1:3, 2] = True
    assert np.all(np.isnan(np.asarray(y)[bad])) and np.all(np.isfinite(np.asarray(y)[~bad]))
    y_ref, _ = rg_lru_loop(x, xs["log_a"], xs["h0"], SEGMENTS)
    assert rel_err(np.asarray(y)[~bad], y_ref[~bad]) < 1e-5
    assert np.all(np.isfinite(h))


def test_bad_method_names_the_allowed_ones():
    x = jnp.zeros((B, T, D))
    with pytest.raises(ValueError, match="scan, associative_scan"):
        K.rg_lru(x, x, method="chunk")
    with pytest.raises(ValueError, match="log_a"):
        K.rg_lru(x, x[:, :, :2])


@pytest.mark.hf
@pytest.mark.parametrize("method", METHODS)
def test_against_transformers_recurrent_gemma(method):
    """The recurrence of transformers' torch `RecurrentGemmaRglru` (its `SqrtBoundDerivative`
    normalisation, unscaled input at a reset, and `_rnn_scan`), fed log a_t and the gated input
    directly, with a document start mid-row (`position_ids` 0) and an initial state: outputs,
    final state and the gradients of every input agree with its float32 run within that run's
    error against its float64 one (float64 accumulation), or 1e-5 relative."""
    torch = pytest.importorskip("torch")
    rg = pytest.importorskip("transformers.models.recurrent_gemma.modeling_recurrent_gemma")
    xs = inputs(12)
    rng = np.random.default_rng(13)
    wy, wh = rng.normal(size=(B, T, D)), rng.normal(size=(B, D))
    # positions continue a document at t = 0 (no reset there, as in this library) and restart
    # where SEGMENTS changes: the peer resets where the position is 0
    starts = np.pad(SEGMENTS[:, 1:] != SEGMENTS[:, :-1], ((0, 0), (1, 0)))
    index = np.arange(T) + 5  # the row continues a document begun 5 tokens earlier
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)

    def peer(dtype):
        t = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in xs.items()}
        reset = torch.tensor(positions == 0)[:, :, None]
        a_square = torch.exp(2 * t["log_a"])
        multiplier = rg.SqrtBoundDerivative.apply(1 - a_square)
        multiplier = reset + ~reset * multiplier
        y, h = rg.RecurrentGemmaRglru._rnn_scan(
            None, t["x"] * multiplier, torch.exp(t["log_a"]), reset, t["h0"], acc_dtype=dtype
        )
        loss = (y * torch.tensor(wy, dtype=dtype)).sum() + (h * torch.tensor(wh, dtype=dtype)).sum()
        loss.backward()
        return [y.detach().numpy(), h.detach().numpy()] + [t[k].grad.numpy() for k in xs]

    peer32, peer64 = peer(torch.float32), peer(torch.float64)
    y_ref, h_ref = rg_lru_loop(**xs, segment_ids=SEGMENTS)  # the same recurrence as the loop
    assert rel_err(peer64[0], y_ref) < 1e-12 and rel_err(peer64[1], h_ref) < 1e-12

    def loss(*args):
        y, h = kernel(method, True)(*args)
        return jnp.sum(wy * y) + jnp.sum(wh * h), (y, h)

    args = [jnp.asarray(xs[k], jnp.float32) for k in xs]
    grads, (y, h) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*args)
    for name, a, p32, p64 in zip(["y", "h", *xs], [y, h, *grads], peer32, peer64, strict=True):
        bound = max(rel_err(p32, p64), 1e-5)
        assert rel_err(a, p32) <= bound, (name, rel_err(a, p32), bound)


@pytest.mark.parametrize("method", METHODS)
def test_no_token_passes_the_state_through(method):
    xs = {k: np.float32(v) for k, v in inputs(14, T=0).items()}
    y, h = K.rg_lru(xs["x"], xs["log_a"], initial_state=xs["h0"], method=method)
    assert y.shape == (B, 0, D) and np.array_equal(h, xs["h0"])

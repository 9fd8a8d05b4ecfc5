"""Edges of the newer kernel families (issue 75): PaTH's β range and unit w, log-linear's level
weights, empty rows (T = 0) of FoX, PaTH and log-linear, zero-width heads of linear attention
(every method, Pallas included), and MesaNet's report of an unconverged conjugate gradient
(the residual against a float64 NumPy CG, and the eager warning)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from linear_attention.kernels.softmax.gated_cache import empty_cache

B, T, H, D = 1, 4, 2, 4


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def path_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(3))
    w = unit(rng.normal(size=(B, T, H, D))).astype(np.float32)
    beta = rng.uniform(0.1, 1.9, size=(B, T, H)).astype(np.float32)
    return q, k, v, w, beta


def with_nan(x, index):
    x = x.copy()
    x[index] = np.nan
    return x


@pytest.mark.parametrize(
    "case, message",
    [
        ("beta 2.5", r"beta must lie in \[0, 2\], got values in \[2.5, 2.5\]"),
        ("beta -1", r"beta must lie in \[0, 2\], got values in \[-1.0, -1.0\]"),
        ("beta nan", r"beta holds NaN .* the first at index \(0, 2, 1\)"),
        ("w norm 2", r"w must hold unit vectors .* got norm 2 at index \(0, 0, 0\)"),
        ("w nan", r"w must hold unit vectors .* got norm nan at index \(0, 3, 1\)"),
    ],
)
def test_path_refuses_beta_outside_0_2_and_non_unit_w(case, message):
    q, k, v, w, beta = path_inputs()
    w, beta = {
        "beta 2.5": (w, np.full_like(beta, 2.5)),
        "beta -1": (w, np.full_like(beta, -1.0)),
        "beta nan": (w, with_nan(beta, (0, 2, 1))),
        "w norm 2": (2 * w, beta),
        "w nan": (with_nan(w, (0, 3, 1, 0)), beta),
    }[case]
    for method in ("chunk", "quadratic"):
        with pytest.raises(ValueError, match=message):
            K.path_attention(q, k, v, w, beta, method=method)
    # a constant closed over under jit is concrete too (the kernels' value-check convention)
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda q: K.path_attention(q, k, v, w, beta))(q)
    cache = empty_cache(B, 8, H, D, D, jnp.float32)
    with pytest.raises(ValueError, match=message):
        K.cached_path_attention(cache, 0, q, k, v, w, beta)


def test_path_accepts_the_closed_range_and_shorter_w():
    """β = 0 (the identity), β = 2 (an exact reflection) and ‖w‖ < 1 (l2norm's ε shortens a
    near-zero w) are non-expansive: accepted, and β = 0 equals FoX without a gate."""
    q, k, v, w, beta = path_inputs(1)
    zero = K.path_attention(q, k, v, 0.5 * w, np.zeros_like(beta))
    fox = K.forgetting_attention(q, k, v, None)
    np.testing.assert_allclose(zero, fox, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(K.path_attention(q, k, v, w, np.full_like(beta, 2.0))))
    # traced values are not read (the layer builds them in range): no error under jit
    traced = jax.jit(K.path_attention)(q, k, v, w, jnp.full_like(beta, 2.5))
    assert traced.shape == v.shape


@pytest.mark.parametrize("bad, shown", [(-0.5, "-0.5"), (np.nan, "nan")])
def test_log_linear_refuses_negative_or_nan_level_weights(bad, shown):
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(3))
    lam = rng.uniform(0.5, 1.5, size=(B, T, H, 3)).astype(np.float32)
    lam[0, 2, 1, 0] = bad
    message = rf"level_weights must be >= 0 .* got {shown} at index \(0, 2, 1, 0\)"
    for method in K.LOG_LINEAR_METHODS:
        with pytest.raises(ValueError, match=message):
            K.log_linear_attention(q, k, v, None, lam, method=method)
    beta = np.ones((B, T, H), np.float32)
    with pytest.raises(ValueError, match=message):
        K.log_linear_delta_rule(q, unit(k), v, beta, None, lam)
    state = K.LogLinearState.zeros(B, H, 3, D, D)
    with pytest.raises(ValueError, match=r"level_weights must be >= 0"):
        K.log_linear_attention_step(state, q[:, 2], k[:, 2], v[:, 2], None, lam[:, 2])
    with pytest.raises(ValueError, match=r"level_weights must be >= 0"):
        K.log_linear_delta_rule_step(state, q[:, 2], k[:, 2], v[:, 2], beta[:, 2], None, lam[:, 2])


def test_empty_rows():
    """T = 0: FoX and PaTH give the empty output (as softmax attention); log-linear, whose
    state needs a position, refuses it as linear attention and the delta rule do."""
    e = np.zeros((B, 0, H, D), np.float32)
    g = np.zeros((B, 0, H), np.float32)
    for method in ("chunk", "quadratic"):
        o = K.forgetting_attention(e, e, e[..., :3], g, method=method)
        assert o.shape == (B, 0, H, 3) and o.dtype == jnp.float32
        o = K.path_attention(e, e, e[..., :3], e, g, g, method=method)
        assert o.shape == (B, 0, H, 3) and o.dtype == jnp.float32
    lam = np.zeros((B, 0, H, 3), np.float32)
    for method in K.LOG_LINEAR_METHODS:
        with pytest.raises(ValueError, match="at least one time step"):
            K.log_linear_attention(e, e, e, g, lam, method=method)
    with pytest.raises(ValueError, match="at least one time step"):
        K.log_linear_delta_rule(e, e, e, g, g, lam)


@pytest.mark.parametrize("method", [*K.METHODS, "pallas"])
@pytest.mark.parametrize("zero", ["qk", "v"])
def test_linear_attention_refuses_a_zero_width_head(method, zero):
    x = np.ones((B, 16, H, D), np.float32)
    empty = np.ones((B, 16, H, 0), np.float32)
    q, k, v = (empty, empty, x) if zero == "qk" else (x, x, empty)
    name = "q, k" if zero == "qk" else "v"
    with K.pallas_interpret(), pytest.raises(ValueError, match=f"{name} must have at least one"):
        K.causal_linear_attention(q, k, v, method=method)


def cg_residual_loop(q, k, beta, lam, steps):
    """float64 NumPy: H_kk,t by the loop, `steps` CG iterations from 0, the relative residual."""
    out = np.zeros(q.shape[:3])
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            kk = np.zeros((q.shape[-1],) * 2)
            for t in range(q.shape[1]):
                kk = kk + beta[b, t, h] * np.outer(k[b, t, h], k[b, t, h])
                a = kk + np.diag(lam[h])
                x, r = np.zeros_like(q[b, t, h]), q[b, t, h].copy()
                p, delta = r.copy(), r @ r
                for _ in range(steps):
                    ap = a @ p
                    alpha = delta / (p @ ap) if p @ ap > 0 else 0.0
                    x, r = x + alpha * p, r - alpha * ap
                    new = r @ r
                    p, delta = r + (new / delta if delta > 0 else 0.0) * p, new
                out[b, t, h] = np.linalg.norm(a @ x - q[b, t, h]) / np.linalg.norm(q[b, t, h])
    return out


def test_mesa_net_reports_an_unconverged_cg():
    rng = np.random.default_rng(3)
    Tm, Km = 12, 8
    q, k = (unit(rng.normal(size=(B, Tm, H, Km))) for _ in range(2))
    v = rng.normal(size=(B, Tm, H, 3))
    beta = rng.uniform(0.5, 1.0, size=(B, Tm, H))
    q, k, v, beta = (x.astype(np.float32) for x in (q, k, v, beta))
    small, large = np.full((H, Km), 1e-4, np.float32), np.full((H, Km), 1.0, np.float32)
    # the residual after 3 iterations (far from converged) equals a float64 CG's
    r = K.mesa_net_residual(q, k, None, beta, small, cg_steps=3)
    assert r.shape == (B, Tm, H) and r.dtype == jnp.float32
    np.testing.assert_allclose(r, cg_residual_loop(q, k, beta, small, 3), rtol=2e-3, atol=2e-3)
    # jit: the residual is returned (no warning can be raised from a trace)
    jitted = jax.jit(K.mesa_net_residual, static_argnames="cg_steps")
    np.testing.assert_array_equal(jitted(q, k, None, beta, small, cg_steps=3), r)
    # eager: a warning naming cg_steps when a solve is off, none when it converged
    with pytest.warns(RuntimeWarning, match=r"did not converge in cg_steps=3: relative residual"):
        K.mesa_net(q, k, v, None, beta, small, cg_steps=3, chunk_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = K.mesa_net(q, k, v, None, beta, large, cg_steps=3 * Km, chunk_size=4)
        exact = K.mesa_net(q, k, v, None, beta, large, method="exact")
    np.testing.assert_allclose(o, exact, rtol=1e-4, atol=1e-5)
    assert float(jnp.max(K.mesa_net_residual(q, k, None, beta, large, cg_steps=3 * Km))) < 1e-5

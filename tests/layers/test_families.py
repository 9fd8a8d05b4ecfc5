"""Issue 69's families over existing kernels: each mixer's mapping onto its kernel against a
float64 NumPy loop of the family's own recurrence (tiny shapes, every method, from a state)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from linear_attention import kernels as K
from linear_attention.layers.linear import hgrn2_terms
from linear_attention.layers.rwkv6 import rwkv6_attention
from linear_attention.layers.segments import segments_of
from tests.layers.numpy_reference import rwkv6_loop, silu

B, T, H, DK, DV = 2, 7, 2, 3, 4


def _draws(seed: int, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("method", K.METHODS)
def test_rwkv6_attention_is_the_rwkv6_recurrence(method):
    """From a random state, chunks of 3 across 7 tokens: outputs and the final state; and on
    packed rows each document alone from zeros."""
    r, k, v, z, u, s0 = _draws(0, *[(B, T, H, DK)] * 2, (B, T, H, DV), (B, T, H, DK), (H, DK),
                               (B, H, DK, DV))  # fmt: skip
    log_w = -np.exp(z)
    run = jax.jit(rwkv6_attention, static_argnames=("method", "chunk_size"))
    state = K.LinearAttentionState(kv=s0, k_sum=None)
    o, s = run(r, k, v, log_w, u, method=method, chunk_size=3, initial_state=state)
    o64, s64 = rwkv6_loop(*(x.astype(np.float64) for x in (r, k, v, np.exp(log_w), u)), S=s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)
    ids = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2]])
    packed = run(r, k, v, log_w, u, method=method, chunk_size=3, segments=segments_of(ids, B, T))
    for row in range(B):
        for doc in np.unique(ids[row]):
            at = ids[row] == doc
            one = [x[row : row + 1, at].astype(np.float64) for x in (r, k, v, np.exp(log_w))]
            alone = rwkv6_loop(*one, u.astype(np.float64))[0]
            np.testing.assert_allclose(packed[row, at], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the Pallas kernel interpreted: ~3.5 s
def test_rwkv6_attention_pallas_is_the_rwkv6_recurrence():
    """method="pallas" (the TPU kernel, interpreted): 16 tokens from a random state."""
    t = 16
    r, k, v, z, u, s0 = _draws(1, *[(1, t, H, DK)] * 2, (1, t, H, DV), (1, t, H, DK), (H, DK),
                               (1, H, DK, DV))  # fmt: skip
    log_w = -np.exp(z)
    state = K.LinearAttentionState(kv=s0, k_sum=None)
    with K.pallas_interpret():
        o, s = rwkv6_attention(r, k, v, log_w, u, method="pallas", chunk_size=16,
                               initial_state=state)  # fmt: skip
    o64, s64 = rwkv6_loop(*(x.astype(np.float64) for x in (r, k, v, np.exp(log_w), u)), S=s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)


def hgrn2_loop(q, f, i, S):
    """HGRN2's recurrence in float64: γ_t = σ(f_t), S_t = Diag(γ_t) S_{t−1} + (1 − γ_t) i_tᵀ,
    o_t = S_tᵀ silu(q_t) / √K."""
    S = np.array(S, np.float64)
    o = np.zeros(i.shape)
    for t in range(q.shape[1]):
        g = 1.0 / (1.0 + np.exp(-f[:, t]))
        S = g[..., None] * S + (1.0 - g)[..., None] * i[:, t, :, None, :]
        o[:, t] = np.einsum("bhk,bhkd->bhd", silu(q[:, t]), S) / np.sqrt(q.shape[-1])
    return o, S


@pytest.mark.parametrize("method", K.METHODS)
def test_hgrn2_terms_on_the_linear_kernel_are_the_hgrn2_recurrence(method):
    q, f, i, s0 = _draws(2, (B, T, H, DK), (B, T, H, DK), (B, T, H, DV), (B, H, DK, DV))
    phi_q, phi_k, log_g = hgrn2_terms(q, 2.0 * f, DK)
    o, s = K.causal_linear_attention(
        phi_q, phi_k, i, log_decay=log_g, normalize=False, method=method, chunk_size=3,
        initial_state=K.LinearAttentionState(kv=s0, k_sum=None), return_state=True,
    )  # fmt: skip
    o64, s64 = hgrn2_loop(*(x.astype(np.float64) for x in (q, 2.0 * f, i)), s0)
    np.testing.assert_allclose(o, o64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.kv, s64, rtol=1e-5, atol=1e-5)

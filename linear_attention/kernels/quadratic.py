"""Causal linear attention in its masked O(T²) form: the reference every other method matches.

With B_t = Σ_{s≤t} a_s (the cumulative log decay),

    o_t = Σ_{s≤t} exp(B_t − B_s) (q_t·k_s) v_s + exp(B_t) q_tᵀ S_0
    S_T = exp(B_T) S_0 + Σ_s exp(B_T − B_s) k_s v_sᵀ

The T×T matrix is built explicitly, so memory is O(T²): use it for testing and short sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_quadratic(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD):
    """Unnormalised causal linear attention; float32 arrays in, `(o_BTHD, s_BHMD)` out.

    `a_BTH` is the log decay per token (None: no decay); `s0_BHMD` the state before token 0.
    """
    T = q_BTHM.shape[1]
    scores_BHTS = jnp.einsum("bthm,bshm->bhts", q_BTHM, k_BTHM)
    causal_TS = jnp.tril(jnp.ones((T, T), dtype=bool))
    if a_BTH is None:
        weights_BHTS = jnp.where(causal_TS, scores_BHTS, 0.0)
        o_BTHD = jnp.einsum("bhts,bshd->bthd", weights_BHTS, v_BTHD)
        o_BTHD += jnp.einsum("bthm,bhmd->bthd", q_BTHM, s0_BHMD)
        s_BHMD = s0_BHMD + jnp.einsum("bshm,bshd->bhmd", k_BTHM, v_BTHD)
        return o_BTHD, s_BHMD
    cum_BHT = jnp.cumsum(jnp.moveaxis(a_BTH, 1, 2), axis=-1)
    # Mask before exp: above the diagonal B_t − B_s is positive and exp could overflow.
    diff_BHTS = jnp.where(causal_TS, cum_BHT[..., :, None] - cum_BHT[..., None, :], -jnp.inf)
    weights_BHTS = scores_BHTS * jnp.exp(diff_BHTS)
    o_BTHD = jnp.einsum("bhts,bshd->bthd", weights_BHTS, v_BTHD)
    o_BTHD += jnp.einsum("bthm,bhmd->bthd", q_BTHM * _to_bth1(jnp.exp(cum_BHT)), s0_BHMD)
    last_BH = cum_BHT[..., -1]
    k_scaled_BTHM = k_BTHM * _to_bth1(jnp.exp(last_BH[..., None] - cum_BHT))
    s_BHMD = jnp.exp(last_BH)[..., None, None] * s0_BHMD
    s_BHMD += jnp.einsum("bshm,bshd->bhmd", k_scaled_BTHM, v_BTHD)
    return o_BTHD, s_BHMD


def _to_bth1(x_BHT: jax.Array) -> jax.Array:
    """[B, H, T] -> [B, T, H, 1], to scale per-token vectors."""
    return jnp.moveaxis(x_BHT, 1, 2)[..., None]

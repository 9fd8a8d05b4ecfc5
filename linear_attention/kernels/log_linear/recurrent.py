"""Log-linear attention one token at a time: the decoding step and the scan over it.

The state before position t is the list of level states, `[B, H, L, K, V]` float32 (slot s:
level s + 1; `fenwick`). One token: decay every level by exp(a_t) (a reset, −inf, empties
them), read o_t = λ⁰ (q_t·k_t) v_t + Σ_s λ^{s+1} q_tᵀ S_s, then merge as the Fenwick counter
goes from t to t + 1 (`fenwick.merge`). O(L·K·V) per token, L = O(log T): the position alone
decides which levels merge, so one compiled step serves every position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.log_linear.fenwick import capacity, merge, padded_weights


def step(s_BHLKV, position, q_BHK, k_BHK, v_BHV, a_BH, lam_BHL):
    """One token at `position` (int32 scalar, may be traced), float32 arrays: `(o [B, H, V],
    state)`; o is NaN past the capacity of the L level weights (2^(L−1) positions)."""
    s_BHLKV = jnp.exp(a_BH)[..., None, None, None] * s_BHLKV
    lam_BHL1 = padded_weights(lam_BHL)
    read_BHLV = jnp.einsum("bhk,bhlkv->bhlv", q_BHK, s_BHLKV)
    o_BHV = jnp.einsum("bhl,bhlv->bhv", lam_BHL1[..., 1:], read_BHLV)
    o_BHV += (lam_BHL[..., 0] * jnp.sum(q_BHK * k_BHK, -1))[..., None] * v_BHV
    o_BHV = jnp.where(position >= capacity(lam_BHL.shape[-1]), jnp.nan, o_BHV)
    u_BHKV = k_BHK[..., :, None] * v_BHV[..., None, :]
    return o_BHV, merge(s_BHLKV, u_BHKV, position)


def log_linear_scan(q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL, s0_BHLKV, position):
    """`lax.scan` of `step` over time from the state `s0` at `position`: `(o, final state)`."""

    def body(carry, xs):
        s_BHLKV, p = carry
        o_BHV, s_BHLKV = step(s_BHLKV, p, *xs)
        return (s_BHLKV, p + 1), o_BHV

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL))
    p0 = jnp.asarray(position, jnp.int32)
    (s_BHLKV, _), o_TBHV = jax.lax.scan(body, (s0_BHLKV, p0), xs)
    return jnp.moveaxis(o_TBHV, 0, 1), s_BHLKV

"""Log-linear attention one token at a time: the decoding step and the scan over it.

The state is a `LogLinearState`: the level states `[B, H, L, K, V]` float32 (slot s: level
s + 1) and the Fenwick position `[B, H]` (`fenwick`). One token: a reset (−inf) empties the
levels and restarts the position at 0; every level decays by exp(a_t); the token reads
o_t = λ⁰ (q_t·k_t) v_t + Σ_s λ^{s+1} q_tᵀ S_s; the levels merge as the Fenwick counter steps
from P to P + 1 (`fenwick.merge`). O(L·K·V) per token, L = O(log T); the position alone decides
which levels merge, so one compiled step serves every position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.log_linear.fenwick import (
    LogLinearState,
    capacity,
    merge,
    padded_weights,
)
from linear_attention.kernels.segments import decay_state


def step(state: LogLinearState, q_BHK, k_BHK, v_BHV, a_BH, lam_BHL):
    """One token, float32 arrays: `(o [B, H, V], state)`; o is NaN at positions past the
    capacity of the L level weights (2^(L−1))."""
    P_BH = jnp.where(jnp.isneginf(a_BH), 0, state.position)
    s_BHLKV = decay_state(a_BH[..., None, None, None], state.levels)  # a reset selects 0
    read_BHLV = jnp.einsum("bhk,bhlkv->bhlv", q_BHK, s_BHLKV)
    o_BHV = jnp.einsum("bhl,bhlv->bhv", padded_weights(lam_BHL)[..., 1:], read_BHLV)
    o_BHV += (lam_BHL[..., 0] * jnp.sum(q_BHK * k_BHK, -1))[..., None] * v_BHV
    o_BHV = jnp.where((P_BH >= capacity(lam_BHL.shape[-1]))[..., None], jnp.nan, o_BHV)
    u_BHKV = k_BHK[..., :, None] * v_BHV[..., None, :]
    return o_BHV, LogLinearState(merge(s_BHLKV, u_BHKV, P_BH), P_BH + 1)


def log_linear_scan(q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL, state: LogLinearState):
    """`lax.scan` of `step` over time from `state`: `(o, final state)`."""

    def body(state, xs):
        o_BHV, state = step(state, *xs)
        return state, o_BHV

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL))
    state, o_TBHV = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(o_TBHV, 0, 1), state

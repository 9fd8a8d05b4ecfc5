"""Causal linear attention as a parallel prefix: `jax.lax.associative_scan` over (decay, state).

Each token is the affine map S ↦ exp(a_t) S + k_t v_tᵀ. Composing two such maps is associative,

    (a₁, U₁) then (a₂, U₂)  =  (a₁ + a₂, diag(exp(a₂)) U₁ + U₂),

with a per head (a scalar) or per key dimension (scaling the rows of U). A −inf log decay (a reset)
needs no care here: the combine only adds log decays and multiplies by exp(a) = 0.

so all prefix states come out of a parallel scan in O(log T) depth. It materialises a state per
token ([B, T, H, M, Dv]): the textbook parallel form, memory-hungry at long T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_associative(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD):
    """Unnormalised causal linear attention by `lax.associative_scan`: `(o_BTHD, s_BHMD)`.

    `a_BTH`: `[B, T, H]`, `[B, T, H, M]` or None."""
    u_BTHMD = k_BTHM[..., :, None] * v_BTHD[..., None, :]
    if a_BTH is not None and a_BTH.ndim == 3:
        a_BTH = a_BTH[..., None]  # [B, T, H, 1]: one decay for every row of the state
    # The initial state enters as part of the first token's update.
    first_BHMD = u_BTHMD[:, 0] + s0_BHMD * (
        1.0 if a_BTH is None else jnp.exp(a_BTH[:, 0])[..., None]
    )
    u_BTHMD = u_BTHMD.at[:, 0].set(first_BHMD)
    if a_BTH is None:
        s_BTHMD = jax.lax.associative_scan(jnp.add, u_BTHMD, axis=1)
    else:

        def combine(earlier, later):
            a1, u1 = earlier
            a2, u2 = later
            return a1 + a2, jnp.exp(a2)[..., None] * u1 + u2

        _, s_BTHMD = jax.lax.associative_scan(combine, (a_BTH, u_BTHMD), axis=1)
    o_BTHD = jnp.einsum("bthm,bthmd->bthd", q_BTHM, s_BTHMD)
    return o_BTHD, s_BTHMD[:, -1]

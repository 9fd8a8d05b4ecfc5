"""Log-linear attention in its quadratic form, the reference: the hierarchical mask built
exactly.

    O = (Q Kᵀ ⊙ M^S ⊙ M^H) V
    M^S_ij = exp(Σ_{j<u≤i} a_u)   for j ≤ i (0 across a reset, a = −inf; 0 above the diagonal)
    M^H_ij = λ_i^{ℓ(i, j)},       ℓ(i, j) = bit_length(p_i ⊕ p_j)

with p the Fenwick positions (`fenwick.positions`). An entering state at position P is read with
the weights max(s + 1, bit_length(p_i ⊕ P)) (`fenwick.read_weights`) and the state at the end
collected slot by slot (`fenwick.write_slots`, `fenwick.move`): the whole sequence as one chunk
of the chunk form's algebra. The [T, T] weights are built explicitly (memory O(T²)): for
testing and short sequences.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.log_linear.fenwick import (
    LogLinearState,
    bit_length,
    gather_levels,
    move,
    read_weights,
    write_slots,
)
from linear_attention.kernels.primitives.decays import ChunkDecays, pair_decays


def hierarchical_mask(lam_BHTL, p_BHT):
    """M^H `[B, H, T, T]`: λ_i at level bit_length(p_i ⊕ p_j), 0 above the diagonal."""
    T = p_BHT.shape[-1]
    mask = gather_levels(lam_BHTL, bit_length(p_BHT[..., :, None] ^ p_BHT[..., None, :]))
    return jnp.where(jnp.tril(jnp.ones((T, T), bool)), mask, 0.0)


def log_linear_quadratic(q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL, p_BTH, state):
    """Float32 arrays in (a `[B, T, H]`, λ `[B, T, H, L]`, positions p `[B, T, H]`, the entering
    `LogLinearState`), `(o [B, T, H, V], final LogLinearState)` out."""
    L = lam_BTHL.shape[-1]
    q, k, v, lam = (jnp.moveaxis(x, 1, 2) for x in (q_BTHK, k_BTHK, v_BTHV, lam_BTHL))
    p = jnp.moveaxis(p_BTH, 1, 2)  # [B, H, T]
    d = ChunkDecays(jnp.moveaxis(a_BTH, 1, 2)[..., None])  # the whole sequence as one chunk
    weights = jnp.einsum("bhik,bhjk->bhij", q, k)
    weights = weights * pair_decays(d.b[..., 0], d.n[..., 0]) * hierarchical_mask(lam, p)
    o = jnp.einsum("bhij,bhjv->bhiv", weights, v)
    read = read_weights(lam, p, state.position, L)  # [B, H, T, L]
    o += jnp.einsum("bhtl,bhtk,bhlkv->bhtv", read, q * d.start, state.levels)
    E = p[..., -1] + 1
    write = write_slots(p, E, L) * d.end
    s = jnp.einsum("bhtl,bhtk,bhtv->bhlkv", write, k, v)
    s += jnp.einsum(
        "bhsl,bhskv->bhlkv", move(state.position, E, L) * d.total[..., None], state.levels
    )
    return jnp.moveaxis(o, 1, 2), LogLinearState(s, E)

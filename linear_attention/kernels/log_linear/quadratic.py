"""Log-linear attention in its quadratic form, the reference: the hierarchical mask built
exactly.

    O = (Q Kᵀ ⊙ M^S ⊙ M^H) V
    M^S_ij = exp(Σ_{j<u≤i} a_u)  for j ≤ i (0 across a reset, a = −inf; 0 above the diagonal)
    M^H_ij = λ_i^{ℓ(i, j)},      ℓ(i, j) = bit_length((P + i) ⊕ (P + j))

with P the absolute position of the first token (`fenwick`). The [T, T] weights are built
explicitly (memory O(T²)): for testing and short sequences.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.log_linear.fenwick import bit_length, padded_weights
from linear_attention.kernels.primitives.decays import ChunkDecays, pair_decays


def hierarchical_mask(lam_BTHL, position):
    """M^H `[B, H, T, T]`: λ_i at level ℓ(i, j) for j ≤ i, 0 above the diagonal (levels past the
    weights read 0: an overflow, marked by the caller)."""
    T = lam_BTHL.shape[1]
    pos_T = jnp.asarray(position, jnp.int32) + jnp.arange(T, dtype=jnp.int32)
    level_TS = bit_length(pos_T[:, None] ^ pos_T[None, :])
    lam_BTHL1 = padded_weights(lam_BTHL)
    idx_TS = jnp.minimum(level_TS, lam_BTHL1.shape[-1] - 1)
    lam_BHTL = jnp.moveaxis(lam_BTHL1, 2, 1)
    mask_BHTS = jnp.take_along_axis(lam_BHTL, idx_TS[None, None], axis=-1)
    return jnp.where(jnp.tril(jnp.ones((T, T), bool)), mask_BHTS, 0.0)


def log_linear_quadratic(q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL, position):
    """Float32 arrays in (a: `[B, T, H]`, λ: `[B, T, H, L]`), `o [B, T, H, V]` out."""
    d = ChunkDecays(jnp.moveaxis(a_BTH, 1, 2)[..., None])  # the whole sequence as one chunk
    decay_BHTS = pair_decays(d.b[..., 0], d.n[..., 0])
    scores_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BTHK)
    weights_BHTS = scores_BHTS * decay_BHTS * hierarchical_mask(lam_BTHL, position)
    return jnp.einsum("bhts,bshv->bthv", weights_BHTS, v_BTHV)

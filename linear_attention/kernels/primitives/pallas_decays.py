"""Decay factors inside a Pallas kernel (Mosaic-lowerable: 2-D and 3-D elementwise work, row
slices at multiples of the sub-block, iota masks), shared by the kernels of every family.

`decays.SubBlocks` is the XLA form of the same sub-block factorisation: with b the cumulative
log decay inside a chunk and n the resets counted so far ([C, M] each), a decayed score
Σ_m x_tm y_sm exp(b_tm − b_sm) is split around r_i, the last token before query sub-block i
(c = SUB_BLOCK queries): exp(b_t − b_s) = exp(b_t − b_r) · exp(b_r − b_s) for keys s in earlier
sub-blocks (both exponents ≤ 0), and the diagonal block exactly from its [c, c, M] decays. A
factor spanning a reset (n_t ≠ n_s) is masked to 0 before `exp`, so −30 per token is exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.segments import masked_exp

# Queries per sub-block of a decay per key channel (its diagonal blocks cost C·16·M exps).
SUB_BLOCK = 16


def as_column(x_1M):
    """A `[1, M]` row as an `[M, 1]` column (through its diagonal: no transpose in Mosaic)."""
    M = x_1M.shape[-1]
    eye = jax.lax.broadcasted_iota(jnp.int32, (M, M), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (M, M), 1
    )
    return jnp.sum(jnp.where(eye, x_1M, 0.0), axis=1, keepdims=True)


def as_row(x_M1):
    """An `[M, 1]` column as a `[1, M]` row (through its diagonal, as `as_column`)."""
    M = x_M1.shape[0]
    eye = jax.lax.broadcasted_iota(jnp.int32, (M, M), 0) == jax.lax.broadcasted_iota(
        jnp.int32, (M, M), 1
    )
    return jnp.sum(jnp.where(eye, x_M1, 0.0), axis=0, keepdims=True)


def key_sub_blocks(b, n, *, g_query=None, n_query=None, strict: bool = False):
    """The factors of the decayed scores of a chunk `[C, M]` (b, n as above; n may be float32
    counts or integers), per query sub-block i in order: `(rows, q_scale, k_scale, diag)` with

      rows     the sub-block's slice of the chunk's C rows
      q_scale  [c, M]     exp(b_t − b_{r_i}) (None for i = 0: no earlier keys)
      k_scale  [C, M]     exp(b_{r_i} − b_s) for s before the sub-block, else 0 (None for i = 0)
      diag     [c, c, M]  exp(b_t − b_s) for s ≤ t in the sub-block (s < t with `strict`), else 0

    so that the scores of sub-block i are Σ_m x_t y_s diag (its own keys) and
    (x_i ⊙ q_scale)(y ⊙ k_scale)ᵀ (the earlier keys; 0 from s ≥ i·c). With `g_query` and
    `n_query` the query side reads its own cumulative decay in place of b_t (DPLR's decay before
    the token's own, with `strict`: every exponent stays ≤ 0), as `decays.SubBlocks`."""
    C, M = b.shape
    c = SUB_BLOCK
    bq = b if g_query is None else g_query
    nq = n if n_query is None else n_query
    # built in 3-D: Mosaic does not reshape a 2-D mask to [c, c, 1]
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c, M), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c, M), 1)
    tril = (row > col) if strict else (row >= col)
    key_row = jax.lax.broadcasted_iota(jnp.int32, (C, M), 0)
    for i in range(C // c):
        rows = slice(i * c, (i + 1) * c)
        b_i, n_i, bq_i, nq_i = b[rows], n[rows], bq[rows], nq[rows]
        keep = tril & (nq_i[:, None, :] == n_i[None, :, :])
        diag = masked_exp(keep, bq_i[:, None, :] - b_i[None, :, :])
        q_scale = k_scale = None
        if i > 0:
            b_r, n_r = b[i * c - 1 : i * c], n[i * c - 1 : i * c]  # [1, M]
            q_scale = masked_exp(nq_i == n_r, bq_i - b_r)
            k_scale = masked_exp((key_row < i * c) & (n == n_r), b_r - b)
        yield rows, q_scale, k_scale, diag

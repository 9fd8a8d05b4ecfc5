"""The delta rule's chunk terms: the state-independent part of each chunk (the UT transform,
the decayed scores and the decay factors), shared by the XLA chunk form (`delta.py`) and the
Mosaic GPU walk (`pallas_gpu.py`), which take the walk across chunks from them.

With b the cumulative log decay inside a chunk and S the state entering it, the chunk maps S
affinely: U' = U − W S, O = (Q ⊙ e^b) S + P U', S' = e^{b_C} ⊙ S + (K ⊙ e^{b_C − b})ᵀ U'
(`delta.py` derives it). `scalar_terms` makes U, W, P and the factors for a per-head decay (or
none) for every chunk at once, differentiated by autodiff; `per_key_forward` and
`per_key_backward` for a decay per key channel (KDA), by the sub-block scores and a
hand-written pullback.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.primitives.decays import (
    ChunkDecays,
    SubBlocks,
    pair_decays,
)
from linear_attention.kernels.primitives.triangular import invert_unit_lower, unit_lower_solve_vjp


def scalar_terms(q, k, v, beta, a, C):
    """The state-independent part of every chunk for a per-head decay (or none), chunk-major
    `[N, B, H, C, ...]` float32 inputs (a `[N, B, H, C]` or None): `(U, W, P, Q ⊙ e^b,
    K ⊙ e^{b_C − b}, e^{b_C} [N, B, H] or None)`, with [U, W] = (I + A)⁻¹ [diag(β) V,
    diag(β e^b) K] (the UT transform) and P = tril(Q Kᵀ ⊙ Γ); without decay the factors are
    the plain q and k."""
    d = _ScalarDecays(a, C)  # resets masked before exp
    kk_NBHCC = k @ jnp.swapaxes(k, -1, -2)
    a_NBHCC = beta[..., :, None] * kk_NBHCC * d.strict
    beta_k = beta[..., None] * (k if d.start is None else k * d.start[..., None])
    rhs = jnp.concatenate([beta[..., None] * v, beta_k], axis=-1)
    uw = invert_unit_lower(a_NBHCC) @ rhs
    Dv = v.shape[-1]
    p_NBHCC = (q @ jnp.swapaxes(k, -1, -2)) * d.tril
    q_start = q if d.start is None else q * d.start[..., None]
    k_end = k if d.end is None else k * d.end[..., None]
    return uw[..., :Dv], uw[..., Dv:], p_NBHCC, q_start, k_end, d.total


class _ScalarDecays:
    """The per-head decay factors of every chunk, from the log decays a [N, B, H, C] (None: no
    decay), by the shared `ChunkDecays` and `pair_decays`:
      tril   [N,B,H,C,C]  exp(b_t − b_s) for s ≤ t with no reset in (s, t] (0 elsewhere): Γ
      strict              the same for s < t only (the UT transform's A)
      start, end [N,B,H,C] and total [N,B,H]: see `ChunkDecays`
    Without decay, tril/strict are the 0/1 masks and the rest None.
    """

    def __init__(self, a_NBHC, C):
        strict_CC = jnp.tril(jnp.ones((C, C), dtype=bool), -1)
        if a_NBHC is None:
            self.tril = jnp.tril(jnp.ones((C, C), jnp.float32))
            self.strict = strict_CC.astype(jnp.float32)
            self.start = self.end = self.total = None
            return
        d = ChunkDecays(a_NBHC[..., None])  # no gradient across a reset (restarting sums)
        self.tril = pair_decays(d.b[..., 0], d.n[..., 0])
        self.strict = jnp.where(strict_CC, self.tril, 0.0)
        self.start, self.end, self.total = d.start[..., 0], d.end[..., 0], d.total[..., 0]


def per_key_forward(q, k, v, beta, b, n, *, c):
    """The state-independent part of a step's chunks, batched ([G, B, H, C, ...]), as the affine
    map of `affine_chunk_scan`: with U = (I + A)⁻¹ diag(β) V and W = (I + A)⁻¹ diag(β)(K ⊙ e^b),
    U' = U − W S, so X = −W S, X₀ = U, O = (Q ⊙ e^b) S + P (X + U), S' = e^{b_C} S + Eᵀ (X + U)
    with P the decayed scores and E = K ⊙ e^{b_C − b}. Residuals for the backward pass: (I + A)⁻¹,
    U, W, P and the strict scores L (A = diag(β) L), a few [C, C] and [C, K] per chunk."""
    d = ChunkDecays.from_cumulative(b, n)
    sub = SubBlocks(b, n, c)
    l_CC = jnp.tril(sub.scores(k, k), -1)
    inv_CC = invert_unit_lower(beta[..., :, None] * l_CC)
    u_CD = inv_CC @ (beta[..., None] * v)
    w_CK = inv_CC @ (beta[..., None] * k * d.start)
    p_CC = sub.scores(q, k)
    e_CK = k * d.end
    # U is the walk's X₀: P U and Eᵀ U come from its products with X + U
    terms = (-w_CK, u_CD, q * d.start, p_CC, None, e_CK, None, d.total)
    return terms, (inv_CC, u_CD, w_CK, p_CC, l_CC)


def per_key_backward(xs, res, *, c):
    """The hand-written VJP of `per_key_forward` (the affine terms' cotangents to the inputs).

    With Kₛ = K ⊙ e^b, Qₛ = Q ⊙ e^b, E = K ⊙ e^{b_C − b}, g = e^{b_C} and [U W] = (I + A)⁻¹ R,
    R = [diag(β) V, diag(β) Kₛ], A = diag(β) L, the terms are (−W, Qₛ, P, P U, E, Eᵀ U, g). Given
    their cotangents (dW', dQₛ, dP', dO₀, dE', dU₀, dg) from `affine_chunk_scan`:

        dP = dP' + dO₀ Uᵀ,   dU = Pᵀ dO₀ + E dU₀,   dE = dE' + U dU₀ᵀ,   dW = −dW'
        (U is the X₀ of `affine_chunk_scan`, whose walk adds these three terms)
        [dR_u dR_w] = (I + A)⁻ᵀ [dU dW],   dA = −strict_lower(dR_u Uᵀ + dR_w Wᵀ)
        dV = diag(β) dR_u,   dKₛ = diag(β) dR_w,   dL = diag(β) dA
        dβ_t = Σ_s dA_ts L_ts + ⟨dR_u, V⟩_t + ⟨dR_w, Kₛ⟩_t
        dK = dKₛ ⊙ e^b + dE ⊙ e^{b_C − b} + (score terms),   dQ = dQₛ ⊙ e^b + (score terms)
        db_t = dKₛ ⊙ Kₛ + dQₛ ⊙ Qₛ − dE ⊙ E  (+ Σ_t dE ⊙ E + dg ⊙ g at t = C)  + (score terms)

    The score terms come from P = scores(Q, K) and L = strict(scores(K, K)), both sums of
    x_tm y_sm e^{b_tm − b_sm}: `SubBlocks.vjp` gives their q, k and decay cotangents by the same
    sub-block factorisation as the forward pass (every exponent ≤ 0). Each factor e^{…} is a
    masked exp, whose derivative is itself (0 across a reset), so the same lines hold with
    resets. Cost: a few [C, C]·[C, K] matmuls per chunk, as in the forward pass.
    """
    q, k, v, beta, b, n = xs
    inv_CC, u_CD, w_CK, p_CC, l_CC = res
    d = ChunkDecays.from_cumulative(b, n)
    sub = SubBlocks(b, n, c)
    q_start, k_start, e_CK = q * d.start, k * d.start, k * d.end

    def pullback(dw_neg, du, dq_start, dp, do0, de, du0, dg):
        # U is the X₀ of `affine_chunk_scan` (O₀ = P U, U₀ = Eᵀ U): dU, and U's share of dP and
        # dE, come from its walk
        del do0, du0
        dr_CX, da_CC = unit_lower_solve_vjp(
            inv_CC, jnp.concatenate([u_CD, w_CK], -1), jnp.concatenate([du, -dw_neg], -1)
        )
        Dv = v.shape[-1]
        dr_u, dr_w = dr_CX[..., :Dv], dr_CX[..., Dv:]
        dbeta = jnp.sum(da_CC * l_CC, -1) + jnp.sum(dr_u * v, -1) + jnp.sum(dr_w * k_start, -1)
        dv = beta[..., None] * dr_u
        dk_start = beta[..., None] * dr_w
        dq = dq_start * d.start
        dk = dk_start * d.start + de * d.end
        db = dk_start * k_start + dq_start * q_start - de * e_CK
        db_end = jnp.sum(de * e_CK, -2) + dg * d.total
        dq_p, dk_p, dbq_p, dbk_p = sub.vjp(dp, q, k)
        dk_1, dk_2, dbq_l, dbk_l = sub.vjp(beta[..., :, None] * da_CC, k, k)
        dq = dq + dq_p
        dk = dk + dk_p + dk_1 + dk_2
        db = db + dbq_p + dbk_p + dbq_l + dbk_l
        db = db.at[..., -1, :].add(db_end)
        return dq, dk, dv, dbeta, db, None

    return (-w_CK, u_CD, q_start, p_CC, e_CK, d.total), pullback

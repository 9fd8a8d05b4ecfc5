"""MesaNet chunkwise: the training path, with an implicit gradient through the solve.

Notation per head: γ_t = exp(a_t), kb_t = β_t k_t, S_t = H_kk,t, Z_t = H_kv,t, A_t = S_t + Λ,
x_t = A_t⁻¹ q_t, o_t = Z_tᵀ x_t (`recurrent.py` has the recurrence).

Forward. Split time into chunks of C tokens; b_t is the cumulative log decay inside a chunk and
S_n the state entering chunk n. For t in chunk n,

    S_t x = exp(b_t) S_n x + Σ_{j ≤ t in chunk} exp(b_t − b_j) kb_j (k_jᵀ x)

so A_t x for every token at once is two batched matmuls per chunk and no per-token state:
(x · S_nᵀ) scaled by exp(b_t), plus the masked, decayed [C, C] scores (x_t·k_j)·exp(b_t − b_j)
times kb, plus λ ⊙ x. The states S_n are linear attention's chunk states with keys kb and
values k (H_kk is linear attention with v := k): chunk summaries Σ_j exp(b_C − b_j) kb_j k_jᵀ
composed by an associative scan over chunks (`chunk_states`). `cg_steps` conjugate-gradient
iterations (`solve.py`) on these products give every x_t in parallel, all chunks at once. Then
o = Z_tᵀ x_t is unnormalised causal linear attention with queries x, keys kb and values v from
Z₀: the linear family's chunk kernel (`linear.chunked.causal_chunked`), with its own gradient.
Resets (−inf log decays) are reset counts beside finite cumulative sums
(`primitives.decays.ChunkDecays`, `pair_decays`): no (−inf) − (−inf), every factor masked before
`exp`.

Gradient (`solve_chunked`, a `jax.custom_vjp`). Differentiate x = A⁻¹ q implicitly, not through
the CG iterations: δx = A⁻¹(δq − δA x), so for a cotangent dx

    y = A⁻¹ dx            (A symmetric: the adjoint system, solved by the same CG on the chunks)
    dq = y,   dA_t = −y_t x_tᵀ,   dλ = −Σ_t y_t ⊙ x_t

and dA_t = dS_t. Now ⟨dS_t, δS_t⟩ = −y_tᵀ δS_t x_t is the cotangent that the read-out
o'_t = S_tᵀ y_t of linear attention with queries y, keys kb and values k receives from
do'_t = −x_t: so the cotangents of kb, k, the log decays and S₀ are the VJP of that linear
attention (the chunk kernel again, y held constant) at do' = −x, with the final state's
cotangent dS_T added at its end. Stored for the backward pass: the inputs, x and the state
entering each chunk ([K, K] per chunk, never per token); the chunk kernel keeps its own one
state per chunk. The gradient is that of the exact solve at the CG solution, so it matches the
exact solve's as far as CG has converged (`cg_steps` ≥ K is exact in exact arithmetic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.kernels.linear.chunked import causal_chunked
from linear_attention.kernels.mesa_net.solve import conjugate_gradient
from linear_attention.kernels.primitives.decays import ChunkDecays, pair_decays
from linear_attention.kernels.primitives.layout import pad_time


def chunks(x_BT, C: int):
    """`[B, T, H, ...]` -> `[B, H, N, C, ...]`, time padded with zeros to whole chunks."""
    x = pad_time(x_BT, C)
    B, T, H = x.shape[:3]
    return jnp.moveaxis(x.reshape(B, T // C, C, H, *x.shape[3:]), 3, 1)


def unchunks(x_BHNC, T: int):
    """`[B, H, N, C, ...]` -> `[B, T, H, ...]`, cut to the first T tokens."""
    B, H, N, C = x_BHNC.shape[:4]
    return jnp.moveaxis(x_BHNC, 1, 3).reshape(B, N * C, H, *x_BHNC.shape[4:])[:, :T]


def chunk_states(kb_BTHK, w_BTHF, a_BTH, s0_BHKF, C: int):
    """States of Σ decayed kb_j w_jᵀ (w = k: H_kk; w = [k | v]: both statistics) entering every
    chunk `[B, H, N, K, F]`, and the final one `[B, H, K, F]`, from `s0`. Plain JAX
    (differentiable): chunk summaries U_n = Σ_j exp(b_C − b_j) kb_j w_jᵀ composed by
    (g₁, U₁) then (g₂, U₂) = (g₁ + g₂, exp(g₂) U₁ + U₂) in an associative scan."""
    kb, w = chunks(kb_BTHK, C), chunks(w_BTHF, C)
    if a_BTH is None:
        u_BHNKF = jnp.einsum("bhnck,bhncf->bhnkf", kb, w)
        ends_BHNKF = s0_BHKF[:, :, None] + jnp.cumsum(u_BHNKF, axis=2)
    else:
        d = ChunkDecays(chunks(a_BTH[..., None], C))
        g_BHN1 = jnp.where(d.n[..., -1, :] == 0, d.b[..., -1, :], -jnp.inf)  # log of d.total
        u_BHNKF = jnp.einsum("bhnck,bhncf->bhnkf", kb * d.end, w)

        def combine(earlier, later):
            g1, u1 = earlier
            g2, u2 = later
            return g1 + g2, jnp.exp(g2)[..., None] * u1 + u2

        gcum_BHN1, scan_BHNKF = jax.lax.associative_scan(combine, (g_BHN1, u_BHNKF), axis=2)
        ends_BHNKF = jnp.exp(gcum_BHN1)[..., None] * s0_BHKF[:, :, None] + scan_BHNKF
    entering = jnp.concatenate([s0_BHKF[:, :, None], ends_BHNKF[:, :, :-1]], axis=2)
    return entering, ends_BHNKF[:, :, -1]


class ChunkSystem:
    """The matrices A_t = S_t + Λ of every token, held as chunk factors (module docstring):
    `matvec(x [B, H, N, C, K])` is A_t x_t for every token t."""

    def __init__(self, kb_BTHK, k_BTHK, a_BTH, entering_BHNKK, lam_HK, C: int):
        self.kb_BHNCK, self.k_BHNCK = chunks(kb_BTHK, C), chunks(k_BTHK, C)
        self.s_BHNKK = entering_BHNKK
        self.lam_1H11K = lam_HK[None, :, None, None, :]
        if a_BTH is None:
            self.start_BHNC1 = None
            self.pair_BHNCC = jnp.tril(jnp.ones((C, C), jnp.float32))
        else:
            d = ChunkDecays(chunks(a_BTH[..., None], C))
            self.start_BHNC1 = d.start  # exp(b_t), 0 after a reset in the chunk
            self.pair_BHNCC = pair_decays(d.b[..., 0], d.n[..., 0])  # exp(b_t − b_j), j ≤ t

    def matvec(self, x_BHNCK):
        inter = jnp.einsum("bhnck,bhnik->bhnci", x_BHNCK, self.s_BHNKK)  # S_n x_t
        if self.start_BHNC1 is not None:
            inter = inter * self.start_BHNC1
        scores = jnp.einsum("bhnck,bhnsk->bhncs", x_BHNCK, self.k_BHNCK) * self.pair_BHNCC
        intra = jnp.einsum("bhncs,bhnsk->bhnck", scores, self.kb_BHNCK)
        return inter + intra + self.lam_1H11K * x_BHNCK

    def solve(self, b_BTHK, steps: int):
        """A_t⁻¹ b_t for every token by `steps` CG iterations, `[B, T, H, K]`."""
        C = self.k_BHNCK.shape[3]
        x_BHNCK = conjugate_gradient(self.matvec, chunks(b_BTHK, C), steps)
        return unchunks(x_BHNCK, b_BTHK.shape[1])


def mesa_chunked(q_BTHK, kb_BTHK, k_BTHK, v_BTHD, a_BTH, lam_HK, kk0_BHKK, kv0_BHKD, C, steps):
    """MesaNet on float32 arrays (kb = β k), chunkwise: `(o_BTHD, kk_BHKK, kv_BHKD)`."""
    C = min(C, q_BTHK.shape[1])
    x_BTHK, kk_BHKK = solve_chunked(q_BTHK, kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, C, steps)
    o_BTHD, kv_BHKD, _ = causal_chunked(
        x_BTHK, kb_BTHK, v_BTHD, a_BTH, kv0_BHKD, None, chunk_size=C, normalize=False, eps=1.0
    )
    return o_BTHD, kk_BHKK, kv_BHKD


def _solve_forward(q_BTHK, kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, C, steps):
    entering, kk_BHKK = chunk_states(kb_BTHK, k_BTHK, a_BTH, kk0_BHKK, C)
    x_BTHK = ChunkSystem(kb_BTHK, k_BTHK, a_BTH, entering, lam_HK, C).solve(q_BTHK, steps)
    return x_BTHK, kk_BHKK, entering


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def solve_chunked(q_BTHK, kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, C, steps):
    """`(x_BTHK, kk_BHKK)`: x_t ≈ (H_kk,t + Λ)⁻¹ q_t by CG, and the final H_kk; the VJP is the
    implicit one of the module docstring."""
    x_BTHK, kk_BHKK, _ = _solve_forward(q_BTHK, kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, C, steps)
    return x_BTHK, kk_BHKK


def _solve_fwd(q_BTHK, kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, C, steps):
    x_BTHK, kk_BHKK, entering = _solve_forward(
        q_BTHK, kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, C, steps
    )
    # Residuals: the inputs, x, and the state entering each chunk (one per chunk).
    return (x_BTHK, kk_BHKK), (kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, x_BTHK, entering)


def _solve_bwd(C, steps, residuals, cotangents):
    kb_BTHK, k_BTHK, a_BTH, lam_HK, kk0_BHKK, x_BTHK, entering = residuals
    dx_BTHK, dkk_BHKK = cotangents
    system = ChunkSystem(kb_BTHK, k_BTHK, a_BTH, entering, lam_HK, C)
    y_BTHK = system.solve(dx_BTHK, steps)  # the adjoint system A y = dx (A symmetric)
    dlam_HK = -jnp.einsum("bthk,bthk->hk", y_BTHK, x_BTHK)

    def read_out(kb, k, a, kk0):  # o'_t = S_tᵀ y_t, y constant: dS_t = y_t do'_tᵀ
        o, kk, _ = causal_chunked(
            y_BTHK, kb, k, a, kk0, None, chunk_size=C, normalize=False, eps=1.0
        )
        return o, kk

    _, pullback = jax.vjp(read_out, kb_BTHK, k_BTHK, a_BTH, kk0_BHKK)
    dkb, dk, da, dkk0 = pullback((-x_BTHK, dkk_BHKK))
    return y_BTHK, dkb, dk, da, dlam_HK, dkk0


solve_chunked.defvjp(_solve_fwd, _solve_bwd)

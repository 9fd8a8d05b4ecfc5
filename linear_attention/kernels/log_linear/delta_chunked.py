"""Log-linear Gated DeltaNet chunkwise: the WY form of `delta/delta.py` with the Fenwick level
states of `chunked.py`.

Inside a chunk of C tokens, with b the cumulative log decay, Γ_ts = exp(b_t − b_s) (s ≤ t, no
reset between), A = strict_lower(diag(β) K Kᵀ ⊙ Γ) and T = (I + A)⁻¹ (the UT transform,
`primitives.invert_unit_lower`), the delta rule from an entering state S gives (see
`delta/delta.py`)

    O  = (Q ⊙ e^b) S + tril(Q Kᵀ ⊙ Γ) (U − W S),   U = T diag(β) V,   W = T diag(β e^b) K
    S' = e^{b_C} S + (K ⊙ e^{b_C − b})ᵀ (U − W S)

Everything is linear in (S, V), so the output splits into what each value and what the state
contributes, and the log-linear form weights each part by its level:

- value j's weight in o_i is the [C, C] matrix A_eff = tril(Q Kᵀ ⊙ Γ) T diag(β); the levels
  inside the chunk weight it elementwise: O_intra = (A_eff ⊙ M^H) V, M^H_ij = λ_i^{|p_i ⊕ p_j|};
- a level state S^s entering the chunk is read through the chunk's transitions by the effective
  queries Q̃ = Q ⊙ e^b − tril(Q Kᵀ ⊙ Γ) W, with the weights of `fenwick.read_weights`;
- every level state crosses the chunk by the same map P = e^{b_C} I − K̂ᵀ W (K̂ = K ⊙ e^{b_C − b})
  and then moves slot (`fenwick.move`); token j enters the state at the chunk's end as g_j v_jᵀ,
  g_j the j-th column of G = K̂ᵀ T diag(β), in slot |E ⊕ p_j| − 1 (`fenwick.write_slots`).

A_eff, Q̃, P and G depend only on the chunk's own tokens: formed for all chunks at once. The
walk across chunks is a `lax.scan` of S ← move(P S) + U_n over the L level states. The gradient
is autodiff: it keeps the L level states entering each chunk and the per-chunk P, U_n (no state
per token). Work per token and head: O(C·(K + V) + C²) for the UT transform and the intra part,
2·L·K·V to read the states and 2·L·K·V to write, and 2·L·K²·V/C for the level maps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.log_linear.fenwick import (
    LogLinearState,
    bit_length,
    move,
    padded_weights,
    read_weights,
    write_slots,
)
from linear_attention.kernels.primitives.decays import ChunkDecays, pair_decays
from linear_attention.kernels.primitives.layout import from_chunks, pad_time, to_chunks
from linear_attention.kernels.primitives.triangular import invert_unit_lower


def delta_chunked(q_BTHK, k_BTHK, v_BTHV, beta_BTH, a_BTH, lam_BTHL, p_BTH, state, chunk_size):
    """Float32 arrays in (β, a `[B, T, H]`, λ `[B, T, H, L]`, positions p `[B, T, H]`, the
    entering `LogLinearState`), `(o [B, T, H, V], final LogLinearState)` out."""
    T, L = q_BTHK.shape[1], lam_BTHL.shape[-1]
    C = min(chunk_size, T)
    # padding tokens: zero β, keys, values and log decay leave every state alone; they repeat
    # the last position so that the last chunk's state lands after the last token
    q, k, v, beta, a, lam = (
        to_chunks(pad_time(x, C), C) for x in (q_BTHK, k_BTHK, v_BTHV, beta_BTH, a_BTH, lam_BTHL)
    )
    p = to_chunks(jnp.pad(p_BTH, ((0, 0), (0, -T % C), (0, 0)), mode="edge"), C)
    d = ChunkDecays(a[..., None])
    start, end, total = d.start[..., 0], d.end[..., 0], d.total[..., 0]
    gamma = pair_decays(d.b[..., 0], d.n[..., 0])  # Γ, [N, B, H, C, C]
    strict = jnp.tril(jnp.ones((C, C), bool), -1)

    # ---- the UT transform and the chunk's own maps ----
    kk = jnp.einsum("nbhik,nbhjk->nbhij", k, k)
    t_inv = invert_unit_lower(jnp.where(strict, beta[..., :, None] * kk * gamma, 0.0))
    w = t_inv @ ((beta * start)[..., None] * k)  # W [N, B, H, C, K]
    qk = jnp.einsum("nbhik,nbhjk->nbhij", q, k) * gamma  # tril(Q Kᵀ ⊙ Γ)
    a_eff = (qk @ t_inv) * beta[..., None, :]  # value j's weight in o_i
    q_eff = q * start[..., None] - qk @ w  # Q̃
    k_end = k * end[..., None]  # K̂
    eye = jnp.eye(k.shape[-1], dtype=jnp.float32)
    transition = total[..., None, None] * eye - jnp.swapaxes(k_end, -1, -2) @ w  # P [.., K, K]
    g = jnp.swapaxes(k_end, -1, -2) @ t_inv * beta[..., None, :]  # G [N, B, H, K, C]

    # ---- intra-chunk: A_eff weighted by the levels |p_i ⊕ p_j| ----
    level_CC = bit_length(p[..., :, None] ^ p[..., None, :])
    lam_CC = jnp.take_along_axis(padded_weights(lam), jnp.minimum(level_CC, L), axis=-1)
    o = jnp.einsum("nbhij,nbhjv->nbhiv", a_eff * lam_CC, v)

    # ---- inter-chunk: the level states entering every chunk ----
    E_NBH = p[..., -1] + 1
    P_NBH = jnp.concatenate([state.position[None], E_NBH[:-1]], axis=0)
    u = jnp.einsum("nbhcl,nbhkc,nbhcv->nbhlkv", write_slots(p, E_NBH, L), g, v)
    moves = move(P_NBH, E_NBH, L)

    def walk(s_BHLKV, xs):
        move_BHLL, transition_BHKK, u_BHLKV = xs
        crossed = jnp.einsum("bhkj,bhsjv->bhskv", transition_BHKK, s_BHLKV)
        return jnp.einsum("bhsl,bhskv->bhlkv", move_BHLL, crossed) + u_BHLKV, s_BHLKV

    s_BHLKV, entering = jax.lax.scan(walk, state.levels, (moves, transition, u))
    read = read_weights(lam, p, P_NBH, L)
    o += jnp.einsum("nbhcl,nbhck,nbhlkv->nbhcv", read, q_eff, entering)
    return from_chunks(o, T), LogLinearState(s_BHLKV, E_NBH[-1])

"""Log-linear attention chunkwise: the training path.

Split time into chunks of C tokens. With p the Fenwick positions (`fenwick`: restarting at
every reset), b the cumulative log decay inside a chunk and S_n the level states entering
chunk n (relative to the position P_n of its first token, decayed to it), the output of a
query i of the chunk is

    o_i = Σ_{j ≤ i in chunk} λ_i^{|p_i ⊕ p_j|} exp(b_i − b_j) (q_i·k_j) v_j           (intra)
        + Σ_s λ_i^{max(s + 1, |p_i ⊕ P_n|)} exp(b_i) q_iᵀ S_n^s                       (inter)

(|x|: bit length; the factors exp(·) are 0 across a reset, so a query of a sequence that
starts inside the chunk reads nothing of S_n). The intra part is the quadratic form inside the
chunk, (Q Kᵀ ⊙ M^S ⊙ M^H) V with M^H gathered from the [C, C] levels |p_i ⊕ p_j|. The inter part
holds because the keys of P's level ℓ all sit at one level of any later query,
max(ℓ, |p_i ⊕ P|) (`fenwick.read_weights`). The same fact moves the states from chunk to chunk,
with E_n = P_{n+1} the position after the chunk and g its total log decay:

    S_{n+1} = exp(g) · move(P_n → E_n) S_n + U_n
    U_n^s   = Σ_{j: |E_n ⊕ p_j| = s + 1} exp(g − b_j) k_j v_jᵀ

(`fenwick.move`, `fenwick.write_slots`). No chunk needs to align with the levels, so any C
works, a start at any position (an initial state) included, and packed documents restart their
positions where they start.

Only this walk is sequential: the U_n and the [L, L] moves are formed for all chunks at once,
a `lax.scan` applies them (one [L, L] map of the states per chunk: L·L·K·V), and the reads are
one batched einsum over all chunks. Work per token and head: 2·C·(K + V) (intra), 2·L·K·V to
read the L states and 2·L·K·V to write the chunk's keys into their slots, L = O(log T).

The gradient is JAX's autodiff of these steps: the forward pass keeps the L level states
entering every chunk ([N, B, H, L, K, V], read by the einsum's backward) and the chunk updates
U_n (the same size): a set of level states per chunk, none per token.
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


def log_linear_chunked(q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL, p_BTH, state, chunk_size: int):
    """Float32 arrays in (a `[B, T, H]`, λ `[B, T, H, L]`, Fenwick positions p `[B, T, H]`
    int32, the entering `LogLinearState`), `(o [B, T, H, V], final LogLinearState)` out."""
    T, L = q_BTHK.shape[1], lam_BTHL.shape[-1]
    C = min(chunk_size, T)
    # padding tokens change nothing (zero keys and values, zero log decay) and repeat the last
    # position, so that the last chunk's state lands at the position after the last token
    q, k, v, a, lam = (
        to_chunks(pad_time(x, C), C) for x in (q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL)
    )
    pad = -T % C
    p = to_chunks(jnp.pad(p_BTH, ((0, 0), (0, pad), (0, 0)), mode="edge"), C)  # [N, B, H, C]
    d = ChunkDecays(a[..., None])

    # ---- intra-chunk: the quadratic form, levels |p_i ⊕ p_j| ----
    level_CC = bit_length(p[..., :, None] ^ p[..., None, :])
    lam_CC = jnp.take_along_axis(
        padded_weights(lam), jnp.minimum(level_CC, L), axis=-1
    )  # [N, B, H, C, C]: λ_i at level(i, j)
    scores = jnp.einsum("nbhik,nbhjk->nbhij", q, k)
    weights = scores * pair_decays(d.b[..., 0], d.n[..., 0]) * lam_CC
    o = jnp.einsum("nbhij,nbhjv->nbhiv", weights, v)

    # ---- inter-chunk: the level states entering every chunk ----
    E_NBH = p[..., -1] + 1  # the position after each chunk
    P_NBH = jnp.concatenate([state.position[None], E_NBH[:-1]], axis=0)
    write = write_slots(p, E_NBH, L) * d.end  # [N, B, H, C, L]
    u_NBHLKV = jnp.einsum("nbhcl,nbhck,nbhcv->nbhlkv", write, k, v)
    moves = move(P_NBH, E_NBH, L) * d.total[..., None]  # [N, B, H, L, L]

    def walk(s_BHLKV, xs):
        move_BHLL, u_BHLKV = xs
        return jnp.einsum("bhsl,bhskv->bhlkv", move_BHLL, s_BHLKV) + u_BHLKV, s_BHLKV

    s_BHLKV, entering = jax.lax.scan(walk, state.levels, (moves, u_NBHLKV))
    read = read_weights(lam, p, P_NBH, L)  # [N, B, H, C, L]
    o += jnp.einsum("nbhcl,nbhck,nbhlkv->nbhcv", read, q * d.start, entering)
    return from_chunks(o, T), LogLinearState(s_BHLKV, E_NBH[-1])

"""Log-linear attention chunkwise: the training path.

Chunks of C = 2^c tokens are aligned to absolute positions (chunk n holds positions nC..nC + C −
1), so that the Fenwick levels (`fenwick`: ℓ(i, j) = bit_length(i ⊕ j)) split in two:

- i and j in one chunk: i ⊕ j < C, so ℓ(i, j) ≤ c and depends only on i, j mod C: a fixed
  [C, C] level table. The levels 0..c are a masked quadratic inside the chunk,

      O_intra = (Q Kᵀ ⊙ M^S ⊙ Λ) V,    Λ_ij = λ_i^{table[i mod C, j mod C]};

- j in an earlier chunk m < n: i ⊕ j = ((n ⊕ m) << c) + (low bits), so ℓ(i, j) = c +
  bit_length(n ⊕ m): the level is the chunk-level Fenwick level of (n, m) shifted by c. The keys
  of earlier chunks are thus held in chunk-level Fenwick states, one per level c + 1 .. L
  (level L only at the capacity), entering chunk n decayed to its start:

      O_inter,i = Σ_{ℓ'≥1} λ_i^{c+ℓ'} exp(b_i) q_iᵀ S_n^{ℓ'}      (b_i: log decay within the chunk)

  and they are carried across chunks by the same recurrence as the token step, one chunk at a
  time: decay every level by the chunk's total exp(g), add the chunk's own keys
  u_n = Σ_s exp(g − b_s) k_s v_sᵀ, and merge levels 1..r with u_n into level r + 1, r the
  trailing ones of n (`fenwick.merge`).

The scan over chunks only decays and merges (no matmul); it returns the level states entering
every chunk, and the reads are one batched einsum over all chunks. A start at an absolute
position P that is not a multiple of C is laid out with P mod C empty slots before the first
token (zero keys and values, zero log decay: they change nothing), and chunk indices start at
⌊P/C⌋. Work per token and head: 2·C·(K + V) for the intra part, 2·(L − c)·K·V for the reads
of the L − c chunk-level states (O(log(T/C)) of them) and 2·K·V for the chunk updates.

The gradient is JAX's autodiff: the forward pass keeps one set of chunk-level states per chunk
([N, B, H, L − c, K, V], read by the einsum's backward) and the per-chunk updates u_n (one
[K, V] state per chunk); no state is kept per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.kernels.checks import concrete
from linear_attention.kernels.log_linear.fenwick import level_table, merge, padded_weights
from linear_attention.kernels.primitives.decays import ChunkDecays, pair_decays
from linear_attention.kernels.primitives.layout import from_chunks, to_chunks


def log_linear_chunked(q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL, position, chunk_size: int):
    """Float32 arrays in (a `[B, T, H]`, λ `[B, T, H, L]`; `position` the first token's absolute
    position, an int or a traced int32 scalar; `chunk_size` a power of two at most 2^(L−1)),
    `o [B, T, H, V]` out. Initial and final states are added by the caller (`fenwick`)."""
    B, T, H, _ = q_BTHK.shape
    L = lam_BTHL.shape[-1]
    C = chunk_size
    c = C.bit_length() - 1
    p_static = concrete(position)
    # the first token's slot in its chunk, and the room the layout needs
    if p_static is not None:
        offset, first_chunk = int(p_static) % C, int(p_static) // C
        room = offset + T
    else:
        p = jnp.asarray(position, jnp.int32)
        offset, first_chunk = p % C, p // C
        room = T + C - 1
    N = -(-room // C)

    def lay_out(x):  # [B, T, ...] -> [N, B, H, C, ...], the tokens at their slots
        buf = jnp.zeros((B, N * C, *x.shape[2:]), jnp.float32)
        start = (0, offset) + (0,) * (x.ndim - 2)
        return to_chunks(jax.lax.dynamic_update_slice(buf, x, start), C)

    q, k, v, a, lam = (lay_out(x) for x in (q_BTHK, k_BTHK, v_BTHV, a_BTH, lam_BTHL))
    d = ChunkDecays(a[..., None])  # b, n, start, end [N, B, H, C, 1]; total [N, B, H, 1]

    # ---- intra-chunk: levels 0..c, a masked quadratic per chunk ----
    table_CC = level_table(C)
    onehot_CCl = (table_CC[..., None] == np.arange(c + 1)).astype(np.float32)
    lam_CC = jnp.einsum("nbhil,ijl->nbhij", lam[..., : c + 1], onehot_CCl)
    scores = jnp.einsum("nbhik,nbhjk->nbhij", q, k)
    o = jnp.einsum("nbhij,nbhjv->nbhiv", scores * pair_decays(d.b[..., 0], d.n[..., 0]) * lam_CC, v)

    # ---- inter-chunk: the chunk-level Fenwick states (levels c + 1 .. L) ----
    u_NBHKV = jnp.einsum("nbhck,nbhcv->nbhkv", k * d.end, v)
    total_NBH = d.total[..., 0]
    Lc = L - c
    s0 = jnp.zeros((B, H, Lc, *u_NBHKV.shape[-2:]), jnp.float32)

    def walk(s_BHLKV, xs):
        u_BHKV, total_BH, n = xs
        s_next = merge(total_BH[..., None, None, None] * s_BHLKV, u_BHKV, first_chunk + n)
        return s_next, s_BHLKV

    chunks = jnp.arange(N, dtype=jnp.int32)
    _, entering_NBHLKV = jax.lax.scan(walk, s0, (u_NBHKV, total_NBH, chunks))
    lam_hi = padded_weights(lam)[..., c + 1 :]  # [N, B, H, C, Lc]
    o += jnp.einsum("nbhcl,nbhck,nbhlkv->nbhcv", lam_hi, q * d.start, entering_NBHLKV)

    o_BTHV = from_chunks(o, N * C)
    return jax.lax.dynamic_slice_in_dim(o_BTHV, offset, T, axis=1)

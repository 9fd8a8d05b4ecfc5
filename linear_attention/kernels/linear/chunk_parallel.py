"""Chunkwise-parallel causal linear attention: every chunk at once, shaped for accelerators.

The same chunk algebra as `chunked.py`, with no sequential walk. Split time into N chunks of C
tokens. With b_t the cumulative log decay inside a chunk and g = b_C its total, a chunk maps the
state entering it, S, to

    o_t  = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s) v_s  +  exp(b_t) q_tᵀ S
    S'   = exp(g) S + U,      U = Σ_{s in chunk} exp(g − b_s) k_s v_sᵀ

(for a decay per key dimension, [B,T,H,M], b and g are vectors over m and every exp(·) is taken
per m, multiplying the m-th component of q or the m-th row of S). The chunk summaries (g, U)
compose associatively, (g₁, U₁) then (g₂, U₂) = (g₁ + g₂, exp(g₂) U₁ + U₂), so the states entering
all chunks come out of one `lax.associative_scan` of parallel depth log N. The stages are all
batched over chunks:

  1. chunk and decay weights (per token, O(T) memory);
  2. chunk summaries U, one batched matmul;
  3. states entering every chunk: associative scan over (g, U);
  4. outputs: intra-chunk C×C scores and the entering states read by the decayed queries, two
     batched matmuls.

Resets. A log decay of −inf (a gate of exactly 0: a document boundary) must cut the sum, and
b_t − b_s would be −inf − (−inf) = NaN. So the cumulative sum is taken over the finite part only,
restarting at every reset (so no gradient reaches a decay before one, not even as rounding), and
the −inf tokens are counted: r_t = #{−inf at or before t in the chunk}
(`segments.cumulative_log_decay`). A weight
exp(b_t − b_s) is kept only where r_t = r_s (no reset in (s, t]), masked to −inf before `exp`;
never split into exp(b_t)·exp(−b_s), which overflows for strong decays (−30 per token).

Gradient. Plain autodiff, memory-lean by `jax.checkpoint` around stage 4: its residuals are its
inputs, per-token vectors and one state per chunk ([N, M, Dv], never one per token); the C×C
scores and decay weights are recomputed in the backward pass. The associative scan keeps about
2N chunk states. For a decay per key dimension the scores Σ_m q_tm k_sm exp(b_tm − b_sm) are
no single matmul: they are taken in sub-blocks of c ≤ 16 tokens (`primitives.decays.SubBlocks`, the
factorisation `chunk` uses), so the decay weights are [C/c, C, M] + [C/c, c, c, M] per chunk,
O(T·(C/c + c)·M), not the O(T·C·M) of a full [C, C, M] decay (at C = 64: 20 instead of 64
weights per token and key dimension).

The normaliser is not special here: the dispatcher appends a value column of ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.primitives.decays import (
    ChunkDecays,
    SubBlocks,
    pair_decays,
    sub_block_size,
)
from linear_attention.kernels.primitives.layout import pad_time


def causal_chunk_parallel(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD, *, chunk_size: int):
    """Unnormalised causal linear attention, all chunks at once: `(o_BTHD, s_BHMD)`, float32.

    `a_BTH` is the log decay, ≤ 0, possibly −inf: None, `[B, T, H]` (one per head) or
    `[B, T, H, M]` (one per key dimension). `s0_BHMD` is the state before token 0.
    """
    B, T, H, M = q_BTHM.shape
    C = min(chunk_size, T)

    # ---- 1. chunks [B, H, N, C, ·] (time padded with zero keys, values and log decays) ----
    N = -(-T // C)

    def chunks(x):
        return jnp.moveaxis(pad_time(x, C).reshape(B, N, C, H, -1), 3, 1)

    q, k, v = chunks(q_BTHM), chunks(k_BTHM), chunks(v_BTHD)
    if a_BTH is None:  # no decay: every weight below is 1
        b = r = start_BHNCK = None
        u_BHNMD = jnp.einsum("bhncm,bhncd->bhnmd", k, v)
        scan_BHNMD = jnp.cumsum(u_BHNMD, axis=2)
        ends_BHNMD = s0_BHMD[:, :, None] + scan_BHNMD
    else:
        a_BHNCK = chunks(a_BTH if a_BTH.ndim == 4 else a_BTH[..., None])  # K: 1 or M
        d = ChunkDecays(a_BHNCK)  # restarting sums: no gradient across a reset
        b, r = d.b, d.n
        # exp(b_t), the entering state's weight on q_t; exp(g − b_s), k_s's weight in U.
        start_BHNCK, end_BHNCK = d.start, d.end
        g_BHNK = jnp.where(r[..., -1, :] == 0, b[..., -1, :], -jnp.inf)  # log of d.total

        # ---- 2. chunk summaries: U = Σ_s exp(g − b_s) k_s v_sᵀ ----
        u_BHNMD = jnp.einsum("bhncm,bhncd->bhnmd", k * end_BHNCK, v)

        # ---- 3. states: inclusive scan of (g, U), then add S₀ and shift by one chunk ----
        def combine(earlier, later):
            g1, u1 = earlier
            g2, u2 = later
            return g1 + g2, jnp.exp(g2)[..., None] * u1 + u2

        gcum_BHNK, scan_BHNMD = jax.lax.associative_scan(combine, (g_BHNK, u_BHNMD), axis=2)
        ends_BHNMD = jnp.exp(gcum_BHNK)[..., None] * s0_BHMD[:, :, None] + scan_BHNMD
    entering_BHNMD = jnp.concatenate([s0_BHMD[:, :, None], ends_BHNMD[:, :, :-1]], axis=2)

    # ---- 4. outputs, recomputed in the backward pass ----
    o_BHNCD = jax.checkpoint(_outputs)(q, k, v, b, r, start_BHNCK, entering_BHNMD)
    o_BTHD = jnp.moveaxis(o_BHNCD, 1, 3).reshape(B, N * C, H, -1)[:, :T]
    return o_BTHD, ends_BHNMD[:, :, -1]


def _outputs(q, k, v, b, r, start_BHNCK, entering_BHNMD):
    """o_t = Σ_{s ≤ t} exp(b_t − b_s)(q_t·k_s) v_s + (exp(b_t) ⊙ q_t)ᵀ S_entering, every chunk."""
    C = q.shape[-2]
    causal_CC = jnp.tril(jnp.ones((C, C), bool))
    if b is None:
        scores_BHNCC = jnp.where(causal_CC, jnp.einsum("bhncm,bhnsm->bhncs", q, k), 0.0)
    elif b.shape[-1] == 1:  # one decay per head: exp(b_t − b_s) scales the C×C scores
        decay_BHNCC = pair_decays(b[..., 0], r[..., 0])
        scores_BHNCC = jnp.einsum("bhncm,bhnsm->bhncs", q, k) * decay_BHNCC
    else:  # one decay per key dimension: it weights each term of q_t·k_s (see the docstring)
        scores_BHNCC = SubBlocks(b, r, sub_block_size(C)).scores(q, k)
    if b is not None:
        q = q * start_BHNCK
    return jnp.einsum("bhncs,bhnsd->bhncd", scores_BHNCC, v) + jnp.einsum(
        "bhncm,bhnmd->bhncd", q, entering_BHNMD
    )

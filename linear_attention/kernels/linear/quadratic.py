"""Causal linear attention in its masked O(T²) form: the reference every other method matches.

With B_t = Σ_{s≤t} a_s the cumulative log decay (per head, or per key dimension m for a vector
decay: then every exp(·) below is taken per m inside the q·k sum),

    o_t = Σ_{s≤t} Σ_m q_tm k_sm exp(B_tm − B_sm) v_s + (q_t ⊙ exp(B_t))ᵀ S_0
    S_T = diag(exp(B_T)) S_0 + Σ_s (k_s ⊙ exp(B_T − B_s)) v_sᵀ

A log decay of −inf is a reset: B is kept finite by counting resets (`primitives.decays`:
the whole sequence as one chunk) and every exp(B_t − B_s) spanning a reset is exactly 0. The
T×T (×M for a vector decay) weights are built explicitly, so memory is O(T²): use it for
testing and short sequences.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.primitives.decays import ChunkDecays, pair_decays


def causal_quadratic(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD):
    """Unnormalised causal linear attention; float32 arrays in, `(o_BTHD, s_BHMD)` out.

    `a_BTH` is the log decay per token, `[B, T, H]` or `[B, T, H, M]` (None: no decay);
    `s0_BHMD` the state before token 0.
    """
    T = q_BTHM.shape[1]
    if a_BTH is None:
        causal_TS = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores_BHTS = jnp.einsum("bthm,bshm->bhts", q_BTHM, k_BTHM)
        weights_BHTS = jnp.where(causal_TS, scores_BHTS, 0.0)
        o_BTHD = jnp.einsum("bhts,bshd->bthd", weights_BHTS, v_BTHD)
        o_BTHD += jnp.einsum("bthm,bhmd->bthd", q_BTHM, s0_BHMD)
        s_BHMD = s0_BHMD + jnp.einsum("bshm,bshd->bhmd", k_BTHM, v_BTHD)
        return o_BTHD, s_BHMD
    # [B, H, T, X] with X = 1 (a decay per head) or M (per key dimension)
    a_BHTX = jnp.moveaxis(a_BTH if a_BTH.ndim == 4 else a_BTH[..., None], 1, 2)
    d = ChunkDecays(a_BHTX)  # the whole sequence as one chunk
    b_BHTX, n_BHTX = d.b, d.n
    # Masked before exp: above the diagonal B_t − B_s is positive and exp could overflow.
    if a_BHTX.shape[-1] == 1:
        scores_BHTS = jnp.einsum("bthm,bshm->bhts", q_BTHM, k_BTHM)
        weights_BHTS = scores_BHTS * pair_decays(b_BHTX[..., 0], n_BHTX[..., 0])
    else:
        b_BHMT, n_BHMT = (jnp.swapaxes(x, 2, 3) for x in (b_BHTX, n_BHTX))
        decay_BHMTS = pair_decays(b_BHMT, n_BHMT)
        weights_BHTS = jnp.einsum("bthm,bshm,bhmts->bhts", q_BTHM, k_BTHM, decay_BHMTS)
    o_BTHD = jnp.einsum("bhts,bshd->bthd", weights_BHTS, v_BTHD)
    start_BTHX = jnp.moveaxis(d.start, 1, 2)
    o_BTHD += jnp.einsum("bthm,bhmd->bthd", q_BTHM * start_BTHX, s0_BHMD)
    end_BTHX = jnp.moveaxis(d.end, 1, 2)
    total_BHX1 = d.total[..., None]
    s_BHMD = total_BHX1 * s0_BHMD + jnp.einsum("bshm,bshd->bhmd", k_BTHM * end_BTHX, v_BTHD)
    return o_BTHD, s_BHMD

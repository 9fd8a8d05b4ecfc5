"""Decay factors of a chunk, shared by every chunkwise kernel: reset-aware cumulative log decays
turned into the weights of the chunk algebra, for a decay per head (a trailing axis X = 1) or
per key channel (X = K), and the sub-block factorisation of per-key decayed scores.

All of them start from `segments.cumulative_log_decay`: b = the cumulative log decay inside the
chunk (restarting at resets), n = the resets counted so far; exp(b_t − b_s) is kept only where
n_t = n_s and is masked before exp, so every factor has an exponent ≤ 0 (underflow to 0, never
overflow: −30 per token is exact) and no (−inf) − (−inf) arises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.segments import cumulative_log_decay, masked_exp

# Sub-block of the intra-chunk scores for a decay per key dimension (see `SubBlocks`).
SUB_BLOCK = 16


def pair_decays(b, n, *, strict: bool = False):
    """`[.., C, C]` exp(b_t − b_s) for s ≤ t (s < t with `strict`) with no reset in (s, t], else 0,
    from the cumulative log decay b and reset count n `[.., C]` of a decay per head."""
    C = b.shape[-1]
    mask_CC = jnp.tril(jnp.ones((C, C), dtype=bool), -1 if strict else 0)
    keep = mask_CC & (n[..., :, None] == n[..., None, :])
    return masked_exp(keep, b[..., :, None] - b[..., None, :])


class ChunkDecays:
    """Decay factors of one chunk for a log decay a [.., C, X] (X = 1: per head; X = K: per key
    channel; −inf: a reset).

    b = cumulative log decay inside the chunk (restarting at resets), n = resets counted up to t
    (`segments.cumulative_log_decay`); a factor exp(b_t − b_s) is kept only where n_t = n_s and
    is masked before exp, so −30 per token is exact (factors underflow to 0, never overflow):
      b, n  [.., C, X]  the cumulative log decay and reset count (`SubBlocks` and `pair_decays`)
      start [.., C, X]  exp(b_t) where no reset up to t: the entering state's weight on row t
      end   [.., C, X]  exp(b_C − b_s) where no reset after s: token s's weight in the leaving state
      total [.., X]     exp(b_C) where no reset in the chunk: the entering state's weight in it
    With `exclusive`, also the decay before each token's own (b_{t−1}, n_{t−1}) and its `start`:
      b_prev, n_prev, start_prev [.., C, X]   (for transitions that read the undecayed state)
    """

    def __init__(self, a, *, exclusive: bool = False):
        self._build(*cumulative_log_decay(a, axis=-2, restart=True), exclusive)

    @classmethod
    def from_cumulative(cls, b, n, *, exclusive: bool = False):
        """The factors from b and n already summed (`cumulative_log_decay(a, axis=-2,
        restart=True)`): a hand-written VJP differentiates with respect to b and leaves the sum
        to autodiff."""
        self = cls.__new__(cls)
        self._build(b, n, exclusive)
        return self

    def _build(self, b, n, exclusive):
        self.b, self.n = b, n
        b_end, n_end = b[..., -1:, :], n[..., -1:, :]
        self.start = masked_exp(n == 0, b)
        self.end = masked_exp(n == n_end, b_end - b)
        self.total = masked_exp(n_end[..., 0, :] == 0, b_end[..., 0, :])
        if exclusive:
            self.b_prev = jnp.concatenate([jnp.zeros_like(b[..., :1, :]), b[..., :-1, :]], -2)
            self.n_prev = jnp.concatenate([jnp.zeros_like(n[..., :1, :]), n[..., :-1, :]], -2)
            self.start_prev = masked_exp(self.n_prev == 0, self.b_prev)


def sub_block_size(C):
    """The largest divisor of C that is at most SUB_BLOCK."""
    return max(c for c in range(1, min(SUB_BLOCK, C) + 1) if C % c == 0)


class SubBlocks:
    """Exact intra-chunk scores Σ_m q_tm k_sm exp(b_tm − b_sm) for a decay per key dimension.

    The exponent depends on m, so the scores are no matmul of decayed q and k unless split:
    exp(b_t − b_s) = exp(b_t − b_r) · exp(b_r − b_s) around a point r between them, and each
    factor must have an exponent ≤ 0 (exp(b_t)·exp(−b_s) overflows for strong decays). The chunk
    is cut into P sub-blocks of c tokens; with r_i the token before sub-block i,
      off-diagonal (s in an earlier sub-block than t, in sub-block i):
          (q_t ⊙ exp(b_t − b_{r_i})) · (k_s ⊙ exp(b_{r_i} − b_s))     one [c, C] matmul per i
      diagonal (s, t in the same sub-block): the masked [c, c, M] decays, exactly.
    Cost O(C²·M + C·c·M) per chunk. Factors spanning a reset are 0 (see `_Decays`).
      q_scale [.., P, c, M]     exp(b_t − b_{r_i})
      k_scale [.., P, C, M]     exp(b_{r_i} − b_s) for s before sub-block i, else 0
      diag    [.., P, c, c, M]  exp(b_t − b_s) for s ≤ t in one sub-block, else 0
    With `b_query`/`n_query` the query side reads its own cumulative decay (every exponent must
    still be ≤ 0: b_query_t ≥ b_{r_i} and ≥ b_s for the kept pairs), and with `strict` the pairs
    s < t only: DPLR's scores Σ_m a_tm k_sm exp(b_{t−1,m} − b_sm).
    """

    def __init__(self, b, n, c, *, b_query=None, n_query=None, strict=False):
        *lead, C, M = b.shape
        P = C // c
        self.P, self.c = P, c
        b_sub, n_sub = b.reshape(*lead, P, c, M), n.reshape(*lead, P, c, M)
        # The query side may read its own cumulative decay (DPLR reads the state before the
        # token's decay: b_query_t = b_{t−1}, with `strict` pairs s < t only); the key side is b.
        bq_sub = b_sub if b_query is None else b_query.reshape(*lead, P, c, M)
        nq_sub = n_sub if n_query is None else n_query.reshape(*lead, P, c, M)
        # r_i: the last token of sub-block i − 1 (sub-block 0 reads no earlier key)
        b_r = jnp.concatenate([jnp.zeros_like(b_sub[..., :1, -1, :]), b_sub[..., :-1, -1, :]], -2)
        n_r = jnp.concatenate([jnp.zeros_like(n_sub[..., :1, -1, :]), n_sub[..., :-1, -1, :]], -2)
        self.q_scale = masked_exp(nq_sub == n_r[..., None, :], bq_sub - b_r[..., None, :])
        before_PC = jnp.arange(C)[None, :] < (jnp.arange(P) * c)[:, None]
        keep = before_PC[:, :, None] & (n_r[..., :, None, :] == n[..., None, :, :])
        self.k_scale = masked_exp(keep, b_r[..., :, None, :] - b[..., None, :, :])
        tril_cc = jnp.tril(jnp.ones((c, c), dtype=bool), -1 if strict else 0)
        keep = tril_cc[:, :, None] & (nq_sub[..., :, None, :] == n_sub[..., None, :, :])
        self.diag = masked_exp(keep, bq_sub[..., :, None, :] - b_sub[..., None, :, :])
        self.eye = jnp.eye(P, dtype=bool)[:, None, :, None]  # [P, 1, P, 1]

    def _sub(self, x):
        return x.reshape(*x.shape[:-2], self.P, self.c, x.shape[-1])

    def scores(self, q, k):
        """[.., C, M] q and k -> the decayed, masked [.., C, C] scores."""
        q_sub = self._sub(q)
        k_t = k[..., None, :, :] * self.k_scale  # [.., P, C, M]
        off = jnp.einsum("...icm,...ism->...ics", q_sub * self.q_scale, k_t)
        # Two operands, the decays multiplied into k first (XLA's three-operand einsum is
        # slower on CPU: docs/results/delta_family_cpu_passes.md; `grads` reads the same product).
        diag = jnp.einsum(
            "...icm,...icsm->...ics", q_sub, self._sub(k)[..., None, :, :] * self.diag
        )
        off = off.reshape(*off.shape[:-1], self.P, self.c)  # [.., P, c, P, c]
        # select, not add: an off-diagonal entry of the diagonal block is 0 anyway, but select
        # keeps the blocks independent
        full = jnp.where(self.eye, diag[..., :, :, None, :], off)
        return full.reshape(*q.shape[:-2], q.shape[-2], k.shape[-2])

    def grads(self, ds, q, k):
        """Cotangents of q and k [.., C, M] given that of the scores ds [.., C, C]."""
        P, c = self.P, self.c
        ds_off = ds.reshape(*ds.shape[:-2], P, c, ds.shape[-1])  # [.., P, c, C]
        blocks = ds.reshape(*ds.shape[:-2], P, c, P, c)
        ds_diag = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [.., P, c, c]
        q_sub, k_sub = self._sub(q), self._sub(k)
        k_t = k[..., None, :, :] * self.k_scale  # [.., P, C, M]
        dq = self.q_scale * jnp.einsum("...ics,...ism->...icm", ds_off, k_t)
        dk_i = jnp.einsum("...ics,...icm->...ism", ds_off, q_sub * self.q_scale)  # [.., P, C, M]
        # The sums over the P sub-blocks and over the c tokens of a diagonal block are unrolled
        # into elementwise multiply-adds (static loops over P and c, not over time), which XLA
        # fuses into one loop each: as einsums or reductions, XLA's CPU backend lowers them to
        # slow reductions (measured: docs/results/delta_family_cpu_passes.md, issue 19 `vjp2`).
        dk = sum(dk_i[..., i, :, :] * self.k_scale[..., i, :, :] for i in range(P))
        ds_diag = ds_diag[..., None]  # [.., P, c, c, 1]
        dq += sum(
            ds_diag[..., :, s, :] * k_sub[..., s, None, :] * self.diag[..., :, s, :]
            for s in range(c)
        )
        dk_diag = sum(
            ds_diag[..., t, :, :] * q_sub[..., t, None, :] * self.diag[..., t, :, :]
            for t in range(c)
        )
        return dq.reshape(q.shape), dk + dk_diag.reshape(k.shape)

    def vjp(self, ds, q, k):
        """Cotangents of q, k and of the cumulative log decays on the query and key sides
        `(dq, dk, db_query, db_key)` [.., C, M], given that of the scores ds [.., C, C].

        Every kept term of the scores is q_tm k_sm exp(bq_tm − b_sm), so its derivative with
        respect to bq_tm is the term itself, and with respect to b_sm minus it: summed,
        ∂/∂bq_tm = q_tm·dq_tm and ∂/∂b_sm = −k_sm·dk_sm. No decay factor is formed beyond those
        of `grads` (all with exponents ≤ 0), so −30 per token stays exact in the backward pass.
        """
        dq, dk = self.grads(ds, q, k)
        return dq, dk, q * dq, -(k * dk)


def suffix_sum_to_reset(db_BTHX, reset_BTHX):
    """dL/da_s = Σ_{s ≤ t < u} dL/dB_t from dL/dB_t `[B, T, H, X]` (B the cumulative log
    decay, `reset` where a = −inf), u the next reset after s; 0 at a reset itself.

    Exact algebra (pairs across a reset have weight 0) gives the plain suffix sum too, but
    summing past a reset leaves rounding residue: stopping there keeps gradients from crossing
    a document boundary at all. A reverse scan of da_s = dB_s + [no reset at s+1] · da_{s+1}.
    """
    go_on = jnp.pad(~reset_BTHX[:, 1:], ((0, 0), (0, 1), (0, 0), (0, 0))).astype(jnp.float32)

    def combine(later, earlier):  # reverse scan: `later` holds the suffix after `earlier`
        g_later, x_later = later
        g, x = earlier
        return g * g_later, x + g * x_later

    _, da_BTHX = jax.lax.associative_scan(combine, (go_on, db_BTHX), reverse=True, axis=1)
    return jnp.where(reset_BTHX, 0.0, da_BTHX)

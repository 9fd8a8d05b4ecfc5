"""Chunkwise-parallel causal linear attention: the training path.

Split time into N chunks of C tokens. With b_t the cumulative log decay inside a chunk (b_t ≤ 0)
and g = b_C its total, the state (P_n, z_n) entering chunk n gives, for t in chunk n,

    num_t   = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s) v_s   +   exp(b_t) q_tᵀ P_n
    den_t   = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s)       +   exp(b_t) q_tᵀ z_n
              └────────── intra-chunk: dense C×C matmuls ──────┘    └── inter-chunk ─┘
    P_{n+1} = exp(g) P_n + Σ_{s in chunk} exp(g − b_s) k_s v_sᵀ      (z: the same with v_s = 1)

Work is O(T·C·M + T·M·Dv); the only sequential part is the prefix over N chunk states.

The backward pass is a custom VJP that keeps one state per chunk, never one per token. It walks
the chunks last to first carrying the state cotangent G_n = exp(g_n) G_{n+1} + Σ_t exp(b_t) q_t do_tᵀ,
so only one chunk's C×C matrices are alive at a time. The decay gradient needs no extra pass:
every output term carries exp(B_query − B_key) for the global cumulative decay B, so
dL/dB_t = q_t·dq_t − k_t·dk_t (+ ⟨dS_T, S_T⟩ at the end) and dL/da_s = Σ_{t ≥ s} dL/dB_t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def causal_chunked(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, *, chunk_size: int):
    """Causal linear attention, chunkwise, on float32 arrays.

    `a_BTH` is the log decay (None: none); `z0_BHM` the initial normaliser state, or None to skip
    the normaliser. Returns `(num_BTHD, den_BTH, kv_BHMD, z_BHM)` (den and z None without z0).
    """
    T = q_BTHM.shape[1]
    C = min(chunk_size, T)

    # ---- 1. pad time to a multiple of C (zero keys and values, zero log decay: no effect) ----
    pad = -T % C
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q_BTHM, k_BTHM, v_BTHD = (jnp.pad(x, widths) for x in (q_BTHM, k_BTHM, v_BTHD))
        if a_BTH is not None:
            a_BTH = jnp.pad(a_BTH, widths[:3])
    num_BTHD, den_BTH, kv_BHMD, z_BHM = _chunked(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C)
    return num_BTHD[:, :T], None if den_BTH is None else den_BTH[:, :T], kv_BHMD, z_BHM


def _split(x_BT, C):
    """[B, T, ...] -> [B, N, C, ...] (a free reshape)."""
    return x_BT.reshape(x_BT.shape[0], x_BT.shape[1] // C, C, *x_BT.shape[2:])


def _merge(x_BNC):
    return x_BNC.reshape(x_BNC.shape[0], -1, *x_BNC.shape[3:])


def _scale(x, w):
    """x[..., M] * w[...]; w None means 1."""
    return x if w is None else x * w[..., None]


def _intra_mask(b_CH, C):
    """exp(b_t − b_s) for s ≤ t, 0 above the diagonal (masked before exp): [..., H, C, C]."""
    causal_CC = jnp.tril(jnp.ones((C, C), dtype=bool))
    if b_CH is None:
        return causal_CC.astype(jnp.float32)
    b_HC = jnp.moveaxis(b_CH, -2, -1)
    return jnp.exp(jnp.where(causal_CC, b_HC[..., :, None] - b_HC[..., None, :], -jnp.inf))


def _forward(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C):
    q, k, v = (_split(x, C) for x in (q_BTHM, k_BTHM, v_BTHD))
    b_BNCH = None if a_BTH is None else jnp.cumsum(_split(a_BTH, C), axis=2)
    with_den = z0_BHM is not None

    # ---- 2. intra-chunk: masked, decayed C×C scores times values (row sums: normaliser) ----
    scores_BNHCC = jnp.einsum("bnchm,bnshm->bnhcs", q, k) * _intra_mask(b_BNCH, C)
    num_BNCHD = jnp.einsum("bnhcs,bnshd->bnchd", scores_BNHCC, v)
    den_BNCH = jnp.moveaxis(jnp.sum(scores_BNHCC, -1), 2, 3) if with_den else None

    # ---- 3. inter-chunk: prefix over chunk states, read by the decayed queries ----
    g_BNH = None if b_BNCH is None else b_BNCH[:, :, -1]
    to_end_BNCH = None if b_BNCH is None else jnp.exp(b_BNCH[:, :, -1:] - b_BNCH)
    k_end = _scale(k, to_end_BNCH)
    u_BNHMD = jnp.einsum("bnchm,bnchd->bnhmd", k_end, v)
    uz_BNHM = jnp.sum(k_end, axis=2) if with_den else None

    def prefix(carry, inputs):
        kv_BHMD, z_BHM = carry
        g_BH, u_BHMD, uz_BHM = inputs
        if g_BH is not None:
            kv_BHMD = jnp.exp(g_BH)[..., None, None] * kv_BHMD
            z_BHM = None if z_BHM is None else jnp.exp(g_BH)[..., None] * z_BHM
        new = (kv_BHMD + u_BHMD, None if z_BHM is None else z_BHM + uz_BHM)
        return new, carry

    front = functools.partial(jax.tree.map, lambda x: jnp.moveaxis(x, 1, 0))
    (kv_BHMD, z_BHM), (p_NBHMD, pz_NBHM) = jax.lax.scan(
        prefix, (kv0_BHMD, z0_BHM), front((g_BNH, u_BNHMD, uz_BNHM))
    )
    p_BNHMD = jnp.moveaxis(p_NBHMD, 0, 1)
    q_start = _scale(q, None if b_BNCH is None else jnp.exp(b_BNCH))
    num_BNCHD += jnp.einsum("bnchm,bnhmd->bnchd", q_start, p_BNHMD)
    if with_den:
        den_BNCH += jnp.einsum("bnchm,nbhm->bnch", q_start, pz_NBHM)
        pz_BNHM = jnp.moveaxis(pz_NBHM, 0, 1)
    else:
        den_BNCH = pz_BNHM = None

    # ---- 4. finish: back to [B, T, ...] ----
    den_BTH = None if den_BNCH is None else _merge(den_BNCH)
    return (_merge(num_BNCHD), den_BTH, kv_BHMD, z_BHM), (p_BNHMD, pz_BNHM)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunked(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C):
    return _forward(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C)[0]


def _chunked_fwd(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C):
    outputs, (p_BNHMD, pz_BNHM) = _forward(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C)
    _, _, kv_BHMD, z_BHM = outputs
    # Residuals: the inputs, the final state and one state per chunk; scores are recomputed.
    return outputs, (q_BTHM, k_BTHM, v_BTHD, a_BTH, kv_BHMD, z_BHM, p_BNHMD, pz_BNHM)


def _chunked_bwd(C, residuals, cotangents):
    q_BTHM, k_BTHM, v_BTHD, a_BTH, kv_BHMD, z_BHM, p_BNHMD, pz_BNHM = residuals
    dnum_BTHD, dden_BTH, dkv_BHMD, dz_BHM = cotangents
    with_den = z_BHM is not None
    q, k, v, do = (_split(x, C) for x in (q_BTHM, k_BTHM, v_BTHD, dnum_BTHD))
    dden = _split(dden_BTH, C) if with_den else None
    b_BNCH = None if a_BTH is None else jnp.cumsum(_split(a_BTH, C), axis=2)

    def at(n, *xs):
        return [None if x is None else jax.lax.dynamic_index_in_dim(x, n, 1, False) for x in xs]

    # The normaliser is the attention output for a value that is always 1, so it enters the
    # gradients as one more value column: do·v becomes do·v + dden, and G gains a column Gz.
    def step(carry, n):
        (g_BHMD, gz_BHM), (dq_all, dk_all, dv_all) = carry
        q_n, k_n, v_n, do_n, dden_n, p_n, pz_n, b_n = at(
            n, q, k, v, do, dden, p_BNHMD, pz_BNHM, b_BNCH
        )
        mask_BHCC = _intra_mask(b_n, C)
        from_start = None if b_n is None else jnp.exp(b_n)
        to_end = None if b_n is None else jnp.exp(b_n[:, -1:] - b_n)

        # ---- intra-chunk (scores recomputed) ----
        dov_BHCC = jnp.einsum("bchd,bshd->bhcs", do_n, v_n)
        if with_den:
            dov_BHCC += jnp.moveaxis(dden_n, 1, 2)[..., None]
        dov_BHCC *= mask_BHCC
        qk_BHCC = jnp.einsum("bchm,bshm->bhcs", q_n, k_n) * mask_BHCC
        dq = jnp.einsum("bhcs,bshm->bchm", dov_BHCC, k_n)
        dk = jnp.einsum("bhcs,bchm->bshm", dov_BHCC, q_n)
        dv = jnp.einsum("bhcs,bchd->bshd", qk_BHCC, do_n)

        # ---- inter-chunk: through the state entering (P) and leaving (G) the chunk ----
        dq_in = jnp.einsum("bchd,bhmd->bchm", do_n, p_n)
        dk_in = jnp.einsum("bchd,bhmd->bchm", v_n, g_BHMD)
        if with_den:
            dq_in += dden_n[..., None] * pz_n[:, None]
            dk_in += gz_BHM[:, None]
        dq += _scale(dq_in, from_start)
        dk += _scale(dk_in, to_end)
        dv += _scale(jnp.einsum("bchm,bhmd->bchd", k_n, g_BHMD), to_end)

        # ---- state cotangent entering this chunk ----
        q_start = _scale(q_n, from_start)
        if b_n is not None:
            g_BHMD = jnp.exp(b_n[:, -1])[..., None, None] * g_BHMD
            gz_BHM = None if gz_BHM is None else jnp.exp(b_n[:, -1])[..., None] * gz_BHM
        g_BHMD += jnp.einsum("bchm,bchd->bhmd", q_start, do_n)
        if with_den:
            gz_BHM += jnp.einsum("bchm,bch->bhm", q_start, dden_n)

        put = functools.partial(jax.lax.dynamic_update_index_in_dim, index=n, axis=1)
        grads = (put(dq_all, dq), put(dk_all, dk), put(dv_all, dv))
        return ((g_BHMD, gz_BHM), grads), None

    zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    ((dkv0_BHMD, dz0_BHM), (dq, dk, dv)), _ = jax.lax.scan(
        step, ((dkv_BHMD, dz_BHM), zeros), jnp.arange(q.shape[1]), reverse=True
    )
    dq_BTHM, dk_BTHM, dv_BTHD = _merge(dq), _merge(dk), _merge(dv)

    # ---- decay: dL/dB_t = q_t·dq_t − k_t·dk_t (+ ⟨dS, S⟩ at the end), reverse cumsum ----
    da_BTH = None
    if a_BTH is not None:
        db_BTH = jnp.sum(q_BTHM * dq_BTHM, -1) - jnp.sum(k_BTHM * dk_BTHM, -1)
        end_BH = jnp.sum(dkv_BHMD * kv_BHMD, axis=(-2, -1))
        if with_den:
            end_BH += jnp.sum(dz_BHM * z_BHM, axis=-1)
        db_BTH = db_BTH.at[:, -1].add(end_BH)
        da_BTH = jnp.flip(jnp.cumsum(jnp.flip(db_BTH, 1), axis=1), 1)
    return dq_BTHM, dk_BTHM, dv_BTHD, da_BTH, dkv0_BHMD, dz0_BHM


_chunked.defvjp(_chunked_fwd, _chunked_bwd)

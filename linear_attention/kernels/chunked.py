"""Chunkwise causal linear attention: the training path.

Split time into N chunks of C tokens. With b_t the cumulative log decay inside a chunk (b_t ≤ 0)
and g = b_C its total, the state (S_n, z_n) entering chunk n gives, for t in the chunk,

    num_t   = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s) v_s   +   exp(b_t) q_tᵀ S_n
    den_t   = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s)       +   exp(b_t) q_tᵀ z_n
              └────────── intra-chunk: dense C×C matmuls ──────┘    └── inter-chunk ─┘
    S_{n+1} = exp(g) S_n + Σ_{s in chunk} exp(g − b_s) k_s v_sᵀ      (z: the same with v_s = 1)
    o_t     = num_t / (den_t + eps)        (or num_t unnormalised)

Work is O(T·C·M + T·M·Dv) in dense matmuls. The chunks are walked in order by `lax.scan`, which
keeps one chunk's C×C matrices in cache at a time: on CPU this runs several times faster than
materialising all chunks at once, and it needs no per-token temporaries.

The gradient is a custom VJP that stores one state per chunk (never one per token) and walks the
chunks last to first with the state cotangent G_n = exp(g_n) G_{n+1} + Σ_t exp(b_t) q_t dnum_tᵀ,
recomputing scores and normalisers. The decay gradient needs no extra pass: every
output term carries exp(B_query − B_key) for the global cumulative decay B, so
dL/dB_t = q_t·dq_t − k_t·dk_t (+ ⟨dS_T, S_T⟩ at the end) and dL/da_s = Σ_{t ≥ s} dL/dB_t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def causal_chunked(
    q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, *, chunk_size: int, normalize: bool, eps
):
    """Causal linear attention, chunkwise, on float32 arrays.

    `a_BTH` is the log decay (None: none); `z0_BHM` the initial normaliser state, or None to not
    track it (only allowed without `normalize`). Returns `(o_BTHD, kv_BHMD, z_BHM)`.
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
    o_BTHD, kv_BHMD, z_BHM = _chunked(
        q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C, normalize, float(eps)
    )
    return o_BTHD[:, :T], kv_BHMD, z_BHM


def _split(x_BT, C):
    """[B, T, ...] -> [B, N, C, ...] (a free reshape)."""
    return x_BT.reshape(x_BT.shape[0], x_BT.shape[1] // C, C, *x_BT.shape[2:])


def _merge(x_BNC):
    return x_BNC.reshape(x_BNC.shape[0], -1, *x_BNC.shape[3:])


def _chunk(n, *xs_BNC):
    """Chunk n of each [B, N, C, H, ...] array, heads first: [B, H, C, ...] (None stays None)."""
    return [
        None if x is None else jnp.swapaxes(jax.lax.dynamic_index_in_dim(x, n, 1, False), 1, 2)
        for x in xs_BNC
    ]


def _put(x_BNC, n, chunk_BHC):
    """Write a [B, H, C, ...] chunk into slot n of a [B, N, C, H, ...] array, in place."""
    return jax.lax.dynamic_update_index_in_dim(x_BNC, jnp.swapaxes(chunk_BHC, 1, 2), n, 1)


def _decays(a_BHC):
    """Intra-chunk decay factors for b the inclusive cumsum of `a` and g = b_C: exp(b_t − b_s)
    masked to s ≤ t before exp [B,H,C,C], exp(b_t) and exp(g − b_t) [B,H,C], exp(g) [B,H].
    All None without decay."""
    if a_BHC is None:
        return None, None, None, None
    C = a_BHC.shape[-1]
    causal_CC = jnp.tril(jnp.ones((C, C), dtype=bool))
    b_BHC = jnp.cumsum(a_BHC, axis=-1)
    g_BH1 = b_BHC[..., -1:]
    mask_BHCC = jnp.exp(jnp.where(causal_CC, b_BHC[..., :, None] - b_BHC[..., None, :], -jnp.inf))
    return mask_BHCC, jnp.exp(b_BHC), jnp.exp(g_BH1 - b_BHC), jnp.exp(g_BH1[..., 0])


def _mul(x, w, axis=-1):
    """x * w broadcast along `axis` of x; w None means 1."""
    return x if w is None else x * jnp.expand_dims(w, axis)


def _scan_chunks(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C, normalize, eps, keep):
    """Forward walk over chunks. With `keep`, also returns the state entering every chunk."""
    q, k, v = (_split(x, C) for x in (q_BTHM, k_BTHM, v_BTHD))
    a = None if a_BTH is None else _split(a_BTH, C)[..., None]
    causal_CC = jnp.tril(jnp.ones((C, C), jnp.float32))

    def step(carry, n):
        kv_BHMD, z_BHM, o_all = carry
        q_n, k_n, v_n, a_n = _chunk(n, q, k, v, a)
        mask_BHCC, from_start, to_end, decay_BH = _decays(None if a_n is None else a_n[..., 0])

        # ---- 2. intra-chunk: masked, decayed scores ----
        s_BHCC = (q_n @ jnp.swapaxes(k_n, -1, -2)) * (causal_CC if mask_BHCC is None else mask_BHCC)
        # ---- 3. inter-chunk: read the state entering the chunk, then advance it ----
        q_start = _mul(q_n, from_start)
        o_BHCD = s_BHCC @ v_n + q_start @ kv_BHMD
        if normalize:
            den_BHC = jnp.sum(s_BHCC, -1) + jnp.einsum("bhcm,bhm->bhc", q_start, z_BHM)
            o_BHCD = o_BHCD / (den_BHC[..., None] + eps)
        k_end = _mul(k_n, to_end)
        new_kv = _mul(kv_BHMD, decay_BH, (-2, -1)) + jnp.swapaxes(k_end, -1, -2) @ v_n
        new_z = None if z_BHM is None else _mul(z_BHM, decay_BH) + jnp.sum(k_end, -2)
        # ---- 4. finish: write the chunk's outputs in place ----
        return (new_kv, new_z, _put(o_all, n, o_BHCD)), ((kv_BHMD, z_BHM) if keep else None)

    init = (kv0_BHMD, z0_BHM, jnp.zeros_like(v))
    (kv_BHMD, z_BHM, o), entering = jax.lax.scan(step, init, jnp.arange(q.shape[1]))
    return (_merge(o), kv_BHMD, z_BHM), entering


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _chunked(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C, normalize, eps):
    args = (q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C, normalize, eps)
    return _scan_chunks(*args, keep=False)[0]


def _chunked_fwd(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C, normalize, eps):
    args = (q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, C, normalize, eps)
    outputs, entering = _scan_chunks(*args, keep=True)
    o_BTHD, kv_BHMD, z_BHM = outputs
    # Residuals: inputs, outputs and the state entering each chunk (one per chunk, not per token).
    return outputs, (q_BTHM, k_BTHM, v_BTHD, a_BTH, o_BTHD, kv_BHMD, z_BHM, entering)


def _chunked_bwd(C, normalize, eps, residuals, cotangents):
    q_BTHM, k_BTHM, v_BTHD, a_BTH, o_BTHD, kv_BHMD, z_BHM, (kv_in_NBHMD, z_in_NBHM) = residuals
    do_BTHD, dkv_BHMD, dz_BHM = cotangents
    q, k, v, o, do = (_split(x, C) for x in (q_BTHM, k_BTHM, v_BTHD, o_BTHD, do_BTHD))
    a = None if a_BTH is None else _split(a_BTH, C)[..., None]
    causal_CC = jnp.tril(jnp.ones((C, C), jnp.float32))
    tr = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)

    def step(carry, n):
        (g_BHMD, gz_BHM), (dq_all, dk_all, dv_all, db_all) = carry
        q_n, k_n, v_n, o_n, do_n, a_n = _chunk(n, q, k, v, o, do, a)
        kv_in, z_in = kv_in_NBHMD[n], None if z_in_NBHM is None else z_in_NBHM[n]
        mask_BHCC, from_start, to_end, decay_BH = _decays(None if a_n is None else a_n[..., 0])
        mask_BHCC = causal_CC if mask_BHCC is None else mask_BHCC
        q_start = _mul(q_n, from_start)

        # ---- recompute scores and normaliser; cotangents of numerator and normaliser ----
        s_BHCC = (q_n @ tr(k_n)) * mask_BHCC
        dnum_BHCD, dden_BHC = do_n, None
        if normalize:
            den_BHC = jnp.sum(s_BHCC, -1) + jnp.einsum("bhcm,bhm->bhc", q_start, z_in) + eps
            dnum_BHCD = do_n / den_BHC[..., None]
            dden_BHC = -jnp.sum(dnum_BHCD * o_n, -1)

        # ---- intra-chunk: the normaliser is the output for values ≡ 1, one more value column ----
        dov_BHCC = dnum_BHCD @ tr(v_n)
        if dden_BHC is not None:
            dov_BHCC += dden_BHC[..., None]
        dov_BHCC *= mask_BHCC
        dq = dov_BHCC @ k_n
        dk = tr(dov_BHCC) @ q_n
        dv = tr(s_BHCC) @ dnum_BHCD

        # ---- inter-chunk: through the state entering (kv_in) and leaving (G) the chunk ----
        dq_in = dnum_BHCD @ tr(kv_in)
        if dden_BHC is not None:
            dq_in += dden_BHC[..., None] * z_in[:, :, None]
        dk_in = v_n @ tr(g_BHMD)
        if gz_BHM is not None:
            dk_in += gz_BHM[:, :, None]
        dq += _mul(dq_in, from_start)
        dk += _mul(dk_in, to_end)
        dv += _mul(k_n @ g_BHMD, to_end)
        db_BHC = jnp.sum(q_n * dq, -1) - jnp.sum(k_n * dk, -1)

        # ---- state cotangent entering this chunk ----
        g_BHMD = _mul(g_BHMD, decay_BH, (-2, -1)) + tr(q_start) @ dnum_BHCD
        if gz_BHM is not None:
            gz_BHM = _mul(gz_BHM, decay_BH)
            if dden_BHC is not None:
                gz_BHM += jnp.einsum("bhcm,bhc->bhm", q_start, dden_BHC)

        grads = (_put(dq_all, n, dq), _put(dk_all, n, dk), _put(dv_all, n, dv))
        return ((g_BHMD, gz_BHM), (*grads, _put(db_all, n, db_BHC))), None

    N = q.shape[1]
    zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros(q.shape[:-1]))
    ((dkv0_BHMD, dz0_BHM), (dq, dk, dv, db)), _ = jax.lax.scan(
        step, ((dkv_BHMD, dz_BHM), zeros), jnp.arange(N), reverse=True
    )

    # ---- decay: dL/dB_t (+ ⟨dS, S⟩ at the end), summed over t ≥ s ----
    da_BTH = None
    if a_BTH is not None:
        end_BH = jnp.sum(dkv_BHMD * kv_BHMD, axis=(-2, -1))
        if z_BHM is not None:
            end_BH += jnp.sum(dz_BHM * z_BHM, axis=-1)
        db_BTH = _merge(db).at[:, -1].add(end_BH)
        da_BTH = jnp.flip(jnp.cumsum(jnp.flip(db_BTH, 1), axis=1), 1)
    return _merge(dq), _merge(dk), _merge(dv), da_BTH, dkv0_BHMD, dz0_BHM


_chunked.defvjp(_chunked_fwd, _chunked_bwd)

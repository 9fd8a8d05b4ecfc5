"""Chunkwise causal linear attention: the training path.

Split time into chunks of C tokens. With b_t the cumulative log decay inside a chunk (b_t ≤ 0)
and g = b_C its total, the state (S, z) entering a chunk gives, for t in the chunk,

    num_t  = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s) v_s   +   exp(b_t) q_tᵀ S
    den_t  = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s)       +   exp(b_t) q_tᵀ z
             └────────── intra-chunk: dense C×C matmuls ──────┘    └── inter-chunk ─┘
    S'     = exp(g) S + Σ_{s in chunk} exp(g − b_s) k_s v_sᵀ        (z: the same with v_s = 1)
    o_t    = num_t / (den_t + eps)        (or num_t unnormalised)

Work is O(T·C·M + T·M·Dv) in dense matmuls. A `lax.scan` walks the sequence in steps of G
chunks; the G chunks of a step are computed together, their entering states by a G×G decay
weighting of the chunk updates. One step's matrices stay in cache and no per-token temporaries
are made: on CPU this is several times faster than materialising all chunks at once.

The gradient is a custom VJP that stores one state per chunk (never one per token) and walks the
steps last to first carrying the state cotangent, G = exp(g) G' + Σ_t exp(b_t) q_t dnum_tᵀ per
chunk, recomputing scores and normalisers. The decay gradient needs no extra pass: every output
term carries exp(B_query − B_key) for the global cumulative decay B, so
dL/dB_t = q_t·dq_t − k_t·dk_t (+ ⟨dS_T, S_T⟩ at the end) and dL/da_s = Σ_{t ≥ s} dL/dB_t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Tokens handled per scan step (G = TOKENS_PER_STEP // C chunks): large enough to amortise the
# per-step cost, small enough that a step's matrices stay in cache. Measured on CPU; see
# BENCHMARKS.md.
TOKENS_PER_STEP = 128


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
    N = (T + pad) // C
    G = max(g for g in range(1, max(TOKENS_PER_STEP // C, 1) + 1) if N % g == 0)
    o_BTHD, kv_BHMD, z_BHM = _chunked(
        q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, (G, C), normalize, float(eps)
    )
    return o_BTHD[:, :T], kv_BHMD, z_BHM


# ---- layout helpers: [B, T, H, ...] is viewed as [B, steps, G, C, H, ...] ----


def _split(x_BT, GC):
    G, C = GC
    return x_BT.reshape(x_BT.shape[0], x_BT.shape[1] // (G * C), G, C, *x_BT.shape[2:])


def _merge(x):
    return x.reshape(x.shape[0], -1, *x.shape[4:])


def _step_slice(n, *xs):
    """Step n of each [B, steps, G, C, H, ...] array, heads first: [B, H, G, C, ...]."""
    return [
        None if x is None else jnp.moveaxis(jax.lax.dynamic_index_in_dim(x, n, 1, False), 3, 1)
        for x in xs
    ]


def _put(x, n, y_BHGC):
    """Write a [B, H, G, C, ...] block into step n of a [B, steps, G, C, H, ...] array."""
    return jax.lax.dynamic_update_index_in_dim(x, jnp.moveaxis(y_BHGC, 1, 3), n, 1)


def _mul(x, w, axes=-1):
    """x * w, w broadcast along `axes` of x; w None means 1."""
    return x if w is None else x * jnp.expand_dims(w, axes)


def _tr(x):
    return jnp.swapaxes(x, -1, -2)


class _Decays:
    """Decay factors of one step of G chunks, from the log decays a [B, H, G, C] (None: none).

    Within chunk g: b = cumsum(a), total gt = b_C. Across the step: c_g = Σ_{g' < g} gt_{g'}.
      intra  [B,H,G,C,C]  exp(b_t − b_s) for s ≤ t, masked before exp
      start  [B,H,G,C]    exp(b_t): the entering state's weight on q_t
      end    [B,H,G,C]    exp(gt − b_s): k_s's weight in the chunk's state update u_g
      across [B,H,G,G]    exp(c_g − c_{g'+1}) for g' < g: u_{g'}'s weight in chunk g's state
      step_start [B,H,G]  exp(c_g): the step's entering state's weight in chunk g's state
      step_end   [B,H,G]  exp(c_G − c_{g+1}): u_g's weight in the state leaving the step
      step_total [B,H]    exp(c_G)
    Without decay all are None except the 0/1 masks `intra` and `across`.
    """

    def __init__(self, a_BHGC, G, C):
        tril_CC = jnp.tril(jnp.ones((C, C), dtype=bool))
        strict_GG = jnp.tril(jnp.ones((G, G), dtype=bool), -1)
        if a_BHGC is None:
            self.intra, self.across = tril_CC.astype(jnp.float32), strict_GG.astype(jnp.float32)
            self.start = self.end = self.step_start = self.step_end = self.step_total = None
            return
        b = jnp.cumsum(a_BHGC, axis=-1)
        gt = b[..., -1]
        c_next = jnp.cumsum(gt, axis=-1)  # c_{g+1}
        c = c_next - gt
        c_end = c_next[..., -1:]
        self.intra = jnp.exp(jnp.where(tril_CC, b[..., :, None] - b[..., None, :], -jnp.inf))
        self.start = jnp.exp(b)
        self.end = jnp.exp(gt[..., None] - b)
        self.across = jnp.exp(
            jnp.where(strict_GG, c[..., :, None] - c_next[..., None, :], -jnp.inf)
        )
        self.step_start = jnp.exp(c)
        self.step_end = jnp.exp(c_end - c_next)
        self.step_total = jnp.exp(c_end[..., 0])


def _combine(w_BHGG, x_BHG, transpose=False):
    """Σ_k w[g, k] x[k] (or w[k, g] with `transpose`) over the G chunks of a step."""
    B, H, G = x_BHG.shape[:3]
    w_BHGG = jnp.broadcast_to(w_BHGG, (B, H, G, G))
    spec = "bhkg,bhkf->bhgf" if transpose else "bhgk,bhkf->bhgf"
    return jnp.einsum(spec, w_BHGG, x_BHG.reshape(B, H, G, -1)).reshape(x_BHG.shape)


def _state_axes(x):
    """Axes to expand a [B, H, G] weight over the state dims of x [B, H, G, ...]."""
    return tuple(range(3, x.ndim))


def _advance(d: _Decays, s, u_BHG):
    """States entering each chunk of the step, and the state leaving it (kv or z)."""
    if s is None:
        return None, None
    axes = _state_axes(u_BHG)
    entering = _mul(s[:, :, None], d.step_start, axes) + _combine(d.across, u_BHG)
    leaving = _mul(s, d.step_total, tuple(a - 1 for a in axes))
    return entering, leaving + jnp.sum(_mul(u_BHG, d.step_end, axes), axis=2)


def _retreat(d: _Decays, g, w_BHG):
    """Cotangents of the states leaving each chunk, and of the state entering the step."""
    if g is None:
        return None, None
    axes = _state_axes(w_BHG)
    leaving = _mul(g[:, :, None], d.step_end, axes) + _combine(d.across, w_BHG, transpose=True)
    entering = _mul(g, d.step_total, tuple(a - 1 for a in axes))
    return leaving, entering + jnp.sum(_mul(w_BHG, d.step_start, axes), axis=2)


def _forward(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, GC, normalize, eps, keep):
    """Walk the steps in order. With `keep`, also return the state entering every chunk."""
    G, C = GC
    q, k, v = (_split(x, GC) for x in (q_BTHM, k_BTHM, v_BTHD))
    a = None if a_BTH is None else _split(a_BTH, GC)[..., None]

    def step(carry, n):
        kv_BHMD, z_BHM, o_all = carry
        q_n, k_n, v_n, a_n = _step_slice(n, q, k, v, a)
        d = _Decays(None if a_n is None else a_n[..., 0], G, C)

        # ---- 2. intra-chunk: masked, decayed C×C scores ----
        s_BHGCC = (q_n @ _tr(k_n)) * d.intra
        # ---- 3. inter-chunk: states entering each chunk, read by the decayed queries ----
        k_end = _mul(k_n, d.end)
        u_BHGMD = _tr(k_end) @ v_n
        uz_BHGM = None if z_BHM is None else jnp.sum(k_end, axis=-2)
        p_BHGMD, kv_next = _advance(d, kv_BHMD, u_BHGMD)
        pz_BHGM, z_next = _advance(d, z_BHM, uz_BHGM)
        q_start = _mul(q_n, d.start)
        o_BHGCD = s_BHGCC @ v_n + q_start @ p_BHGMD
        if normalize:
            den_BHGC = jnp.sum(s_BHGCC, -1) + jnp.einsum("bhgcm,bhgm->bhgc", q_start, pz_BHGM)
            o_BHGCD = o_BHGCD / (den_BHGC[..., None] + eps)
        # ---- 4. finish: write the step's outputs in place ----
        return (kv_next, z_next, _put(o_all, n, o_BHGCD)), ((p_BHGMD, pz_BHGM) if keep else None)

    init = (kv0_BHMD, z0_BHM, jnp.zeros_like(v))
    (kv_BHMD, z_BHM, o), entering = jax.lax.scan(step, init, jnp.arange(q.shape[1]))
    return (_merge(o), kv_BHMD, z_BHM), entering


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _chunked(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, GC, normalize, eps):
    args = (q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, GC, normalize, eps)
    return _forward(*args, keep=False)[0]


def _chunked_fwd(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, GC, normalize, eps):
    args = (q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, GC, normalize, eps)
    outputs, entering = _forward(*args, keep=True)
    o_BTHD, kv_BHMD, z_BHM = outputs
    # Residuals: inputs, outputs and the state entering each chunk (one per chunk, not per token).
    return outputs, (q_BTHM, k_BTHM, v_BTHD, a_BTH, o_BTHD, kv_BHMD, z_BHM, entering)


def _chunked_bwd(GC, normalize, eps, residuals, cotangents):
    q_BTHM, k_BTHM, v_BTHD, a_BTH, o_BTHD, kv_BHMD, z_BHM, (p_all, pz_all) = residuals
    do_BTHD, dkv_BHMD, dz_BHM = cotangents
    G, C = GC
    q, k, v, o, do = (_split(x, GC) for x in (q_BTHM, k_BTHM, v_BTHD, o_BTHD, do_BTHD))
    a = None if a_BTH is None else _split(a_BTH, GC)[..., None]

    def step(carry, n):
        (g_BHMD, gz_BHM), (dq_all, dk_all, dv_all, db_all) = carry
        q_n, k_n, v_n, o_n, do_n, a_n = _step_slice(n, q, k, v, o, do, a)
        p_BHGMD = p_all[n]
        pz_BHGM = None if pz_all is None else pz_all[n]
        d = _Decays(None if a_n is None else a_n[..., 0], G, C)
        q_start, k_end = _mul(q_n, d.start), _mul(k_n, d.end)

        # ---- recompute scores and normaliser; cotangents of numerator and normaliser ----
        s_BHGCC = (q_n @ _tr(k_n)) * d.intra
        dnum, dden = do_n, None
        if normalize:
            den = jnp.sum(s_BHGCC, -1) + jnp.einsum("bhgcm,bhgm->bhgc", q_start, pz_BHGM) + eps
            dnum = do_n / den[..., None]
            dden = -jnp.sum(dnum * o_n, -1)

        # ---- cotangents of the states leaving each chunk (G) and entering the step ----
        w_BHGMD = _tr(q_start) @ dnum
        wz_BHGM = None if dden is None else jnp.einsum("bhgcm,bhgc->bhgm", q_start, dden)
        if wz_BHGM is None and gz_BHM is not None:
            wz_BHGM = jnp.zeros(pz_BHGM.shape, jnp.float32)
        gl_BHGMD, g_BHMD = _retreat(d, g_BHMD, w_BHGMD)
        gzl_BHGM, gz_BHM = _retreat(d, gz_BHM, wz_BHGM)

        # ---- intra-chunk: the normaliser is the output for values ≡ 1, one more value column ----
        dov = dnum @ _tr(v_n)
        if dden is not None:
            dov += dden[..., None]
        dov *= d.intra
        dq = dov @ k_n
        dk = _tr(dov) @ q_n
        dv = _tr(s_BHGCC) @ dnum

        # ---- inter-chunk: through the states entering (p) and leaving (gl) each chunk ----
        dq_in = dnum @ _tr(p_BHGMD)
        if dden is not None:
            dq_in += dden[..., None] * pz_BHGM[..., None, :]
        dk_in = v_n @ _tr(gl_BHGMD)
        if gzl_BHGM is not None:
            dk_in += gzl_BHGM[..., None, :]
        dq += _mul(dq_in, d.start)
        dk += _mul(dk_in, d.end)
        dv += k_end @ gl_BHGMD

        grads = (_put(dq_all, n, dq), _put(dk_all, n, dk), _put(dv_all, n, dv))
        if db_all is not None:  # dL/dB_t = q_t·dq_t − k_t·dk_t
            db_all = _put(db_all, n, jnp.sum(q_n * dq, -1) - jnp.sum(k_n * dk, -1))
        return ((g_BHMD, gz_BHM), (*grads, db_all)), None

    db0 = None if a is None else jnp.zeros(q.shape[:-1], jnp.float32)
    zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), db0)
    ((dkv0_BHMD, dz0_BHM), (dq, dk, dv, db)), _ = jax.lax.scan(
        step, ((dkv_BHMD, dz_BHM), zeros), jnp.arange(q.shape[1]), reverse=True
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

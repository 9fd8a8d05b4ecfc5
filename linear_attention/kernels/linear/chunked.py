"""Chunkwise causal linear attention: the training path.

Split time into chunks of C tokens. With b_t the cumulative log decay inside a chunk (b_t ≤ 0)
and g = b_C its total, the state (S, z) entering a chunk gives, for t in the chunk,

    num_t  = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s) v_s   +   exp(b_t) q_tᵀ S
    den_t  = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s)       +   exp(b_t) q_tᵀ z
             └────────── intra-chunk: dense C×C matmuls ──────┘    └── inter-chunk ─┘
    S'     = exp(g) S + Σ_{s in chunk} exp(g − b_s) k_s v_sᵀ        (z: the same with v_s = 1)
    o_t    = num_t / (den_t + eps)        (or num_t unnormalised)

A decay per key dimension (GLA, a [B,T,H,M]) makes b, g vectors over m: exp(b_t) and exp(g − b_s)
scale q_t and k_s elementwise and exp(g) the rows of S. The intra-chunk scores
Σ_m q_tm k_sm exp(b_tm − b_sm) are no longer one matmul; they are computed in sub-blocks of 16
tokens (`SubBlocks`): pairs in different sub-blocks factor around the boundary r of the query's
sub-block as (q_t ⊙ exp(b_t − b_r))·(k_s ⊙ exp(b_r − b_s)), both exponents ≤ 0, and the
diagonal sub-blocks use the exact masked [16, 16, M] decays. Nothing overflows for log decays of
−30 per token or more. A log decay of −inf (a reset; packed documents) is carried as a count of
resets beside finite cumulative sums, so no (−inf) − (−inf) arises: a factor spanning a reset is
exactly 0. A per-head decay keeps the plain C×C path.

Work is O(T·C·M + T·M·Dv) in dense matmuls. A `lax.scan` walks the sequence in steps of G
chunks; the G chunks of a step are computed together, their entering states by a G×G decay
weighting of the chunk updates. One step's matrices stay in cache and no per-token temporaries
are made: on CPU this is several times faster than materialising all chunks at once. G follows
the shape (`ROWS_PER_STEP`): with few batch rows and heads, a step must hold enough tokens for
XLA to split its matmuls over the CPU's threads.

The gradient is a custom VJP that stores one state per chunk (never one per token) and walks the
steps last to first carrying the state cotangent, G = exp(g) G' + Σ_t exp(b_t) q_t dnum_tᵀ per
chunk, recomputing scores and normalisers. The decay gradient needs no extra pass: every output
term carries exp(B_query − B_key) for the global cumulative decay B, so
dL/dB_t = q_t·dq_t − k_t·dk_t (+ ⟨dS_T, S_T⟩ at the end) and dL/da_s = Σ_{t ≥ s} dL/dB_t, the
sum stopping at the next reset (`decays.suffix_sum_to_reset`). For a decay per key dimension
both hold per dimension m (every term carries exp(B_tm − B_sm) for one m).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.kernels.primitives.decays import (
    SubBlocks,
    pair_decays,
    sub_block_size,
    suffix_sum_to_reset,
)
from linear_attention.kernels.primitives.layout import pad_time
from linear_attention.kernels.segments import cumulative_log_decay, masked_exp

# Rows (batch × heads × tokens) handled per scan step, and never fewer than MIN_TOKENS_PER_STEP
# tokens: a step's matmuls must be large enough for XLA to split them over the CPU's threads
# (at B·H = 4, 128 tokens per step ran on one core), and small enough to stay in cache. A decay
# per key dimension keeps 512 rows (its per-step decay tensors are M times larger; larger steps
# showed no clear gain there). Measured on CPU: docs/results/chunk_kernel_cpu_passes.md.
ROWS_PER_STEP = 2048
ROWS_PER_STEP_VECTOR_DECAY = 512
MIN_TOKENS_PER_STEP = 128


def causal_chunked(
    q_BTHM,
    k_BTHM,
    v_BTHD,
    a_BTH,
    kv0_BHMD,
    z0_BHM,
    *,
    chunk_size: int,
    normalize: bool,
    eps,
    guard=None,
):
    """Causal linear attention, chunkwise, on float32 arrays.

    `a_BTH` is the log decay, `[B, T, H]` or `[B, T, H, M]` (None: none); `z0_BHM` the initial
    normaliser state, or None to not track it (only allowed without `normalize`). `guard`:
    None, or `(ok_BTH, poisoned_BTH)` bool: tokens whose key and value are finite (the others
    are zeroed inside each step, so a NaN cannot reach earlier outputs through a masked matmul)
    and outputs to set to NaN (those the bad tokens reach). Returns `(o_BTHD, kv_BHMD, z_BHM)`.
    """
    T = q_BTHM.shape[1]
    C = min(chunk_size, T)
    # one trailing axis X for the decay: 1 (per head) or M (per key dimension)
    a_BTHX = None if a_BTH is None else (a_BTH if a_BTH.ndim == 4 else a_BTH[..., None])

    # ---- 1. pad time to a multiple of C (zero keys and values, zero log decay: no effect) ----
    q_BTHM, k_BTHM, v_BTHD, a_BTHX = (pad_time(x, C) for x in (q_BTHM, k_BTHM, v_BTHD, a_BTHX))
    if guard is not None:  # padding tokens are finite (ok) and not poisoned
        ok_BTH, poisoned_BTH = guard
        guard = (~pad_time(~ok_BTH, C), pad_time(poisoned_BTH, C))
    N = q_BTHM.shape[1] // C
    B, H = q_BTHM.shape[0], q_BTHM.shape[2]
    vector = a_BTHX is not None and a_BTHX.shape[-1] > 1
    rows = ROWS_PER_STEP_VECTOR_DECAY if vector else ROWS_PER_STEP
    tokens = max(rows // max(B * H, 1), MIN_TOKENS_PER_STEP)
    G = max(g for g in range(1, max(tokens // C, 1) + 1) if N % g == 0)
    o_BTHD, kv_BHMD, z_BHM = _chunked(
        q_BTHM, k_BTHM, v_BTHD, a_BTHX, kv0_BHMD, z0_BHM, guard, (G, C), normalize, float(eps)
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


def _tr(x):
    return jnp.swapaxes(x, -1, -2)


def _split_guard(guard, GC):
    """(ok, poisoned) [B, T, H] bool -> [B, steps, G, C, H, 1] each; (None, None) without."""
    if guard is None:
        return None, None
    return tuple(_split(x[..., None], GC) for x in guard)


def _clean(ok_n, k_n, v_n):
    """Zero the keys and values of non-finite tokens (a NaN times a zero weight is still NaN)."""
    if ok_n is None:
        return k_n, v_n
    return jnp.where(ok_n, k_n, 0.0), jnp.where(ok_n, v_n, 0.0)


class _Decays:
    """Decay factors of one step of G chunks, from the log decays a [B, H, G, C, X] (None: none).

    X = 1 for a decay per head, X = M per key dimension; every factor keeps the trailing X axis, so
    it broadcasts against q or k [.., C, M] and against the rows of a state [.., M, Dv]. Within
    chunk g: b = cumsum(a), total gt = b_C. Across the step: c_g = Σ_{g' < g} gt_{g'}.
      intra  [B,H,G,C,C]    exp(b_t − b_s) for s ≤ t (X = 1 only; vector decays: `SubBlocks`)
      start  [B,H,G,C,X]    exp(b_t): the entering state's weight on q_t
      end    [B,H,G,C,X]    exp(gt − b_s): k_s's weight in the chunk's state update u_g
      across [B,H,G,G,X]    exp(c_g − c_{g'+1}) for g' < g: u_{g'}'s weight in chunk g's state
      step_start [B,H,G,X]  exp(c_g): the step's entering state's weight in chunk g's state
      step_end   [B,H,G,X]  exp(c_G − c_{g+1}): u_g's weight in the state leaving the step
      step_total [B,H,X]    exp(c_G)
    Without decay all are None except the 0/1 masks `intra` and `across`. A −inf log decay (a
    reset) is carried as a reset count beside the finite cumulative sums
    (`segments.cumulative_log_decay`): a factor spanning a reset is exactly 0, and no −inf
    enters a difference. Every factor is masked before `exp` and has an exponent ≤ 0, so none
    overflows.
    """

    def __init__(self, a_BHGCX, G, C):
        tril_CC = jnp.tril(jnp.ones((C, C), dtype=bool))
        strict_GG = jnp.tril(jnp.ones((G, G), dtype=bool), -1)
        if a_BHGCX is None:
            self.intra = tril_CC.astype(jnp.float32)
            self.across = strict_GG[:, :, None].astype(jnp.float32)
            self.start = self.end = self.step_start = self.step_end = self.step_total = None
            self.b = self.n = None
            return
        b, n = cumulative_log_decay(a_BHGCX, axis=-2, by_matmul=True)
        self.b, self.n = b, n
        gt, nt = b[..., -1, :], n[..., -1, :]  # [B, H, G, X]
        c_next, nc_next = jnp.cumsum(gt, axis=2), jnp.cumsum(nt, axis=2)
        c, nc = _exclusive(c_next), _exclusive(nc_next)
        c_end, nc_end = c_next[:, :, -1], nc_next[:, :, -1]  # [B, H, X]
        if a_BHGCX.shape[-1] == 1:
            self.intra = pair_decays(b[..., 0], n[..., 0])
        self.start = masked_exp(n == 0, b)
        self.end = masked_exp(n == nt[..., None, :], gt[..., None, :] - b)
        keep = strict_GG[:, :, None] & (nc[:, :, :, None] == nc_next[:, :, None, :])
        self.across = masked_exp(keep, c[:, :, :, None] - c_next[:, :, None, :])
        self.step_start = masked_exp(nc == 0, c)
        self.step_end = masked_exp(nc_end[:, :, None] == nc_next, c_end[:, :, None] - c_next)
        self.step_total = masked_exp(nc_end == 0, c_end)


def _exclusive(x_BHGX):
    """Exclusive prefix along the chunk axis, from the inclusive one."""
    return jnp.concatenate([jnp.zeros_like(x_BHGX[:, :, :1]), x_BHGX[:, :, :-1]], axis=2)


def _scores(d: _Decays, sub, q_n, k_n):
    """The decayed, causally masked intra-chunk scores [B, H, G, C, C]."""
    if sub is not None:
        return sub.scores(q_n, k_n)
    return (q_n @ _tr(k_n)) * d.intra


def _mul(x, w):
    """x * w, a [B, H, G(, ...), X] weight over the state rows of x; w None means 1."""
    if w is None:
        return x
    return x * w.reshape(w.shape + (1,) * (x.ndim - w.ndim))


def _combine(w_BHGGX, x_BHG, transpose=False):
    """Σ_k w[g, k] x[k] (or w[k, g] with `transpose`) over the G chunks of a step, per row m."""
    B, H, G, M = x_BHG.shape[:4]
    w_BHGGX = jnp.broadcast_to(w_BHGGX, (B, H, G, G, w_BHGGX.shape[-1]))
    x_BHGMF = x_BHG.reshape(B, H, G, M, -1)
    if w_BHGGX.shape[-1] == 1:
        spec = "bhkg,bhkf->bhgf" if transpose else "bhgk,bhkf->bhgf"
        out = jnp.einsum(spec, w_BHGGX[..., 0], x_BHGMF.reshape(B, H, G, -1))
    else:
        spec = "bhkgm,bhkmf->bhgmf" if transpose else "bhgkm,bhkmf->bhgmf"
        out = jnp.einsum(spec, w_BHGGX, x_BHGMF)
    return out.reshape(x_BHG.shape)


def _advance(d: _Decays, s, u_BHG):
    """States entering each chunk of the step, and the state leaving it (kv or z)."""
    if s is None:
        return None, None
    entering = _mul(s[:, :, None], d.step_start) + _combine(d.across, u_BHG)
    return entering, _mul(s, d.step_total) + jnp.sum(_mul(u_BHG, d.step_end), axis=2)


def _retreat(d: _Decays, g, w_BHG):
    """Cotangents of the states leaving each chunk, and of the state entering the step."""
    if g is None:
        return None, None
    leaving = _mul(g[:, :, None], d.step_end) + _combine(d.across, w_BHG, transpose=True)
    return leaving, _mul(g, d.step_total) + jnp.sum(_mul(w_BHG, d.step_start), axis=2)


def _step_decays(a_n, GC, vector):
    """The step's decay factors and, for a decay per key dimension, its sub-block factors."""
    G, C = GC
    d = _Decays(a_n, G, C)
    sub = SubBlocks(d.b, d.n, sub_block_size(C)) if vector else None
    return d, sub


def _forward(q_BTHM, k_BTHM, v_BTHD, a_BTHX, kv0_BHMD, z0_BHM, guard, GC, normalize, eps, keep):
    """Walk the steps in order. With `keep`, also return the state entering every chunk."""
    G, C = GC
    q, k, v = (_split(x, GC) for x in (q_BTHM, k_BTHM, v_BTHD))
    a = None if a_BTHX is None else _split(a_BTHX, GC)
    vector = a is not None and a.shape[-1] > 1
    flags = _split_guard(guard, GC)

    def step(carry, n):
        kv_BHMD, z_BHM, o_all = carry
        q_n, k_n, v_n, a_n, ok_n, poisoned_n = _step_slice(n, q, k, v, a, *flags)
        k_n, v_n = _clean(ok_n, k_n, v_n)
        d, sub = _step_decays(a_n, GC, vector)

        # ---- 2. intra-chunk: masked, decayed C×C scores ----
        s_BHGCC = _scores(d, sub, q_n, k_n)
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
        if poisoned_n is not None:
            o_BHGCD = jnp.where(poisoned_n, jnp.nan, o_BHGCD)
        return (kv_next, z_next, _put(o_all, n, o_BHGCD)), ((p_BHGMD, pz_BHGM) if keep else None)

    init = (kv0_BHMD, z0_BHM, jnp.zeros_like(v))
    (kv_BHMD, z_BHM, o), entering = jax.lax.scan(step, init, jnp.arange(q.shape[1]))
    return (_merge(o), kv_BHMD, z_BHM), entering


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _chunked(q_BTHM, k_BTHM, v_BTHD, a_BTHX, kv0_BHMD, z0_BHM, guard, GC, normalize, eps):
    args = (q_BTHM, k_BTHM, v_BTHD, a_BTHX, kv0_BHMD, z0_BHM, guard, GC, normalize, eps)
    return _forward(*args, keep=False)[0]


def _chunked_fwd(q_BTHM, k_BTHM, v_BTHD, a_BTHX, kv0_BHMD, z0_BHM, guard, GC, normalize, eps):
    args = (q_BTHM, k_BTHM, v_BTHD, a_BTHX, kv0_BHMD, z0_BHM, guard, GC, normalize, eps)
    outputs, entering = _forward(*args, keep=True)
    o_BTHD, kv_BHMD, z_BHM = outputs
    # Residuals: inputs, outputs and the state entering each chunk (one per chunk, not per token).
    residuals = (q_BTHM, k_BTHM, v_BTHD, a_BTHX, o_BTHD, kv_BHMD, z_BHM, guard, entering)
    return outputs, residuals


def _chunked_bwd(GC, normalize, eps, residuals, cotangents):
    """The pullback of `_forward`: a reverse `lax.scan` over groups of chunks carrying the
    cotangent of the state (and of the normaliser's running sum), one state per chunk read
    from the residuals; then the decays' cotangent (`_decay_grad`). Its `step` stays one
    function because its four parts (the recomputed scores and normaliser, the states' cotangents,
    the intra-chunk and the inter-chunk terms) all read the chunk's recomputed decays and
    scores: apart, each would take a dozen of the same arrays."""
    q_BTHM, k_BTHM, v_BTHD, a_BTHX, o_BTHD, kv_BHMD, z_BHM, guard, (p_all, pz_all) = residuals
    do_BTHD, dkv_BHMD, dz_BHM = cotangents
    q, k, v, o, do = (_split(x, GC) for x in (q_BTHM, k_BTHM, v_BTHD, o_BTHD, do_BTHD))
    a = None if a_BTHX is None else _split(a_BTHX, GC)
    vector = a is not None and a.shape[-1] > 1
    flags = _split_guard(guard, GC)

    def step(carry, n):
        (g_BHMD, gz_BHM), (dq_all, dk_all, dv_all, db_all) = carry
        q_n, k_n, v_n, o_n, do_n, a_n, ok_n, poisoned_n = _step_slice(n, q, k, v, o, do, a, *flags)
        k_n, v_n = _clean(ok_n, k_n, v_n)
        if poisoned_n is not None:  # a NaN output depends on nothing: its cotangent stops here
            o_n, do_n = jnp.where(poisoned_n, 0.0, o_n), jnp.where(poisoned_n, 0.0, do_n)
        p_BHGMD = p_all[n]
        pz_BHGM = None if pz_all is None else pz_all[n]
        d, sub = _step_decays(a_n, GC, vector)
        q_start, k_end = _mul(q_n, d.start), _mul(k_n, d.end)

        # ---- recompute scores and normaliser; cotangents of numerator and normaliser ----
        s_BHGCC = _scores(d, sub, q_n, k_n)
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
        if sub is None:
            dov *= d.intra
            dq, dk = dov @ k_n, _tr(dov) @ q_n
        else:
            dq, dk = sub.grads(dov, q_n, k_n)
        dv = _tr(s_BHGCC) @ dnum

        # ---- inter-chunk: through the states entering (p) and leaving (gl) each chunk ----
        dq_in = dnum @ _tr(p_BHGMD)
        if dden is not None:
            dq_in += dden[..., None] * pz_BHGM[..., None, :]
        dk_in = v_n @ _tr(gl_BHGMD)
        if gzl_BHGM is not None:
            dk_in += gzl_BHGM[..., None, :]
        dq += dq_in if d.start is None else dq_in * d.start
        dk += dk_in if d.end is None else dk_in * d.end
        dv += k_end @ gl_BHGMD

        grads = (_put(dq_all, n, dq), _put(dk_all, n, dk), _put(dv_all, n, dv))
        if db_all is not None:  # dL/dB_t = q_t·dq_t − k_t·dk_t, per key dimension if vector
            db = q_n * dq - k_n * dk
            db_all = _put(db_all, n, db if vector else jnp.sum(db, -1, keepdims=True))
        return ((g_BHMD, gz_BHM), (*grads, db_all)), None

    db0 = None if a is None else jnp.zeros_like(a)  # zeros_like: typed like a in shard_map
    zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), db0)
    ((dkv0_BHMD, dz0_BHM), (dq, dk, dv, db)), _ = jax.lax.scan(
        step, ((dkv_BHMD, dz_BHM), zeros), jnp.arange(q.shape[1]), reverse=True
    )

    da_BTHX = None
    if a_BTHX is not None:
        da_BTHX = _decay_grad(a_BTHX, _merge(db), (kv_BHMD, z_BHM), (dkv_BHMD, dz_BHM), vector)
    return _merge(dq), _merge(dk), _merge(dv), da_BTHX, dkv0_BHMD, dz0_BHM, None


def _decay_grad(a_BTHX, db_BTHX, final, dfinal, vector: bool):
    """dL/da_s: dL/dB_t (+ ⟨dS, S⟩ of the final state at the end) summed over t ≥ s, up to the
    next reset; per key dimension if `vector`."""
    kv_BHMD, z_BHM = final
    dkv_BHMD, dz_BHM = dfinal
    end_BHM = jnp.sum(dkv_BHMD * kv_BHMD, axis=-1)
    if z_BHM is not None:
        end_BHM += dz_BHM * z_BHM
    end_BHX = end_BHM if vector else jnp.sum(end_BHM, -1, keepdims=True)
    return suffix_sum_to_reset(db_BTHX.at[:, -1].add(end_BHX), jnp.isneginf(a_BTHX))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)

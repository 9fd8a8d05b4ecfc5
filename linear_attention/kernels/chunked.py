"""Chunkwise-parallel causal linear attention: the training path.

Split time into N chunks of C tokens. With b_t the cumulative log decay inside a chunk (b_t ≤ 0)
and g = b_C its total, the state P_n entering chunk n gives, for t in chunk n,

    o_t     = Σ_{s ≤ t in chunk} exp(b_t − b_s) (q_t·k_s) v_s   +   exp(b_t) q_tᵀ P_n
              └──────── intra-chunk: dense C×C matmuls ───────┘   └─ inter-chunk ─┘
    P_{n+1} = exp(g) P_n + Σ_{s in chunk} exp(g − b_s) k_s v_sᵀ

Work is O(T·C·M + T·M·Dv); the only sequential part is the prefix over N chunk states.

The backward pass is a custom VJP. It keeps one state per chunk (never one per token) and runs
the same recurrence in reverse on the state cotangents, G_n = exp(g_n) G_{n+1} + Σ_t exp(b_t) q_t do_tᵀ.
The decay gradient needs no extra pass: every term of the output carries exp(B_query − B_key)
for the global cumulative decay B, so dL/dB_t = q_t·dq_t − k_t·dk_t (+ ⟨dS_T, S_T⟩ at the end),
and dL/da_s = Σ_{t ≥ s} dL/dB_t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def causal_chunked(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD, *, chunk_size: int):
    """Unnormalised causal linear attention, chunkwise; float32 in, `(o_BTHD, s_BHMD)` out."""
    T = q_BTHM.shape[1]
    C = min(chunk_size, T)

    # ---- 1. pad time to a multiple of C (zero keys/values and zero log decay change nothing) ----
    pad = -T % C
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q_BTHM, k_BTHM, v_BTHD = (jnp.pad(x, widths) for x in (q_BTHM, k_BTHM, v_BTHD))
        if a_BTH is not None:
            a_BTH = jnp.pad(a_BTH, widths[:3])
    o_BTHD, s_BHMD = _chunked(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD, C)
    return o_BTHD[:, :T], s_BHMD


def _split(x_BT, C):
    """[B, T, ...] -> [B, N, C, ...] (a free reshape)."""
    return x_BT.reshape(x_BT.shape[0], x_BT.shape[1] // C, C, *x_BT.shape[2:])


def _merge(x_BNC):
    return x_BNC.reshape(x_BNC.shape[0], -1, *x_BNC.shape[3:])


def _decays(a_BTH, C):
    """Per-chunk cumulative log decay b [B,N,C,H], chunk totals g [B,N,H], intra mask [B,N,H,C,C].

    The mask holds exp(b_t − b_s) for s ≤ t and 0 above the diagonal, masked before exp.
    """
    causal_CC = jnp.tril(jnp.ones((C, C), dtype=bool))
    if a_BTH is None:
        return None, None, causal_CC.astype(jnp.float32)
    b_BNCH = jnp.cumsum(_split(a_BTH, C), axis=2)
    g_BNH = b_BNCH[:, :, -1]
    b_BNHC = jnp.moveaxis(b_BNCH, 2, 3)
    diff_BNHCC = jnp.where(causal_CC, b_BNHC[..., :, None] - b_BNHC[..., None, :], -jnp.inf)
    return b_BNCH, g_BNH, jnp.exp(diff_BNHCC)


def _scale(x_BNCHM, w_BNCH):
    return x_BNCHM if w_BNCH is None else x_BNCHM * w_BNCH[..., None]


def _state_prefix(s0_BHMD, g_BNH, u_BNHMD, reverse=False):
    """P_{n+1} = exp(g_n) P_n + U_n over chunks; returns (last carry, the carry entering each n)."""

    def step(s_BHMD, inputs):
        g_BH, u_BHMD = inputs
        nxt = u_BHMD + (s_BHMD if g_BH is None else jnp.exp(g_BH)[..., None, None] * s_BHMD)
        return nxt, s_BHMD

    g_NBH = None if g_BNH is None else jnp.moveaxis(g_BNH, 1, 0)
    last, entering_NBHMD = jax.lax.scan(
        step, s0_BHMD, (g_NBH, jnp.moveaxis(u_BNHMD, 1, 0)), reverse=reverse
    )
    return last, jnp.moveaxis(entering_NBHMD, 0, 1)


def _forward(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD, C):
    q, k, v = (_split(x, C) for x in (q_BTHM, k_BTHM, v_BTHD))
    b_BNCH, g_BNH, mask_BNHCC = _decays(a_BTH, C)

    # ---- 2. intra-chunk: masked, decayed C×C scores times values ----
    scores_BNHCC = jnp.einsum("bnchm,bnshm->bnhcs", q, k) * mask_BNHCC
    o_BNCHD = jnp.einsum("bnhcs,bnshd->bnchd", scores_BNHCC, v)

    # ---- 3. inter-chunk: prefix over chunk states, read by the decayed queries ----
    to_end_BNCH = None if g_BNH is None else jnp.exp(g_BNH[:, :, None] - b_BNCH)
    u_BNHMD = jnp.einsum("bnchm,bnchd->bnhmd", _scale(k, to_end_BNCH), v)
    s_BHMD, p_BNHMD = _state_prefix(s0_BHMD, g_BNH, u_BNHMD)
    from_start_BNCH = None if b_BNCH is None else jnp.exp(b_BNCH)
    o_BNCHD += jnp.einsum("bnchm,bnhmd->bnchd", _scale(q, from_start_BNCH), p_BNHMD)

    # ---- 4. finish: back to [B, T, H, Dv] ----
    return _merge(o_BNCHD), s_BHMD, p_BNHMD


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunked(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD, C):
    o_BTHD, s_BHMD, _ = _forward(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD, C)
    return o_BTHD, s_BHMD


def _chunked_fwd(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD, C):
    o_BTHD, s_BHMD, p_BNHMD = _forward(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD, C)
    # Residuals: the inputs and one state per chunk; score matrices are recomputed.
    return (o_BTHD, s_BHMD), (q_BTHM, k_BTHM, v_BTHD, a_BTH, s_BHMD, p_BNHMD)


def _chunked_bwd(C, residuals, cotangents):
    q_BTHM, k_BTHM, v_BTHD, a_BTH, s_BHMD, p_BNHMD = residuals
    do_BTHD, ds_BHMD = cotangents
    q, k, v, do = (_split(x, C) for x in (q_BTHM, k_BTHM, v_BTHD, do_BTHD))
    b_BNCH, g_BNH, mask_BNHCC = _decays(a_BTH, C)
    from_start_BNCH = None if b_BNCH is None else jnp.exp(b_BNCH)
    to_end_BNCH = None if g_BNH is None else jnp.exp(g_BNH[:, :, None] - b_BNCH)

    # ---- 1. state cotangents, chunk by chunk in reverse: G_n = exp(g_n) G_{n+1} + W_n ----
    w_BNHMD = jnp.einsum("bnchm,bnchd->bnhmd", _scale(q, from_start_BNCH), do)
    ds0_BHMD, g_after_BNHMD = _state_prefix(ds_BHMD, g_BNH, w_BNHMD, reverse=True)

    # ---- 2. intra-chunk gradients (scores recomputed) ----
    dov_BNHCC = jnp.einsum("bnchd,bnshd->bnhcs", do, v) * mask_BNHCC
    qk_BNHCC = jnp.einsum("bnchm,bnshm->bnhcs", q, k) * mask_BNHCC
    dq = jnp.einsum("bnhcs,bnshm->bnchm", dov_BNHCC, k)
    dk = jnp.einsum("bnhcs,bnchm->bnshm", dov_BNHCC, q)
    dv = jnp.einsum("bnhcs,bnchd->bnshd", qk_BNHCC, do)

    # ---- 3. inter-chunk gradients through the chunk states ----
    dq += _scale(jnp.einsum("bnchd,bnhmd->bnchm", do, p_BNHMD), from_start_BNCH)
    dk += _scale(jnp.einsum("bnchd,bnhmd->bnchm", v, g_after_BNHMD), to_end_BNCH)
    dv += _scale(jnp.einsum("bnchm,bnhmd->bnchd", k, g_after_BNHMD), to_end_BNCH)
    dq_BTHM, dk_BTHM, dv_BTHD = _merge(dq), _merge(dk), _merge(dv)

    # ---- 4. decay: dL/dB_t = q_t·dq_t − k_t·dk_t (+ ⟨dS, S⟩ at the end), reverse cumsum ----
    da_BTH = None
    if a_BTH is not None:
        db_BTH = jnp.sum(q_BTHM * dq_BTHM, -1) - jnp.sum(k_BTHM * dk_BTHM, -1)
        db_BTH = db_BTH.at[:, -1].add(jnp.sum(ds_BHMD * s_BHMD, axis=(-2, -1)))
        da_BTH = jnp.flip(jnp.cumsum(jnp.flip(db_BTH, 1), axis=1), 1)
    return dq_BTHM, dk_BTHM, dv_BTHD, da_BTH, ds0_BHMD


_chunked.defvjp(_chunked_fwd, _chunked_bwd)

"""The delta rule's chunk form on Hopper: the UT transform and the intra-chunk scores from XLA,
the chunk walk as Mosaic GPU kernels (`delta_rule(method="pallas")` on a GPU: DeltaNet, Gated
DeltaNet with grouped value heads, KDA).

Per chunk of C tokens, with b the cumulative log decay inside it (per head, or per key channel
for KDA; −inf resets counted apart and masked before `exp`, `segments.cumulative_log_decay`)
and S `[K, Dv]` the state entering it (`delta.py` derives the lines):

    U = (I + A)⁻¹ diag(β) V,   W = (I + A)⁻¹ diag(β) (K ⊙ e^b)
    A_ts = β_t Σ_m k_tm k_sm e^{b_tm − b_sm} (s < t),   P_ts = Σ_m q_tm k_sm e^{b_tm − b_sm} (s ≤ t)
    X = U − W S,   O = (Q ⊙ e^b) S + P X,   S' = e^{b_C} ⊙ S + (K ⊙ e^{b_C − b})ᵀ X

U, W, P and the decayed q and k depend on the chunk's own tokens only. XLA makes them for every
chunk at once (the chunk form's own code: `chunk_terms.scalar_terms` for a per-head decay or none;
`chunk_terms.per_key_forward` with its hand-written pullback `per_key_backward` per key channel,
as many chunks at a time as a step of the XLA chunk form takes, `chunk_scan.chunks_per_step`: a
chunk's `[16, 16, K]` sub-block decays are 16 times its k in float32, so only one group's are held
at once): the sub-block scores need row gathers of float32 decays and the 16 × 16 inverses a
sequence of small matmuls, which Mosaic GPU's 64-row wgmma tiles do not express, as for GLA
(`linear/pallas_gpu_key.py`). The sequential part, the three lines in S, is the walk of
`pallas_gpu_key.key_decay_walk` with `w`: one thread block per (batch row · head, 64-wide value
tile), the chunks in order, the state in registers, X = U − W S, P X, Qₛ S and Eᵀ X on the tensor
cores (wgmma), the chunks brought in by TMA two stages ahead. Its backward kernel walks the chunks
last to first with the state cotangent dS:

    dX = Pᵀ dO + E dS',  dU = dX,  dP = dO Xᵀ,  dQₛ = dO Sᵀ,  dE = X dS'ᵀ
    d e^{b_C} = Σ_v S ⊙ dS',   dS = Qₛᵀ dO + e^{b_C} ⊙ dS' − Wᵀ dX

(dW = −dX Sᵀ is one matmul per chunk in XLA, from dX and the states the forward kernel kept:
inside, each value tile would return its own float32 share of it)

and the terms' cotangents go back to q, k, v, β and the log decays through XLA (autodiff of the
per-head terms; `per_key_backward` per key channel). What the walk keeps per chunk is the
state entering it (float32), as the XLA chunk form's remat does.

Numerics: U, W, Q ⊙ e^b and K ⊙ e^{b_C − b} reach the kernels in the input dtype (the wgmma
operands: bfloat16 or float16 compiled; float32 runs only interpreted), P in float32 (rounded
in the kernel); the state, X and every accumulation are float32, rounded to the input dtype
only as the operands of the next matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.kernels.delta.chunk_terms import (
    per_key_backward,
    per_key_forward,
    scalar_terms,
)
from linear_attention.kernels.linear.pallas_gpu_key import key_decay_walk
from linear_attention.kernels.primitives import mosaic_gpu as mg
from linear_attention.kernels.primitives.chunk_scan import chunks_per_step
from linear_attention.kernels.primitives.decays import sub_block_size
from linear_attention.kernels.primitives.layout import pad_last, pad_time, to_chunks
from linear_attention.kernels.primitives.pallas import round_up
from linear_attention.kernels.segments import cumulative_log_decay

# Key and value channels are padded to this (a wgmma K tile of 128-byte swizzled bfloat16 rows;
# the walk's value tile).
TILE = 64
# Shared memory past an H100's raises before compiling.
_check_smem = functools.partial(mg.check_smem, what='delta_rule(method="pallas")', tile=TILE)


def delta_pallas_gpu(q_BTHK, k_BTHK, v_BTHD, beta_BTH, a_BTH, s0_BHKD, *, chunk_size, interpret):
    """The delta rule by the Mosaic GPU walk (module docstring): q, k `[B, T, H, K]` and v
    `[B, T, H, Dv]` in their input dtype (value heads already expanded), β `[B, T, H]` float32,
    the log decay None, `[B, T, H]` or `[B, T, H, K]`, the float32 initial state `s0_BHKD`.
    `chunk_size` a multiple of 64. Returns `(o_BTHD in result_type(q, k, v), s_BHKD)`."""
    what = 'delta_rule(method="pallas") on GPU'
    if chunk_size % mg.WGMMA_ROWS:
        raise ValueError(
            f"chunk_size must be a multiple of {mg.WGMMA_ROWS} for {what} (a chunk is whole "
            f"wgmma row tiles), got {chunk_size}"
        )
    dtype = jnp.result_type(q_BTHK, k_BTHK, v_BTHD)
    if not interpret and jnp.dtype(dtype).itemsize != 2:
        raise ValueError(
            f"{what}: q, k and v must be bfloat16 or float16, the wgmma operand types (a "
            "float32 operand is tf32 on the tensor cores and takes no transposed operand), got "
            f"{jnp.dtype(dtype).name}; with axis_name each shard's call computes in float32, so "
            'a split run cannot use it. Cast the inputs, or use method="chunk"'
        )
    B, T, H, Kd = q_BTHK.shape
    Dv = v_BTHD.shape[-1]
    C = chunk_size
    Kp, Dp = round_up(Kd, TILE), round_up(Dv, TILE)
    # zero channels and tokens change nothing: a padded token has zero β, k and log decay
    f32 = jnp.float32
    # in the input dtype until the terms are made: a float32 copy of q, k, v made apart (or
    # kept for the backward pass) would be twice their size
    q, k = (pad_last(pad_time(x.astype(dtype), C), Kp) for x in (q_BTHK, k_BTHK))
    v = pad_last(pad_time(v_BTHD.astype(dtype), C), Dp)
    beta = pad_time(beta_BTH.astype(f32), C)
    q, k, v, beta = (to_chunks(x, C) for x in (q, k, v, beta))  # [N, B, H, C, ...]
    if a_BTH is not None and a_BTH.ndim == 4:
        a = to_chunks(pad_last(pad_time(a_BTH, C), Kp), C)
        u, w, p, qs, ke, total = _grouped_key_terms(q, k, v, beta, a)
    else:
        a = None if a_BTH is None else to_chunks(pad_time(a_BTH, C), C)
        u, w, p, qs, ke, total = scalar_terms(*(x.astype(f32) for x in (q, k, v)), beta, a, C)
        if total is None:
            total = jnp.ones(q.shape[:3], f32)
        total = jnp.broadcast_to(total[..., None], (*total.shape, Kp))
    s0 = pad_last(jnp.pad(s0_BHKD, ((0, 0), (0, 0), (0, Kp - Kd), (0, 0))), Dp)
    out, s = key_decay_walk(
        _rows(p),
        *(_time_major(x).astype(dtype) for x in (qs, ke, u)),
        jnp.moveaxis(total, 0, 2),
        s0,
        w=_time_major(w).astype(dtype),
        C=C,
        V=TILE,
        interpret=interpret,
        check_smem=_check_smem,
        name="delta_rule",
    )
    return out[:, :T, :, :Dv], s[:, :, :Kd, :Dv]


def _time_major(x_NBHCX):
    """`[N, B, H, C, X]` -> `[B, N·C, H, X]`."""
    N, B, H, C, X = x_NBHCX.shape
    return jnp.moveaxis(x_NBHCX, (0, 2), (1, 3)).reshape(B, N * C, H, X)


def _rows(p_NBHCC):
    """`[N, B, H, C, C]` -> `[B, H, N·C, C]`: each chunk's scores, query rows in time order."""
    N, B, H, C, _ = p_NBHCC.shape
    return jnp.moveaxis(p_NBHCC, 0, 2).reshape(B, H, N * C, C)


def _grouped_key_terms(q, k, v, beta, a):
    """The per-key-channel terms `(U, W, P, Q ⊙ e^b, E, e^{b_C})` of every chunk, chunk-major,
    a step of the XLA chunk form's chunks at a time (`lax.map`)."""
    N, C = q.shape[0], q.shape[3]
    b, n = cumulative_log_decay(a, axis=-2, restart=True)  # outside the VJP: autodiff to a
    terms = functools.partial(_key_terms, c=sub_block_size(C))
    group = chunks_per_step(C, N)
    return jax.lax.map(lambda xs: terms(*xs), (q, k, v, beta, b, n), batch_size=group)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _key_terms(q, k, v, beta, b, n, c):
    """`(U, W, P, Q ⊙ e^b, E, e^{b_C})` of chunks `[..., C, ·]` with a decay per key channel
    (`chunk_terms.per_key_forward`, in float32), differentiated by its hand-written pullback; q, k,
    v in their dtype (the walk's operand dtype), which U, W, Q ⊙ e^b and E take."""
    return _key_terms_fwd(q, k, v, beta, b, n, c)[0]


def _key_terms_fwd(q, k, v, beta, b, n, c):
    xs = (*(x.astype(jnp.float32) for x in (q, k, v)), beta, b, n)
    terms, _ = per_key_forward(*xs, c=c)
    w_neg, u, qs, p, _, e, _, total = terms
    dtype = q.dtype
    out = (u.astype(dtype), (-w_neg).astype(dtype), p, qs.astype(dtype), e.astype(dtype), total)
    # only the inputs are kept (q, k, v in their dtype): the terms' residuals (the inverse, U,
    # W, the scores; a few [C, C] and [C, K] float32 arrays per chunk, more than the walk keeps)
    # are made again in the backward pass, a group at a time
    return out, (q, k, v, beta, b, n)


def _key_terms_bwd(c, saved, cotangents):
    q, k, v, beta, b, n = saved
    xs = (*(x.astype(jnp.float32) for x in (q, k, v)), beta, b, n)
    du, dw, dp, dqs, de, dtotal = (x.astype(jnp.float32) for x in cotangents)
    _, res = per_key_forward(*xs, c=c)
    _, pullback = per_key_backward(xs, res, c=c)
    # the walk's products P U and Eᵀ U are the kernels', whose cotangents come as dU, dP, dE
    dq, dk, dv, dbeta, db, _ = pullback(-dw, du, dqs, dp, None, de, None, dtotal)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbeta, db, None


_key_terms.defvjp(_key_terms_fwd, _key_terms_bwd)

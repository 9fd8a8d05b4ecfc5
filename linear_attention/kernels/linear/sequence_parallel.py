"""Causal linear attention with time split over a mesh axis (LASP-2), on the shared combine.

A span's update is S_out = diag(exp(Σ a_t)) S_in + U, the diagonal transition of linear
attention (per head or per key dimension; 0 after a reset): every shard runs the local kernel
from a zero state (the normaliser rides along as one more value column), the summaries compose
over shards by `primitives.combine.prefix`, and each shard adds q_tᵀ diag(exp(b_t)) S_in to its
outputs, b_t the cumulative log decay from the span's start. See `primitives/combine.py`.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.primitives.combine import prefix, vary_like
from linear_attention.kernels.primitives.nan_guard import clean_log_decay
from linear_attention.kernels.state import LinearAttentionState


def linear_sequence_parallel(local, qkva, state0, axis_name, normalize, eps):
    """Causal linear attention with time split over `axis_name`, on float32 arrays.

    `local(q, k, v, log_decay=, return_state=True)` is the unsplit kernel, unnormalised, from a
    zero state. `qkva = (q_BTHM, k_BTHM, v_BTHD, a_BTH)` with the log decay `[B,T,H]`,
    `[B,T,H,M]` or None and the shard's resets folded in (its first token's too);
    `state0 = (kv0_BHMD, z0_BHM)`, `z0_BHM` None when the normaliser state is not tracked.
    Returns `(o_BTHD, kv_BHMD, z_BHM)` with the global final state.
    """
    q_BTHM, k_BTHM, v_BTHD, a_BTH = qkva
    kv0_BHMD, z0_BHM = state0
    B, T, H, M = q_BTHM.shape
    Dv = v_BTHD.shape[-1]
    a_BTH = vary_like(a_BTH, q_BTHM)

    # ---- 1. local outputs and summary from a zero state (normaliser: a value that is 1) ----
    with_sum = normalize or z0_BHM is not None
    if normalize:
        v_BTHD = jnp.concatenate([v_BTHD, jnp.ones((B, T, H, 1), jnp.float32)], axis=-1)
    Dx = v_BTHD.shape[-1]
    zero = LinearAttentionState(
        kv=vary_like(jnp.zeros((B, H, M, Dx), jnp.float32), q_BTHM),
        k_sum=vary_like(jnp.zeros((B, H, M), jnp.float32), q_BTHM),
    )
    out_BTHD, u_state = local(
        q_BTHM, k_BTHM, v_BTHD, log_decay=a_BTH, initial_state=zero, return_state=True
    )
    # NaN outputs (tokens a bad key or value reaches) are set aside and marked again at the end:
    # kept in the sums below, their zero cotangents would meet NaN (0·NaN) in the gradient
    poisoned_BTH = ~jnp.all(jnp.isfinite(out_BTHD), axis=-1)
    out_BTHD = jnp.where(poisoned_BTH[..., None], 0.0, out_BTHD)
    u_BHMD = u_state.kv[..., :Dv]
    s0_BHMD = kv0_BHMD
    if with_sum:  # the normaliser state rides along as one more value column
        u_BHMD = jnp.concatenate([u_BHMD, u_state.k_sum[..., None]], axis=-1)
        z0 = jnp.zeros((B, H, M), jnp.float32) if z0_BHM is None else z0_BHM
        s0_BHMD = jnp.concatenate([kv0_BHMD, z0[..., None]], axis=-1)
    # the local kernel read it raw (a NaN marks its outputs and summary), the weights read it clean
    a_BTH = clean_log_decay(a_BTH)
    if a_BTH is None:
        w_BTHM = None
        A_BHM1 = jnp.ones((B, H, 1, 1), jnp.float32)
        reset_BTH = jnp.zeros((B, T, H), bool)
    else:
        b_BTH = jnp.cumsum(a_BTH, axis=1)  # −inf after a reset: exp gives 0, never NaN
        w_BTHM = jnp.exp(b_BTH if a_BTH.ndim == 4 else b_BTH[..., None])
        A_BHM1 = w_BTHM[:, -1, :, :, None]
        # a reset forgets the entering state only if it spans every key dimension (`linear.py`)
        reset_BTH = jnp.isneginf(b_BTH)
        reset_BTH = jnp.all(reset_BTH, -1) if a_BTH.ndim == 4 else reset_BTH

    # ---- 2. gather the summaries, compose them over shards ----
    s_in_BHMD, bad_in_BH, s_out_BHMD = prefix(
        A_BHM1, u_BHMD, s0_BHMD, reset_BTH[:, -1], axis_name, lambda A, S: A * S
    )

    # ---- 3. the entering state's contribution; a bad one reaches tokens up to a reset ----
    qw_BTHM = q_BTHM if w_BTHM is None else q_BTHM * w_BTHM
    carry_BTHD = jnp.einsum("bthm,bhmd->bthd", qw_BTHM, s_in_BHMD)
    o_BTHD = out_BTHD[..., :Dv] + carry_BTHD[..., :Dv]
    if normalize:
        den_BTH = out_BTHD[..., Dv] + carry_BTHD[..., Dv]
        o_BTHD = o_BTHD / (den_BTH[..., None] + eps)
    reached_BTH = poisoned_BTH | (bad_in_BH[:, None] & ~reset_BTH)
    o_BTHD = jnp.where(reached_BTH[..., None], jnp.nan, o_BTHD)
    kv_BHMD = s_out_BHMD[..., :Dv]
    z_BHM = s_out_BHMD[..., Dv] if z0_BHM is not None else None
    return o_BTHD, kv_BHMD, z_BHM

"""Causal linear attention as a recurrence: `jax.lax.scan` over time, and one decoding step.

    S_t = diag(exp(a_t)) S_{t-1} + k_t v_tᵀ,   o_t = q_tᵀ S_t

with a_t a log decay per head (a scalar) or per key dimension (a vector scaling the rows of S).
A log decay of −inf is a reset: it selects a zero state (`segments.decay_state`).

The scan is the sequential RNN view: O(T) time, O(1) state, no parallelism over time; its
autodiff keeps a state per token, so it is a reference and a decoding path, not a training path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import (
    check_eps,
    check_float,
    check_layouts,
    check_log_decay,
    check_static,
)
from linear_attention.kernels.segments import decay_state
from linear_attention.kernels.state import LinearAttentionState, check_state


def causal_scan(q_BTHM, k_BTHM, v_BTHD, a_BTH, s0_BHMD):
    """Unnormalised causal linear attention by `lax.scan`; returns `(o_BTHD, s_BHMD)`.

    `a_BTH`: `[B, T, H]`, `[B, T, H, M]` or None."""

    def step(s_BHMD, inputs):
        q_BHM, k_BHM, v_BHD, a_BH = inputs
        if a_BH is not None:
            s_BHMD = decay_state(_rows(a_BH), s_BHMD)
        s_BHMD = s_BHMD + k_BHM[..., :, None] * v_BHD[..., None, :]
        return s_BHMD, jnp.einsum("bhm,bhmd->bhd", q_BHM, s_BHMD)

    time_major = [
        None if x is None else jnp.moveaxis(x, 1, 0) for x in (q_BTHM, k_BTHM, v_BTHD, a_BTH)
    ]
    s_BHMD, o_TBHD = jax.lax.scan(step, s0_BHMD, time_major)
    return jnp.moveaxis(o_TBHD, 0, 1), s_BHMD


def _rows(a):
    """a shaped to scale a [..., M, Dv] state: a is [B, H] (per head) or [B, H, M]."""
    return a[..., None, None] if a.ndim == 2 else a[..., None]


def recurrent_step(
    state: LinearAttentionState, q, k, v, *, log_decay=None, normalize: bool = True, eps=1e-6
):
    """One token of causal linear attention, O(1) in the context length (for decoding).

    Args:
      state: the state after the previous token.
      q, k: featurised query and key of this token `[B, H, M]`.
      v: value `[B, H, Dv]`.
      log_decay: ≤ 0: `[H]` (per head), `[B, H]` (per token and head) or `[B, H, M]` (per key
        dimension, GLA); size-1 axes broadcast; −inf resets the state; None: no decay.
      normalize: divide by q·k_sum + eps; the state's k_sum may be None only without it.
    Returns:
      `(o: [B, H, Dv] in result_type(q, k, v), new state)`.
    """
    check_float(("q", "k", "v"), (q, k, v))
    check_static("normalize", normalize)
    check_eps(eps)
    check_layouts(q=(q, "[B, H, M]"), k=(k, "[B, H, M]"), v=(v, "[B, H, Dv]"))
    B, H, M = q.shape
    check_state(state, B, H, M, v.shape[-1], name="state", need_k_sum=normalize)
    a_BH = check_log_decay(log_decay, (B, H), "[B, H]", feature_dim=M)

    dtype = jnp.result_type(q, k, v)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    kv_BHMD = state.kv.astype(jnp.float32)
    k_sum_BHM = None if state.k_sum is None else state.k_sum.astype(jnp.float32)
    if a_BH is not None:
        kv_BHMD = decay_state(_rows(a_BH), kv_BHMD)
        if k_sum_BHM is not None:
            k_sum_BHM = decay_state(_rows(a_BH)[..., 0], k_sum_BHM)
    kv_BHMD = kv_BHMD + k32[..., :, None] * v32[..., None, :]
    if k_sum_BHM is not None:
        k_sum_BHM = k_sum_BHM + k32
    o_BHD = jnp.einsum("bhm,bhmd->bhd", q32, kv_BHMD)
    if normalize:
        o_BHD = o_BHD / (jnp.einsum("bhm,bhm->bh", q32, k_sum_BHM)[..., None] + eps)
    return o_BHD.astype(dtype), LinearAttentionState(kv=kv_BHMD, k_sum=k_sum_BHM)

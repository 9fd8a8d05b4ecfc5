"""Comba (Hu et al. 2025, "Comba: Improving Bilinear RNNs with Closed-loop Control"; FLA's
`ops/comba`): a delta rule whose removal reads the state through its own key p_t.

Per head, with a scalar decay γ_t = exp(g_t) (g_t ≤ 0), a rate β_t, q scaled by `scale`:

    S̃_t = γ_t S_{t−1}
    S_t = S̃_t + β_t k_t (v_t − S̃_tᵀ p_t)ᵀ                      S: [K, Dv], float32
    o_t = S_tᵀ (scale · q_t)

(FLA's `naive_recurrent_comba`). Comba's output correction, q − D p, is the layer's (the
kernel takes q as given). Expanded, S_t = γ_t S_{t−1} − β_t γ_t k_t (p_tᵀ S_{t−1}) + β_t k_t v_tᵀ:
the diagonal-plus-low-rank delta rule (`delta/dplr.py`: S_t = Diag(e^{w_t}) S_{t−1} +
b_t (a_tᵀ S_{t−1}) + k'_t v_tᵀ, whose low-rank term reads the state before the decay) with

    w_t = g_t (every key channel),   a_t = p_t,   b_t = −β_t γ_t k_t,   k'_t = β_t k_t.

So every method is DPLR's: "chunk" (its generalised UT transform, a hand-written gradient),
"scan" (token by token), `comba_step` its step, `axis_name` its affine combine across shards,
`segment_ids` its resets (the state zeroed before a document start: a_t zeroed there). A −inf
g_t zeroes the state too (γ_t = 0 removes both terms that read it). γ_t enters b_t, so the
gradient of g_t has a part through b beside the decay's; the reduction is exact, not an
approximation of it, and the tests hold both methods to the float64 loop of the recurrence
above (tests/kernels/reference.py, `comba_loop`).
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.checks import check_layouts, check_log_decay, check_static
from linear_attention.kernels.delta.dplr import (
    chunk_flops,
    dplr_chunked,
    dplr_delta_rule,
    dplr_delta_rule_step,
    dplr_scan,
    scan_flops,
)
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.state import LinearAttentionState


def comba(q, k, v, p, beta, *, log_decay=None, scale=None, method="chunk", chunk_size=64,
          initial_state=None, return_state=False, segment_ids=None, axis_name=None):  # fmt: skip
    """Comba over a sequence (module docstring).

    Args:
      q, k, p: `[B, T, H, K]`; v: `[B, T, H, Dv]`; beta: `[B, T, H]` (β, used as given).
      log_decay: g ≤ 0, None (no decay), `[H]` or `[B, T, H]`; −inf zeroes the state.
      scale: the factor of q (None: K^−½, FLA's default).
      method: "chunk" (the DPLR chunk form) or "scan"; chunk_size: tokens per chunk.
      initial_state: `LinearAttentionState(kv=[B, H, K, Dv], k_sum=None)` (None: zeros).
      return_state: also return the state after the last token.
      segment_ids: `[B, T]` integers or a `Segments`: the state is zeroed before every change
        of id.
      axis_name: time split over this `shard_map` axis.
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state` the final state.
    """
    method, chunk_size = COMBA.check(method, chunk_size)
    check_static("return_state", return_state)
    sizes = check_layouts(q=(q, "[B, T, H, K]"), p=(p, "[B, T, H, K]"), beta=(beta, "[B, T, H]"))
    g = check_log_decay(log_decay, (sizes["B"], sizes["T"], sizes["H"]), "[B, T, H]")
    q, k_write, b = _dplr_inputs(q, k, beta, g, scale)
    return dplr_delta_rule(
        q, k_write, v, p, b,
        log_decay=g, method=method, chunk_size=chunk_size, initial_state=initial_state,
        return_state=return_state, segment_ids=segment_ids, axis_name=axis_name,
    )  # fmt: skip


def comba_step(state: LinearAttentionState, q, k, v, p, beta, *, log_decay=None, scale=None):
    """One token of Comba (decoding), O(1) in the context: q, k, p `[B, H, K]`, v `[B, H, Dv]`,
    beta `[B, H]`, log_decay None, `[H]` or `[B, H]`. Returns `(o [B, H, Dv], new state)`."""
    sizes = check_layouts(q=(q, "[B, H, K]"), p=(p, "[B, H, K]"), beta=(beta, "[B, H]"))
    g = check_log_decay(log_decay, (sizes["B"], sizes["H"]), "[B, H]")
    q, k_write, b = _dplr_inputs(q, k, beta, g, scale)
    return dplr_delta_rule_step(state, q, k_write, v, p, b, log_decay=g)


def _dplr_inputs(q, k, beta, g, scale):
    """DPLR's q, k' = β k and b = −β γ k (float32) for Comba's inputs (any leading axes)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    beta = jnp.asarray(beta, jnp.float32)[..., None]
    k32 = jnp.asarray(k, jnp.float32)
    gamma = 1.0 if g is None else jnp.exp(g)[..., None]  # (−inf: 0)
    k_write = (beta * k32).astype(jnp.result_type(k))
    return (q * scale).astype(q.dtype), k_write, -(beta * gamma) * k32


# The family's descriptor (`primitives.family`): DPLR's local kernels and FLOPs (the reduction
# to b and k' is elementwise), its step and state, its time split.
COMBA = Family(
    name="comba",
    methods={
        "chunk": Method(dplr_chunked, chunk_flops, static=("chunk_size",)),
        "scan": Method(dplr_scan, scan_flops),
    },
    step=comba_step,
    state=LinearAttentionState,
    splits_time=True,
)

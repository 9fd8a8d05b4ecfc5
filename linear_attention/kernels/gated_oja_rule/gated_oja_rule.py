"""The gated Oja rule (FLA's `ops/gated_oja_rule`, 2026): the state learns by Oja's rule, the
value v_t acting as the input of a linear neuron whose weights are the state's columns and the
key k_t as the target, with a decay per value channel.

Per head, with state S `[K, Dv]`, the log decay g_t `[Dv]` (γ_t = exp(g_t) ≤ 1), a rate β_t
(one per head) and q scaled by `scale`:

    S̃_t = S_{t−1} Diag(γ_t)                                   each value column decayed
    S_t = S̃_t + β_t (k_t − S̃_t v_t) v_tᵀ                      S: float32
    o_t = S_tᵀ (scale · q_t)

(FLA's `fused_recurrent_oja_fwd_kernel`, the `[K]` read S̃ v and the update on the value side;
its per-value-channel β, which multiplies a `[K]` vector by a `[Dv]` one, is not taken). The
update is S_t = S̃_t (I − β_t v_t v_tᵀ) + β_t k_t v_tᵀ: the delta rule transposed, the roles of k
and v exchanged (a Householder-like transition multiplying the state from the right). Written
as W = Sᵀ it is the delta rule with keys v and values k, but the output reads W along its value
axis (o = W q), which no existing kernel returns: this is no reduction onto `delta_rule` or
`dplr_delta_rule`, and only the `scan` form is shipped. The chunked form (a WY/UT transform of
the right-multiplied transitions, FLA's `chunk.py`) is not done, nor a time split (`axis_name`
is refused: the recurrence is affine in S, but multiplied from the right, which the affine
combine of `primitives.combine` does not take).

Resets: `segment_ids` put a −inf log decay before every document start, and γ = 0 zeroes S̃,
so the token reads and writes a zero state (the library's one reset mechanism); a −inf g_t in
the input does the same for its channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import check_layouts, check_log_decay, check_static
from linear_attention.kernels.delta.checks import check_delta_state, initial_state_f32
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.segments import decay_state, fold_resets, segment_resets
from linear_attention.kernels.state import LinearAttentionState


def gated_oja_rule(q, k, v, beta, *, log_decay=None, scale=None, method="scan",
                   initial_state=None, return_state=False, segment_ids=None,
                   axis_name=None):  # fmt: skip
    """The gated Oja rule over a sequence (module docstring).

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, H, Dv]`; beta: `[B, T, H]` (β, used as given).
      log_decay: g ≤ 0, None (no decay), `[H]`, `[B, T, H]` or `[B, T, H, Dv]` (per value
        channel, FLA's `gv`); −inf zeroes the state's columns.
      scale: the factor of q (None: K^−½, FLA's default).
      method: "scan" (token by token; the only method).
      initial_state: `LinearAttentionState(kv=[B, H, K, Dv], k_sum=None)` (None: zeros).
      return_state: also return the state after the last token.
      segment_ids: `[B, T]` integers or a `Segments`: the state is zeroed before every change
        of id.
      axis_name: not taken (ValueError): no time split.
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state` the final state.
    """
    method = GATED_OJA.resolve(method)
    check_static("return_state", return_state)
    if axis_name is not None:
        raise ValueError(
            "gated_oja_rule has no sequence-parallel form (axis_name): run it with time "
            "unsplit (mesh.seq = 1)"
        )
    sizes = check_layouts(
        q=(q, "[B, T, H, K]"), k=(k, "[B, T, H, K]"), v=(v, "[B, T, H, Dv]"),
        beta=(beta, "[B, T, H]"),
    )  # fmt: skip
    B, T, H, Kd, Dv = sizes["B"], sizes["T"], sizes["H"], sizes["K"], sizes["Dv"]
    s0 = initial_state_f32(initial_state, B, H, Kd, Dv)
    g = check_log_decay(log_decay, (B, T, H), "[B, T, H]", feature_dim=Dv)
    g_BTHD = _per_value(g, (B, T, H, Dv))
    g_BTHD = fold_resets(segment_resets(segment_ids, B, T), g_BTHD, H)
    q32, k32, v32, b32 = _float32(q, k, v, beta, scale)
    o, s = GATED_OJA.kernel(method)(q32, k32, v32, b32, g_BTHD, s0)
    o = o.astype(jnp.result_type(q, k, v))
    return (o, LinearAttentionState(kv=s, k_sum=None)) if return_state else o


def gated_oja_rule_step(state: LinearAttentionState, q, k, v, beta, *, log_decay=None,
                        scale=None):  # fmt: skip
    """One token of the gated Oja rule (decoding), O(1) in the context: q, k `[B, H, K]`, v
    `[B, H, Dv]`, beta `[B, H]`, log_decay None, `[H]`, `[B, H]` or `[B, H, Dv]`. Returns
    `(o [B, H, Dv] in result_type(q, k, v), new state)`."""
    sizes = check_layouts(
        q=(q, "[B, H, K]"), k=(k, "[B, H, K]"), v=(v, "[B, H, Dv]"), beta=(beta, "[B, H]")
    )
    B, H, Kd, Dv = sizes["B"], sizes["H"], sizes["K"], sizes["Dv"]
    check_delta_state(state, B, H, Kd, Dv, "state")
    g = check_log_decay(log_decay, (B, H), "[B, H]", feature_dim=Dv)
    inputs = (*_float32(q, k, v, beta, scale), _per_value(g, (B, H, Dv)))
    s, o = _token(state.kv.astype(jnp.float32), inputs)
    return o.astype(jnp.result_type(q, k, v)), LinearAttentionState(kv=s, k_sum=None)


def _float32(q, k, v, beta, scale):
    """q·scale, k, v, β in float32 (any leading axes)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    f32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v, beta))
    q32, k32, v32, b32 = f32
    return q32 * scale, k32, v32, b32


def _per_value(g, shape):
    """The log decay as `shape` = `[..., H, Dv]`: zeros for None, a per-head one broadcast."""
    if g is None:
        return jnp.zeros(shape, jnp.float32)
    return jnp.broadcast_to(g if g.ndim == len(shape) else g[..., None], shape)


def _token(s_BHKD, inputs):
    """S̃ = S Diag(γ);  S ← S̃ + β (k − S̃ v) vᵀ;  o = Sᵀ q (float32)."""
    q, k, v, beta, g = inputs
    s_BHKD = decay_state(g[..., None, :], s_BHKD)  # a −inf column selects 0, whatever S holds
    read_BHK = jnp.einsum("bhkd,bhd->bhk", s_BHKD, v)
    s_BHKD = s_BHKD + (beta[..., None] * (k - read_BHK))[..., :, None] * v[..., None, :]
    return s_BHKD, jnp.einsum("bhk,bhkd->bhd", q, s_BHKD)


def oja_scan(q_BTHK, k_BTHK, v_BTHD, beta_BTH, g_BTHD, s0_BHKD):
    """The gated Oja rule by `lax.scan` over tokens (float32); returns `(o_BTHD, s_BHKD)`."""
    xs = [jnp.moveaxis(x, 1, 0) for x in (q_BTHK, k_BTHK, v_BTHD, beta_BTH, g_BTHD)]
    s_BHKD, o_TBHD = jax.lax.scan(_token, s0_BHKD, xs)
    return jnp.moveaxis(o_TBHD, 0, 1), s_BHKD


def scan_flops(*, heads, dk, dv, **_):
    """The scan per token: 8·H·dk·dv (the decay, S̃ v, the rank-one update, qᵀS)."""
    return 8.0 * heads * dk * dv


# The family's descriptor (`primitives.family`): the scan only (no chunked form yet), its step
# and state; no time split.
GATED_OJA = Family(
    name="gated_oja_rule",
    methods={"scan": Method(oja_scan, scan_flops)},
    step=gated_oja_rule_step,
    state=LinearAttentionState,
    splits_time=False,
)

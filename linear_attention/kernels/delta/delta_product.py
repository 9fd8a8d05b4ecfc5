"""Gated DeltaProduct: n Householder (delta) steps per token.

Per head, with a log decay a_t ≤ 0 (per head) and n keys, values and rates per token,

    S ← exp(a_t) S_{t−1};   for j = 1..n:  S ← (I − β_tj k_tj k_tjᵀ) S + β_tj k_tj v_tjᵀ;   S_t = S
    o_t = S_tᵀ q_t

The transition is a product of n generalised Householder matrices: with β ∈ (0, 2) (negative
eigenvalues) it tracks state that one step cannot (e.g. permutations: Siems et al., 2025).

Chunkwise, the n steps are sub-tokens of the delta rule: the sequence of T·n sub-tokens
(k_t1, …, k_tn, k_{t+1,1}, …) with the decay on each token's first sub-token only and the query on
its last, run through the delta rule's chunk kernel (`delta.delta_chunked`); o_t is the output of
the n-th sub-token. `chunk_size` counts sub-tokens, so a chunk costs what a delta-rule chunk does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import check_log_decay, check_static
from linear_attention.kernels.delta.checks import (
    check_beta,
    check_delta_state,
    check_inputs,
    initial_state_f32,
)
from linear_attention.kernels.delta.delta import (
    chunk_flops,
    delta_chunked,
    delta_pallas,
    delta_token,
    scan_flops,
)
from linear_attention.kernels.primitives.driver import guarded_call
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.segments import fold_resets, segment_resets
from linear_attention.kernels.state import LinearAttentionState


def delta_product(
    q,
    k,
    v,
    beta,
    *,
    log_decay=None,
    method: str = "chunk",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    segment_ids=None,
    axis_name: str | None = None,
):
    """Gated DeltaProduct over a sequence: per token, decay once, then n delta steps in order;
    o_t = S_tᵀ q_t is read after the n-th.

    Args:
      q: `[B, T, H, K]`; k: `[B, T, H, n, K]`; v: `[B, T, H, n, Dv]`.
      beta: `[B, T, H, n]` in [0, 2].
      log_decay: ≤ 0, None, `[H]` or `[B, T, H]`; −inf resets.
      method: "chunk" (sub-tokens through the delta rule's chunk kernel), "scan" (the reference)
        or "pallas" (sub-tokens through `delta_rule`'s Pallas form; on a TPU, or inside
        `kernels.pallas_interpret()`; `chunk_size` a multiple of 16).
      chunk_size: sub-tokens (of the T·n) per chunk for "chunk".
      initial_state: `LinearAttentionState(kv=[B, H, K, Dv], k_sum=None)`.
      return_state: also return the state after the last token.
      segment_ids: `[B, T]` integers or a `Segments`: the state is zeroed before every change
        of id.
      axis_name: time split over this `shard_map` axis (`affine_sequence_parallel`).
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`, and with `return_state` the final state.
    """
    method, chunk_size = DELTA_PRODUCT.check(method, chunk_size)
    check_static("return_state", return_state)
    B, T, H, n, Kd, Dv = _check_inputs(q, k, v, beta, time=True)
    s0_BHKD = initial_state_f32(initial_state, B, H, Kd, Dv)
    a_BTH = check_log_decay(log_decay, (B, T, H), "[B, T, H]")
    a_BTH = fold_resets(segment_resets(segment_ids, B, T, axis_name), a_BTH, H)
    # a −inf decay zeroes the state before the token's steps: a NaN carried in stops there
    return guarded_call(
        DELTA_PRODUCT,
        method,
        q,
        (k, v, jnp.asarray(beta, jnp.float32)),
        a_BTH,
        s0_BHKD,
        options=dict(chunk_size=chunk_size),
        dtype=jnp.result_type(q, k, v),
        return_state=return_state,
        axis_name=axis_name,
    )


def delta_product_step(state: LinearAttentionState, q, k, v, beta, *, log_decay=None):
    """One token of Gated DeltaProduct (decoding), O(1) in the context length.

    Args:
      state: `LinearAttentionState(kv=[B, H, K, Dv], k_sum=None)`.
      q: `[B, H, K]`; k: `[B, H, n, K]`; v: `[B, H, n, Dv]`; beta: `[B, H, n]`.
      log_decay: ≤ 0, None, `[H]` or `[B, H]`.
    Returns:
      `(o: [B, H, Dv] in result_type(q, k, v), new state)`.
    """
    B, H, n, Kd, Dv = _check_inputs(q, k, v, beta, time=False)
    check_delta_state(state, B, H, Kd, Dv, "state")
    a_BH = check_log_decay(log_decay, (B, H), "[B, H]")
    dtype = jnp.result_type(q, k, v)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    s_BHKD, o_BHD = _token(state.kv.astype(jnp.float32), (q32, k32, v32, beta, a_BH))
    return o_BHD.astype(dtype), LinearAttentionState(kv=s_BHKD, k_sum=None)


def _token(s_BHKD, inputs):
    """Decay, then n delta steps (a static loop over n, not over time); o after the n-th."""
    q_BHK, k_BHNK, v_BHND, beta_BHN, a_BH = inputs
    beta_BHN = jnp.asarray(beta_BHN, jnp.float32)
    for j in range(k_BHNK.shape[2]):
        o_BHD, s_BHKD = delta_token(
            s_BHKD, q_BHK, k_BHNK[:, :, j], v_BHND[:, :, j], beta_BHN[:, :, j], a_BH
        )
        a_BH = None  # the decay acts once, before the first step
    return s_BHKD, o_BHD


def delta_product_scan(q_BTHK, k_BTHNK, v_BTHND, beta_BTHN, a_BTH, s0_BHKD):
    """Gated DeltaProduct by `lax.scan` over tokens (float32): the reference."""
    xs = [None if x is None else jnp.moveaxis(x, 1, 0) for x in (q_BTHK, k_BTHNK, v_BTHND)]
    xs += [jnp.moveaxis(beta_BTHN, 1, 0), None if a_BTH is None else jnp.moveaxis(a_BTH, 1, 0)]
    s_BHKD, o_TBHD = jax.lax.scan(_token, s0_BHKD, xs)
    return jnp.moveaxis(o_TBHD, 0, 1), s_BHKD


def delta_product_chunked(
    q_BTHK, k_BTHNK, v_BTHND, beta_BTHN, a_BTH, s0_BHKD, *, chunk_size, pallas=False
):
    """Gated DeltaProduct as T·n sub-tokens of the delta rule's chunk kernel (float32 arrays);
    with `pallas`, of its Pallas form (`delta.delta_pallas`: q, k, v in their input dtype, the
    per-token decay on the first sub-token of each token kept per token; on a GPU its Mosaic GPU
    walk, `delta.pallas_gpu`, `chunk_size` a multiple of 64 sub-tokens)."""
    B, T, H, n, Kd = k_BTHNK.shape

    def interleave(x_BTHN):  # [B, T, H, n, ...] -> [B, T·n, H, ...], token-major
        return jnp.moveaxis(x_BTHN, 3, 2).reshape(B, T * n, H, *x_BTHN.shape[4:])

    first = jnp.arange(n) == 0
    last = jnp.arange(n) == n - 1
    q_sub = jnp.where(last[:, None], q_BTHK[:, :, :, None, :], 0.0)  # read after the n-th step
    a_sub = None
    if a_BTH is not None:  # decay on the first sub-token only
        a_sub = interleave(jnp.where(first, a_BTH[..., None], 0.0))
    o_sub, s_BHKD = (delta_pallas if pallas else delta_chunked)(
        interleave(q_sub),
        interleave(k_BTHNK),
        interleave(v_BTHND),
        interleave(beta_BTHN),
        a_sub,
        s0_BHKD,
        chunk_size=chunk_size,
    )
    return o_sub.reshape(B, T, n, H, o_sub.shape[-1])[:, :, -1], s_BHKD


def _check_inputs(q, k, v, beta, *, time: bool):
    lead = "B, T, H" if time else "B, H"
    check_inputs(
        time=time,
        q=(q, f"[{lead}, K]"),
        k=(k, f"[{lead}, n, K]"),
        v=(v, f"[{lead}, n, Dv]"),
        beta=(beta, f"[{lead}, n]"),
    )
    check_beta(beta, 0.0, 2.0)
    return (*k.shape, v.shape[-1])


def _sub_tokens(flops):
    """A delta-rule count per token of T·n sub-tokens (`num_keys` n): n value heads' worth of
    sub-token work per token, the chunk counted in sub-tokens."""

    def count(*, seq_len, heads, num_keys, **sizes):
        return flops(seq_len=num_keys * seq_len, heads=num_keys * heads, **sizes)

    return count


DELTA_PRODUCT = Family(
    name="delta_product",
    methods={
        "chunk": Method(delta_product_chunked, _sub_tokens(chunk_flops), static=("chunk_size",)),
        "scan": Method(delta_product_scan, _sub_tokens(scan_flops)),
        "pallas": Method(
            functools.partial(delta_product_chunked, pallas=True),
            _sub_tokens(chunk_flops),
            static=("chunk_size",),
            backends=("tpu", "gpu"),
        ),
    },
    step=delta_product_step,
    state=LinearAttentionState,
    splits_time=True,
)

"""Exact softmax attention: the quadratic baseline and an online-softmax (blockwise) form.

For every batch row b and head h, with `scale = 1/√D` unless given,

    o_i = Σ_j p_ij v_j ,   p_ij = exp(s_ij − max_j s_ij) / Σ_j exp(s_ij − max_j s_ij) ,
    s_ij = scale · q_i·k_j   (−∞ where masked).

Logits, the softmax and every running sum are float32; the output has dtype
`result_type(q, k, v)`. The mask is applied to the logits before `exp`.

Causal alignment. With `causal=True` and `Tq ≠ Tk` the queries are the *last* `Tq` positions of
the key sequence: query i sees key j iff `j ≤ i + (Tk − Tq)`. With `Tq = Tk` that is the usual
`j ≤ i`; with `Tq < Tk` it is what decoding from a KV cache needs (the new tokens' queries attend
to the cached keys and to themselves). When `Tq > Tk` the first `Tq − Tk` queries see no key at
all; such fully masked rows give a zero output (and zero gradients), never NaN.

Grouped (multi-query) heads are not supported: q, k and v must have the same number of heads.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from linear_attention.kernels._checks import check_positive_int, check_rank, check_same

__all__ = ["softmax_attention", "blockwise_softmax_attention"]


def _check_inputs(q, k, v, scale) -> None:
    check_rank("q", q, 4, "[B, Tq, H, D]")
    check_rank("k", k, 4, "[B, Tk, H, D]")
    check_rank("v", v, 4, "[B, Tk, H, Dv]")
    check_same(("q", "k", "v"), (q, k, v), (0, 0, 0), "B (batch)")
    check_same(("q", "k", "v"), (q, k, v), (2, 2, 2), "H (heads)")
    check_same(("q", "k"), (q, k), (3, 3), "D (query/key width)")
    check_same(("k", "v"), (k, v), (1, 1), "Tk (key length)")
    if scale is None:
        return
    if jnp.ndim(scale) != 0:
        raise ValueError(f"scale must be a scalar, got shape {tuple(jnp.shape(scale))}")
    try:
        value = float(scale)
    except jax.errors.ConcretizationTypeError:
        return  # a traced scale cannot be checked here; its value is the caller's responsibility
    if not value > 0:
        raise ValueError(f"scale must be > 0, got {value!r}")


def _scale(scale, d: int):
    return 1.0 / math.sqrt(d) if scale is None else scale


def _visible(q_pos, k_pos, tq: int, tk: int, causal: bool):
    """Boolean [Tq, Tk'] mask: key j exists (j < Tk) and, if causal, j ≤ i + (Tk − Tq)."""
    ok = k_pos[None, :] < tk
    if causal:
        ok = ok & (k_pos[None, :] <= q_pos[:, None] + (tk - tq))
    return ok


def softmax_attention(q, k, v, *, causal: bool = False, scale=None):
    """Exact softmax attention, O(Tq·Tk) memory: the quadratic baseline.

    q `[B, Tq, H, D]`, k `[B, Tk, H, D]`, v `[B, Tk, H, Dv]` -> o `[B, Tq, H, Dv]` in
    `result_type(q, k, v)`. `causal` aligns queries to the end of the keys (module docstring).
    """
    _check_inputs(q, k, v, scale)
    out_dtype = jnp.result_type(q, k, v)
    tq, tk, d = q.shape[1], k.shape[1], q.shape[3]
    f32 = jnp.float32
    logits_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), k.astype(f32)) * _scale(scale, d)
    if causal:
        visible_QK = _visible(jnp.arange(tq), jnp.arange(tk), tq, tk, causal=True)
        logits_BHQK = jnp.where(visible_QK, logits_BHQK, -jnp.inf)
    # The shift cancels in the softmax, so it carries no gradient (as in jax.nn.softmax); a row
    # with no visible key has max −∞, replaced by 0 so that exp(−∞ − 0) = 0 rather than NaN.
    max_BHQ1 = jax.lax.stop_gradient(jnp.max(logits_BHQK, axis=-1, keepdims=True, initial=-jnp.inf))
    max_BHQ1 = jnp.where(jnp.isneginf(max_BHQ1), 0.0, max_BHQ1)
    p_BHQK = jnp.exp(logits_BHQK - max_BHQ1)
    denom_BHQ1 = jnp.sum(p_BHQK, axis=-1, keepdims=True)
    p_BHQK = p_BHQK / jnp.where(denom_BHQ1 > 0, denom_BHQ1, 1.0)
    o_BQHE = jnp.einsum("bhqk,bkhe->bqhe", p_BHQK, v.astype(f32))
    return o_BQHE.astype(out_dtype)


def blockwise_softmax_attention(q, k, v, *, causal: bool = False, scale=None, block_size=512):
    """Exact softmax attention by an online softmax over key blocks: O(Tq·block_size) memory.

    Same arguments, numbers and dtype rules as `softmax_attention`. A `lax.scan` over blocks of
    `block_size` keys keeps a running max m_i, running sum l_i = Σ_j exp(s_ij − m_i) and running
    numerator a_i = Σ_j exp(s_ij − m_i) v_j (all float32); a new block with max m'_i rescales
    them by exp(m_i − m'_i). Keys are zero-padded to a whole number of blocks and the padding is
    masked, so any Tk works.

    The gradient is a custom VJP in the FlashAttention style: the forward saves only o and the
    log-sum-exp per query, and the backward recomputes each block's probabilities, so the
    gradient's memory is O(T·block_size) too. Reverse mode only (no `jax.jvp`).
    """
    _check_inputs(q, k, v, scale)
    check_positive_int("block_size", block_size)
    out_dtype = jnp.result_type(q, k, v)
    tk, d = k.shape[1], q.shape[3]
    f32 = jnp.float32
    # Folding the scale into q lets the custom VJP work at scale 1; autodiff of this product
    # carries the gradient to q (and to a traced scale).
    q_scaled = q.astype(f32) * _scale(scale, d)
    block = min(block_size, max(tk, 1))  # never pad a short sequence up to a long block
    o = _flash(q_scaled, k.astype(f32), v.astype(f32), bool(causal), block)
    return o.astype(out_dtype)


def _to_blocks(x_BTHD, block: int):
    """[B, T, H, D] -> [N, B, H, block, D], zero-padded to N·block = ⌈T/block⌉·block steps."""
    b, t, h, d = x_BTHD.shape
    n = -(-t // block)
    x_BTHD = jnp.pad(x_BTHD, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
    return x_BTHD.reshape(b, n, block, h, d).transpose(1, 0, 3, 2, 4)


def _from_blocks(x_NBHCD, t: int):
    """Inverse of `_to_blocks`: [N, B, H, block, D] -> [B, T, H, D]."""
    n, b, h, c, d = x_NBHCD.shape
    return x_NBHCD.transpose(1, 0, 3, 2, 4).reshape(b, n * c, h, d)[:, :t]


def _masked_logits(q_BHQD, k_BHCD, start, tq: int, tk: int, causal: bool):
    logits_BHQC = jnp.einsum("bhqd,bhcd->bhqc", q_BHQD, k_BHCD)
    k_pos = start + jnp.arange(k_BHCD.shape[2])
    return jnp.where(_visible(jnp.arange(tq), k_pos, tq, tk, causal), logits_BHQC, -jnp.inf)


def _flash_forward(q, k, v, causal: bool, block: int):
    """Online softmax over key blocks. Returns o [B, Tq, H, Dv] and lse [B, H, Tq] (float32)."""
    b, tq, h, _ = q.shape
    tk, dv = k.shape[1], v.shape[3]
    q_BHQD = q.transpose(0, 2, 1, 3)
    k_NBHCD, v_NBHCE = _to_blocks(k, block), _to_blocks(v, block)
    starts_N = jnp.arange(k_NBHCD.shape[0]) * block

    def body(carry, xs):
        max_BHQ, sum_BHQ, acc_BHQE = carry
        k_BHCD, v_BHCE, start = xs
        logits_BHQC = _masked_logits(q_BHQD, k_BHCD, start, tq, tk, causal)
        new_max_BHQ = jnp.maximum(max_BHQ, jnp.max(logits_BHQC, axis=-1))
        # A row that has seen no visible key yet keeps max −∞; shifting by 0 instead keeps
        # exp(−∞ − shift) = 0 and avoids (−∞) − (−∞) = NaN.
        shift_BHQ = jnp.where(jnp.isneginf(new_max_BHQ), 0.0, new_max_BHQ)
        rescale_BHQ = jnp.exp(max_BHQ - shift_BHQ)
        p_BHQC = jnp.exp(logits_BHQC - shift_BHQ[..., None])
        sum_BHQ = rescale_BHQ * sum_BHQ + jnp.sum(p_BHQC, axis=-1)
        acc_BHQE = rescale_BHQ[..., None] * acc_BHQE + jnp.einsum("bhqc,bhce->bhqe", p_BHQC, v_BHCE)
        return (new_max_BHQ, sum_BHQ, acc_BHQE), None

    init = (
        jnp.full((b, h, tq), -jnp.inf, jnp.float32),
        jnp.zeros((b, h, tq), jnp.float32),
        jnp.zeros((b, h, tq, dv), jnp.float32),
    )
    (max_BHQ, sum_BHQ, acc_BHQE), _ = jax.lax.scan(body, init, (k_NBHCD, v_NBHCE, starts_N))
    seen_BHQ = sum_BHQ > 0  # a row with a visible key has sum ≥ 1 (its max term is exp(0))
    safe_sum_BHQ = jnp.where(seen_BHQ, sum_BHQ, 1.0)
    o_BHQE = acc_BHQE / safe_sum_BHQ[..., None]
    # Any finite lse will do for an empty row: all its logits are −∞, so exp(s − lse) = 0.
    lse_BHQ = jnp.where(seen_BHQ, max_BHQ + jnp.log(safe_sum_BHQ), 0.0)
    return o_BHQE.transpose(0, 2, 1, 3), lse_BHQ


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, causal: bool, block: int):
    return _flash_forward(q, k, v, causal, block)[0]


def _flash_fwd(q, k, v, causal: bool, block: int):
    o, lse_BHQ = _flash_forward(q, k, v, causal, block)
    return o, (q, k, v, o, lse_BHQ)


def _flash_bwd(causal: bool, block: int, residuals, do):
    """Recompute p = exp(s − lse) block by block; dv = pᵀdo, ds = p ⊙ (do vᵀ − rowsum(do ⊙ o))."""
    q, k, v, o, lse_BHQ = residuals
    tq, tk = q.shape[1], k.shape[1]
    q_BHQD = q.transpose(0, 2, 1, 3)
    do_BHQE = do.astype(jnp.float32).transpose(0, 2, 1, 3)
    # Σ_j p_ij (do_i·v_j) = do_i·o_i: the softmax Jacobian's correction term, one per row.
    delta_BHQ = jnp.einsum("bqhe,bqhe->bhq", do.astype(jnp.float32), o)
    k_NBHCD, v_NBHCE = _to_blocks(k, block), _to_blocks(v, block)
    starts_N = jnp.arange(k_NBHCD.shape[0]) * block

    def body(dq_BHQD, xs):
        k_BHCD, v_BHCE, start = xs
        logits_BHQC = _masked_logits(q_BHQD, k_BHCD, start, tq, tk, causal)
        p_BHQC = jnp.exp(logits_BHQC - lse_BHQ[..., None])
        dv_BHCE = jnp.einsum("bhqc,bhqe->bhce", p_BHQC, do_BHQE)
        dp_BHQC = jnp.einsum("bhqe,bhce->bhqc", do_BHQE, v_BHCE)
        ds_BHQC = p_BHQC * (dp_BHQC - delta_BHQ[..., None])
        dq_BHQD = dq_BHQD + jnp.einsum("bhqc,bhcd->bhqd", ds_BHQC, k_BHCD)
        dk_BHCD = jnp.einsum("bhqc,bhqd->bhcd", ds_BHQC, q_BHQD)
        return dq_BHQD, (dk_BHCD, dv_BHCE)

    dq_BHQD, (dk_NBHCD, dv_NBHCE) = jax.lax.scan(
        body, jnp.zeros_like(q_BHQD), (k_NBHCD, v_NBHCE, starts_N)
    )
    return dq_BHQD.transpose(0, 2, 1, 3), _from_blocks(dk_NBHCD, tk), _from_blocks(dv_NBHCE, tk)


_flash.defvjp(_flash_fwd, _flash_bwd)

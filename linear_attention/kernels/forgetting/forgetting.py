"""Forgetting attention (FoX: Lin et al., "Forgetting Transformer: Softmax Attention with a
Forget Gate", ICLR 2025): softmax attention whose logits carry the cumulative log forget gate.

Per head, with a log forget gate a_t = log f_t ≤ 0 per token (−inf: a reset),

    s_ij = scale · q_i·k_j + Σ_{j < l ≤ i} a_l        (j ≤ i; −∞ for j > i or across a reset)
    o_i  = Σ_j softmax_j(s_ij) v_j

With c_t = Σ_{l ≤ t} a_l the cumulative log gate, the bias is c_i − c_j. A reset (−inf) is taken
out of the sum and counted (`segments.cumulative_log_decay` with `restart`): c restarts from 0 at
each reset and a key is seen only from its own reset group, so no (−inf) − (−inf) arises and the
sums stay as small as a document's. Packed rows (`segment_ids`) are resets at document starts,
the library's one reset mechanism, so a token sees only its own document.

Blockwise (`method="chunk"`, the training path). The bias is a difference of a query term
and a key term, so it is an inner product of augmented vectors:

    s_ij = [scale·q_i, c_i, 1] · [k_j, 1, −c_j]

and forgetting attention is exact causal softmax attention on q' = [scale·q, c, 1],
k' = [k, 1, −c], with the reset groups as segment ids. It runs on
`softmax.blockwise_softmax_attention`: an online softmax over blocks, O(T) memory, and a
FlashAttention-style custom VJP that saves only the output and the log-sum-exp per query (no
[T, T] probabilities, no per-token state). The cotangents of q' and k' carry the gradient to c
and so, by autodiff of the cumulative sum, to the gate. Heads are folded into the batch for
that call, since a reset group is per head. `method="quadratic"` builds the masked [T, T]
logits directly: the reference.

Decoding (`cached_forgetting_attention`, `forgetting_attention_step`) keeps a `ForgettingCache`
(`softmax/gated_cache.py`, shared with PaTH attention): keys, values, and for every filled slot
its cumulative log gate c_j and reset count n_j; a new token extends c and n from the last slot
and attends to the slots with its reset count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import (
    check_float,
    check_layouts,
    check_log_decay,
    refuse_axis_name,
)
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.primitives.nan_guard import (
    clean,
    clean_log_decay,
    nan_guard,
    poison,
)
from linear_attention.kernels.segments import cumulative_log_decay, fold_resets, segment_resets
from linear_attention.kernels.softmax.gated_cache import (
    ForgettingCache,
    attend_slots,
    extend_gates,
    write_slots,
)
from linear_attention.kernels.softmax.softmax import blockwise_softmax_attention, resolve_scale


def forgetting_attention(
    q,
    k,
    v,
    log_forget,
    *,
    scale=None,
    method: str = "chunk",
    block_size: int = 512,
    segment_ids=None,
    axis_name: str | None = None,
):
    """Causal softmax attention with a forget gate (FoX), see the module docstring.

    Args:
      q, k: `[B, T, H, D]`; v: `[B, T, H, Dv]`.
      log_forget: log f ≤ 0 per token and head, `[B, T, H]` (or `[H]`, fixed); −inf is a
        reset. None: no forgetting (plain causal softmax attention).
      scale: the logits' scale (None: 1/√D).
      method: "chunk" (online softmax over blocks, O(T) memory, the training path) or
        "quadratic" (the masked [T, T] reference).
      block_size: query and key block of "chunk".
      segment_ids: `[B, T]` integers or a `Segments`: each token sees its own document only.
      axis_name: refused: the output is no affine map of a carried state, so it has no
        sequence-parallel form here (the model refuses a time split for the `fox` mixer).
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`; logits and softmax in float32. T = 0 gives
      the empty output, as `softmax_attention`.
    """
    method, block_size = FORGETTING.check(method, block_size, "block_size")
    refuse_axis_name("forgetting_attention", axis_name)
    check_float(("q", "k", "v"), (q, k, v))
    sizes = check_layouts(q=(q, "[B, T, H, D]"), k=(k, "[B, T, H, D]"), v=(v, "[B, T, H, Dv]"))
    B, T, H = sizes["B"], sizes["T"], sizes["H"]
    a_BTH = check_log_decay(log_forget, (B, T, H), "[B, T, H]")
    if T == 0:  # (no block to split)
        return jnp.zeros(v.shape, jnp.result_type(q, k, v))
    a_BTH = fold_resets(segment_resets(segment_ids, B, T), a_BTH, H)
    if a_BTH is None:
        a_BTH = jnp.zeros((B, T, H), jnp.float32)
    dtype = jnp.result_type(q, k, v)
    q32 = jnp.asarray(q, jnp.float32) * resolve_scale(scale, q.shape[-1])
    k32, v32 = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)
    # a bad key, value or gate reaches the later queries of its document only, as the bias
    # c_i − c_j carries it (`primitives.nan_guard`): computed clean, selected to NaN there
    guard = nan_guard((B, T, H), (k32, v32), a_BTH)
    k32, v32, a_BTH = clean(guard, k32), clean(guard, v32), clean_log_decay(a_BTH)
    c_BTH, n_BTH = cumulative_log_decay(a_BTH, axis=1, restart=True)
    o_BTHD = FORGETTING.kernel(method, block_size=block_size)(q32, k32, v32, c_BTH, n_BTH)
    return poison(guard, o_BTHD).astype(dtype)


def _quadratic(q_BTHD, k_BTHD, v_BTHE, c_BTH, n_BTH):
    """The masked [T, T] form: s = q·k + c_i − c_j where j ≤ i in the same reset group."""
    T = q_BTHD.shape[1]
    logits_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BTHD)
    c_BHT, n_BHT = (jnp.moveaxis(x, 1, 2) for x in (c_BTH, n_BTH))
    bias_BHTS = c_BHT[..., :, None] - c_BHT[..., None, :]
    visible = jnp.tril(jnp.ones((T, T), bool)) & (n_BHT[..., :, None] == n_BHT[..., None, :])
    p_BHTS = jax.nn.softmax(jnp.where(visible, logits_BHTS + bias_BHTS, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshe->bthe", p_BHTS, v_BTHE)


def _blockwise(q_BTHD, k_BTHD, v_BTHE, c_BTH, n_BTH, *, block_size):
    """Softmax attention on the augmented q' = [q, c, 1], k' = [k, 1, −c] (scale folded into
    q), heads folded into the batch, the reset groups as segment ids."""
    B, T, H, _ = q_BTHD.shape
    ones = jnp.ones((B, T, H, 1), jnp.float32)
    c = c_BTH[..., None]
    q_aug = jnp.concatenate([q_BTHD, c, ones], axis=-1)
    k_aug = jnp.concatenate([k_BTHD, ones, -c], axis=-1)

    def heads_to_batch(x):  # [B, T, H, ...] -> [B·H, T, 1, ...]
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(B * H, T, 1, *x.shape[3:])

    o = blockwise_softmax_attention(
        heads_to_batch(q_aug),
        heads_to_batch(k_aug),
        heads_to_batch(v_BTHE),
        causal=True,
        scale=1.0,
        block_size=block_size,
        segment_ids=heads_to_batch(n_BTH)[:, :, 0],
    )
    return jnp.moveaxis(o.reshape(B, H, T, -1), 1, 2)


def cached_forgetting_attention(
    cache: ForgettingCache, position, q, k, v, log_forget, *, scale=None
):
    """Tq new tokens at positions `position + i` after the cache's filled slots: writes their
    keys, values, cumulative gates and reset counts into slots `position ..`, and attends.

    q, k: `[B, Tq, H, D]`; v: `[B, Tq, H, Dv]`; log_forget `[B, Tq, H]` (≤ 0, −inf a reset);
    `position` an int32 scalar (may be traced). Returns `(o [B, Tq, H, Dv], new cache)`. Query
    i sees slot j iff j ≤ position + i and slot j has its reset count. Reads all L slots (masked
    before `exp`): O(L) per decoded token; the "chunk" form is the trainable one.
    """
    check_layouts(
        q=(q, "[B, T, H, D]"),
        k=(k, "[B, T, H, D]"),
        v=(v, "[B, T, H, Dv]"),
        k_cache=(cache.k, "[B, L, H, D]"),
        v_cache=(cache.v, "[B, L, H, Dv]"),
    )
    B, Tq, H, _ = q.shape
    a_BTH = check_log_decay(log_forget, (B, Tq, H), "[B, T, H]")
    if a_BTH is None:
        a_BTH = jnp.zeros((B, Tq, H), jnp.float32)
    c_new, n_new = extend_gates(cache, position, a_BTH)
    cache = write_slots(cache, position, k, v, c_new, n_new)
    q32 = jnp.asarray(q, jnp.float32) * resolve_scale(scale, q.shape[-1])
    logits_BHTL = jnp.einsum("bthd,blhd->bhtl", q32, cache.k.astype(jnp.float32))
    o = attend_slots(cache, position, logits_BHTL, c_new, n_new)
    return o.astype(jnp.result_type(q, k, v)), cache


def forgetting_attention_step(cache: ForgettingCache, position, q, k, v, log_forget, *, scale=None):
    """One token (`q, k: [B, H, D]`, `v: [B, H, Dv]`, `log_forget: [B, H]`) at `position`:
    `(o [B, H, Dv], new cache)`, as `cached_forgetting_attention` with Tq = 1."""
    a = None if log_forget is None else jnp.asarray(log_forget)[:, None]
    o, cache = cached_forgetting_attention(
        cache, position, q[:, None], k[:, None], v[:, None], a, scale=scale
    )
    return o[:, 0], cache


def softmax_flops(*, seq_len, heads, dk, dv, **_):
    """Per token, either method: 2·H·T·(dk + dv), softmax attention's count (the gate's bias
    adds O(H) per pair)."""
    return 2.0 * heads * seq_len * (dk + dv)


FORGETTING = Family(
    name="forgetting_attention",
    methods={
        "chunk": Method(_blockwise, softmax_flops, static=("block_size",)),
        "quadratic": Method(_quadratic, softmax_flops),
    },
    step=forgetting_attention_step,
    state=ForgettingCache,
    old_words=("blockwise",),
)

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

Packed rows. With `segment_ids: [B, T]` (then Tq = Tk = T) query i sees key j only if both have
the same id (and, if causal, j ≤ i): each document attends only within itself.

Non-finite values. A masked matmul would spread a NaN of a key the query cannot see (0·NaN =
NaN), so values are zeroed where non-finite and the key of such a value is made NaN instead: its
logit is NaN exactly where it is visible and −∞ (selected by `where`) where it is not. A bad key
or value thus poisons only the queries that see it — in the forward pass. The gradient is not
guarded: the NaN key enters every row's logits before the mask, and the mask's zero cotangent
times it is NaN, so even a loss on the finite outputs has NaN gradients (measured for all three
softmax kernels; guarding them would need the rows a bad key reaches marked beside the clean
logits, as `causal_linear_attention` does). A NaN input stops training anyway (the trainer
keeps the last good checkpoint).

Grouped (multi-query) heads are not supported: q, k and v must have the same number of heads.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import (
    check_float,
    check_layouts,
    check_positive_int,
    check_static,
    reverse_mode_only,
)
from linear_attention.kernels.segments import document_ids, same_segment

__all__ = ["softmax_attention", "blockwise_softmax_attention", "cached_softmax_attention"]


def check_inputs(q, k, v, scale, segment_ids=None):
    """Check shapes, dtypes and the scale; return the checked segment ids (or None)."""
    check_float(("q", "k", "v"), (q, k, v))
    check_layouts(q=(q, "[B, Tq, H, D]"), k=(k, "[B, Tk, H, D]"), v=(v, "[B, Tk, H, Dv]"))
    if segment_ids is not None and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"segment_ids needs Tq = Tk (one id per token), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    segment_ids = document_ids(segment_ids, q.shape[0], q.shape[1])
    if scale is None:
        return segment_ids
    if jnp.ndim(scale) != 0:
        raise ValueError(f"scale must be a scalar, got shape {tuple(jnp.shape(scale))}")
    try:
        value = float(scale)
    except jax.errors.ConcretizationTypeError:
        return segment_ids  # a traced scale cannot be checked here: the caller's responsibility
    if not value > 0:
        raise ValueError(f"scale must be > 0, got {value!r}")
    return segment_ids


def quarantine(k, v):
    """Zero non-finite values and make their keys NaN (float32): see the module docstring."""
    k, v = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)
    bad_BTH1 = ~jnp.all(jnp.isfinite(v), axis=-1, keepdims=True)
    return jnp.where(bad_BTH1, jnp.nan, k), jnp.where(jnp.isfinite(v), v, 0.0)


def resolve_scale(scale, d: int):
    return 1.0 / math.sqrt(d) if scale is None else scale


def _visible(q_pos, k_pos, tq: int, tk: int, causal: bool):
    """Boolean [Tq, Tk'] mask: key j exists (j < Tk) and, if causal, j ≤ i + (Tk − Tq)."""
    ok = k_pos[None, :] < tk
    if causal:
        ok = ok & (k_pos[None, :] <= q_pos[:, None] + (tk - tq))
    return ok


def softmax_attention(q, k, v, *, causal: bool = False, scale=None, segment_ids=None):
    """Exact softmax attention, O(Tq·Tk) memory: the quadratic baseline.

    q `[B, Tq, H, D]`, k `[B, Tk, H, D]`, v `[B, Tk, H, Dv]` -> o `[B, Tq, H, Dv]` in
    `result_type(q, k, v)`. `causal` aligns queries to the end of the keys; `segment_ids [B, T]`
    restricts each token to its own document (module docstring).
    """
    check_static("causal", causal)
    segment_ids = check_inputs(q, k, v, scale, segment_ids)
    out_dtype = jnp.result_type(q, k, v)
    tq, tk, d = q.shape[1], k.shape[1], q.shape[3]
    f32 = jnp.float32
    k32, v32 = quarantine(k, v)
    logits_BHQK = jnp.einsum("bqhd,bkhd->bhqk", jnp.asarray(q, f32), k32) * resolve_scale(scale, d)
    visible = jnp.ones((tq, tk), bool)
    if causal:
        visible = _visible(jnp.arange(tq), jnp.arange(tk), tq, tk, causal=True)
    if segment_ids is not None:
        visible = visible & same_segment(segment_ids, segment_ids)[:, None]
    if causal or segment_ids is not None:
        logits_BHQK = jnp.where(visible, logits_BHQK, -jnp.inf)
    # The shift cancels in the softmax, so it carries no gradient (as in jax.nn.softmax); a row
    # with no visible key has max −∞, replaced by 0 so that exp(−∞ − 0) = 0 rather than NaN.
    max_BHQ1 = jax.lax.stop_gradient(jnp.max(logits_BHQK, axis=-1, keepdims=True, initial=-jnp.inf))
    max_BHQ1 = jnp.where(jnp.isneginf(max_BHQ1), 0.0, max_BHQ1)
    p_BHQK = jnp.exp(logits_BHQK - max_BHQ1)
    denom_BHQ1 = jnp.sum(p_BHQK, axis=-1, keepdims=True)
    p_BHQK = p_BHQK / jnp.where(denom_BHQ1 > 0, denom_BHQ1, 1.0)
    o_BQHE = jnp.einsum("bhqk,bkhe->bqhe", p_BHQK, v32)
    return o_BQHE.astype(out_dtype)


def blockwise_softmax_attention(
    q, k, v, *, causal: bool = False, scale=None, block_size=512, segment_ids=None
):
    """Exact softmax attention by an online softmax over blocks: O(T) memory.

    Same arguments (`segment_ids` too), numbers and dtype rules as `softmax_attention`. Queries
    and keys are cut into blocks of `block_size` (zero-padded; padded keys are masked, padded
    query rows dropped). For each query block a loop over key blocks keeps a running max m_i,
    running sum
    l_i = Σ_j exp(s_ij − m_i) and running numerator a_i = Σ_j exp(s_ij − m_i) v_j (all float32);
    a new block with max m'_i rescales them by exp(m_i − m'_i), and o_i = a_i / l_i at the end.
    With `causal=True` the key blocks wholly after a query block's last visible key are skipped,
    which halves the work. Memory beyond q, k, v and o is O(block_size²).

    The gradient is a custom VJP in the FlashAttention style: the forward saves only o and the
    log-sum-exp per query, and the backward recomputes each block's probabilities, so the
    gradient's memory is O(T) too. Reverse mode only: forward mode (`jax.jvp`, `jax.jacfwd`)
    raises `ValueError` pointing to `softmax_attention`, whose plain-JAX form supports it.
    """
    check_static("causal", causal)
    segment_ids = check_inputs(q, k, v, scale, segment_ids)
    block_size = check_positive_int("block_size", block_size)
    out_dtype = jnp.result_type(q, k, v)
    tq, tk, d = q.shape[1], k.shape[1], q.shape[3]
    if tq == 0 or tk == 0:  # no query, or no key to see: zero rows (as for fully masked rows)
        return jnp.zeros((q.shape[0], tq, q.shape[2], v.shape[3]), out_dtype)
    f32 = jnp.float32
    # Folding the scale into q lets the custom VJP work at scale 1; autodiff of this product
    # carries the gradient to q (and to a traced scale).
    q_scaled = jnp.asarray(q, f32) * resolve_scale(scale, d)
    k32, v32 = quarantine(k, v)
    # never pad a short sequence (e.g. one decoded token) up to a long block
    q_block, k_block = min(block_size, tq), min(block_size, tk)
    with reverse_mode_only("blockwise_softmax_attention", "softmax_attention"):
        o = _flash(q_scaled, k32, v32, segment_ids, bool(causal), q_block, k_block)
    return o.astype(out_dtype)


def _to_blocks(x_BTHD, block: int):
    """[B, T, H, D] -> [N, B, H, block, D], zero-padded to N·block = ⌈T/block⌉·block steps."""
    b, t, h, d = x_BTHD.shape
    n = -(-t // block)
    x_BTHD = jnp.pad(x_BTHD, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
    return x_BTHD.reshape(b, n, block, h, d).transpose(1, 0, 3, 2, 4)


def _segment_blocks(ids_BT, block: int):
    """[B, T] segment ids -> [N, B, block] (None stays None; padding is masked elsewhere)."""
    if ids_BT is None:
        return None
    b, t = ids_BT.shape
    n = -(-t // block)
    return jnp.pad(ids_BT, ((0, 0), (0, n * block - t))).reshape(b, n, block).transpose(1, 0, 2)


def _from_blocks(x_NBHCD, t: int):
    """Inverse of `_to_blocks`: [N, B, H, block, D] -> [B, T, H, D]."""
    n, b, h, c, d = x_NBHCD.shape
    return x_NBHCD.transpose(1, 0, 3, 2, 4).reshape(b, n * c, h, d)[:, :t]


class _Blocks(NamedTuple):
    """Static geometry of the (query block, key block) grid."""

    tq: int
    tk: int
    q_block: int
    k_block: int
    causal: bool

    @property
    def num_q(self) -> int:
        return -(-self.tq // self.q_block)

    @property
    def num_k(self) -> int:
        return -(-self.tk // self.k_block)

    def key_blocks_end(self, i):
        """Key blocks [0, end) hold every key that query block i may see."""
        if not self.causal:
            return self.num_k
        last_key = (i + 1) * self.q_block - 1 + (self.tk - self.tq)  # seen by the block's last row
        return jnp.clip(last_key // self.k_block + 1, 0, self.num_k)

    def query_blocks_start(self, j):
        """Query blocks [start, num_q) hold every query that may see a key of key block j."""
        if not self.causal:
            return 0
        first_row = j * self.k_block - (self.tk - self.tq)  # first row that sees key j·k_block
        return jnp.clip(first_row // self.q_block, 0, self.num_q)

    def logits(self, q_BHQD, k_BHCD, i, j, seg_q_BQ=None, seg_k_BC=None):
        """Query block i against key block j, −∞ where masked: [B, H, q_block, k_block].

        `seg_q_BQ`, `seg_k_BC`: the blocks' segment ids (None: one segment)."""
        logits_BHQC = jnp.einsum("bhqd,bhcd->bhqc", q_BHQD, k_BHCD)
        q_pos = i * self.q_block + jnp.arange(self.q_block)
        k_pos = j * self.k_block + jnp.arange(self.k_block)
        visible = _visible(q_pos, k_pos, self.tq, self.tk, self.causal)
        if seg_q_BQ is not None:
            visible = visible & (seg_q_BQ[:, None, :, None] == seg_k_BC[:, None, None, :])
        return jnp.where(visible, logits_BHQC, -jnp.inf)


def _flash_forward(q, k, v, seg, grid: _Blocks):
    """Online softmax. Returns o [B, Tq, H, Dv] and lse [N_q, B, H, q_block] (float32)."""
    q_NBHQD = _to_blocks(q, grid.q_block)
    k_NBHCD, v_NBHCE = _to_blocks(k, grid.k_block), _to_blocks(v, grid.k_block)
    seg_q, seg_k = _segment_blocks(seg, grid.q_block), _segment_blocks(seg, grid.k_block)
    b, h, dv = q.shape[0], q.shape[2], v.shape[3]

    def query_block(xs):
        q_BHQD, i = xs

        def key_block(j, carry):
            max_BHQ, sum_BHQ, acc_BHQE = carry
            logits_BHQC = grid.logits(q_BHQD, k_NBHCD[j], i, j, *_pair(seg_q, seg_k, i, j))
            new_max_BHQ = jnp.maximum(max_BHQ, jnp.max(logits_BHQC, axis=-1))
            # A row that has seen no visible key yet keeps max −∞; shifting by 0 instead keeps
            # exp(−∞ − shift) = 0 and avoids (−∞) − (−∞) = NaN.
            shift_BHQ = jnp.where(jnp.isneginf(new_max_BHQ), 0.0, new_max_BHQ)
            rescale_BHQ = jnp.exp(max_BHQ - shift_BHQ)
            p_BHQC = jnp.exp(logits_BHQC - shift_BHQ[..., None])
            sum_BHQ = rescale_BHQ * sum_BHQ + jnp.sum(p_BHQC, axis=-1)
            pv_BHQE = jnp.einsum("bhqc,bhce->bhqe", p_BHQC, v_NBHCE[j])
            return new_max_BHQ, sum_BHQ, rescale_BHQ[..., None] * acc_BHQE + pv_BHQE

        init = (
            jnp.full((b, h, grid.q_block), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, grid.q_block), jnp.float32),
            jnp.zeros((b, h, grid.q_block, dv), jnp.float32),
        )
        max_BHQ, sum_BHQ, acc_BHQE = jax.lax.fori_loop(0, grid.key_blocks_end(i), key_block, init)
        seen_BHQ = sum_BHQ > 0  # a row with a visible key has sum ≥ 1 (its max term is exp(0))
        safe_sum_BHQ = jnp.where(seen_BHQ, sum_BHQ, 1.0)
        # Any finite lse will do for an empty row: all its logits are −∞, so exp(s − lse) = 0.
        lse_BHQ = jnp.where(seen_BHQ, max_BHQ + jnp.log(safe_sum_BHQ), 0.0)
        return acc_BHQE / safe_sum_BHQ[..., None], lse_BHQ

    o_NBHQE, lse_NBHQ = jax.lax.map(query_block, (q_NBHQD, jnp.arange(grid.num_q)))
    return _from_blocks(o_NBHQE, grid.tq), lse_NBHQ


def _pair(seg_q, seg_k, i, j):
    """The segment ids of query block i and key block j (None, None without segments)."""
    return (None, None) if seg_q is None else (seg_q[i], seg_k[j])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, causal: bool, q_block: int, k_block: int):
    grid = _Blocks(q.shape[1], k.shape[1], q_block, k_block, causal)
    return _flash_forward(q, k, v, seg, grid)[0]


def _flash_fwd(q, k, v, seg, causal: bool, q_block: int, k_block: int):
    grid = _Blocks(q.shape[1], k.shape[1], q_block, k_block, causal)
    o, lse_NBHQ = _flash_forward(q, k, v, seg, grid)
    return o, (q, k, v, seg, o, lse_NBHQ)


def _flash_bwd(causal: bool, q_block: int, k_block: int, residuals, do):
    """Recompute p = exp(s − lse) block by block; dv = pᵀdo, ds = p ⊙ (do vᵀ − rowsum(do ⊙ o)).

    The outer scan runs over key blocks (each produces its dk, dv), the inner loop over the query
    blocks that can see it, adding ds·k into the carried dq.
    """
    q, k, v, seg, o, lse_NBHQ = residuals
    grid = _Blocks(q.shape[1], k.shape[1], q_block, k_block, causal)
    seg_q, seg_k = _segment_blocks(seg, q_block), _segment_blocks(seg, k_block)
    do = do.astype(jnp.float32)
    # Σ_j p_ij (do_i·v_j) = do_i·o_i: the softmax Jacobian's correction term, one per row.
    delta_NBHQ = _to_blocks(jnp.sum(do * o, axis=-1, keepdims=True), q_block)[..., 0]
    q_NBHQD, do_NBHQE = _to_blocks(q, q_block), _to_blocks(do, q_block)
    k_NBHCD, v_NBHCE = _to_blocks(k, k_block), _to_blocks(v, k_block)

    def key_block(dq_NBHQD, xs):
        k_BHCD, v_BHCE, j = xs

        def query_block(i, carry):
            dq_NBHQD, dk_BHCD, dv_BHCE = carry
            q_BHQD, do_BHQE = q_NBHQD[i], do_NBHQE[i]
            logits_BHQC = grid.logits(q_BHQD, k_BHCD, i, j, *_pair(seg_q, seg_k, i, j))
            p_BHQC = jnp.exp(logits_BHQC - lse_NBHQ[i][..., None])
            dv_BHCE = dv_BHCE + jnp.einsum("bhqc,bhqe->bhce", p_BHQC, do_BHQE)
            dp_BHQC = jnp.einsum("bhqe,bhce->bhqc", do_BHQE, v_BHCE)
            ds_BHQC = p_BHQC * (dp_BHQC - delta_NBHQ[i][..., None])
            dk_BHCD = dk_BHCD + jnp.einsum("bhqc,bhqd->bhcd", ds_BHQC, q_BHQD)
            dq_NBHQD = dq_NBHQD.at[i].add(jnp.einsum("bhqc,bhcd->bhqd", ds_BHQC, k_BHCD))
            return dq_NBHQD, dk_BHCD, dv_BHCE

        init = (dq_NBHQD, jnp.zeros_like(k_BHCD), jnp.zeros_like(v_BHCE))
        dq_NBHQD, dk_BHCD, dv_BHCE = jax.lax.fori_loop(
            grid.query_blocks_start(j), grid.num_q, query_block, init
        )
        return dq_NBHQD, (dk_BHCD, dv_BHCE)

    dq_NBHQD, (dk_NBHCD, dv_NBHCE) = jax.lax.scan(
        key_block, jnp.zeros_like(q_NBHQD), (k_NBHCD, v_NBHCE, jnp.arange(grid.num_k))
    )
    return (
        _from_blocks(dq_NBHQD, grid.tq),
        _from_blocks(dk_NBHCD, grid.tk),
        _from_blocks(dv_NBHCE, grid.tk),
        None,  # segment ids: integers, no cotangent
    )


_flash.defvjp(_flash_fwd, _flash_bwd)


def cached_softmax_attention(q, k_cache, v_cache, position, *, scale=None, block_size=512):
    """Causal softmax attention of new queries over a KV cache, visiting only its filled part.

    q `[B, Tq, H, D]` are the queries at positions `position + i` (i < Tq); `k_cache`
    `[B, L, H, D]` and `v_cache` `[B, L, H, Dv]` hold the keys and values of positions
    `0 .. position + Tq − 1` (the new tokens' included) in their first slots; `position` is an
    int32 scalar and may be traced. Query i sees slot j iff `j ≤ position + i`; the slots after
    `position + Tq − 1` are never read. Returns o `[B, Tq, H, Dv]` in `result_type(q, k, v)`.

    Queries are cut into blocks of `block_size` (a `lax.map`), and for each query block the
    cache is read block by block (`block_size` slots, in its own layout: no transposed or
    padded copy of the cache) by a `lax.while_loop` that stops after the last block a query of
    the block may see, with the online softmax of `blockwise_softmax_attention` (running max,
    sum and numerator in float32, masked before `exp`). So one decoded token at position N
    costs O(N), not O(L), and a prefill of T tokens O(T·(position + T)) time and
    O(block_size²) memory beyond q, the cache and o. Forward only (a while loop has no
    reverse-mode gradient); `blockwise_softmax_attention` is the trainable form.
    """
    check_layouts(
        q=(q, "[B, Tq, H, D]"),
        k_cache=(k_cache, "[B, L, H, D]"),
        v_cache=(v_cache, "[B, L, H, Dv]"),
    )
    check_positive_int("block_size", block_size)
    if jnp.ndim(position) != 0:
        raise ValueError(f"position must be a scalar, got shape {tuple(jnp.shape(position))}")
    out_dtype = jnp.result_type(q, k_cache, v_cache)
    b, tq, h, d = q.shape
    length, dv = k_cache.shape[1], v_cache.shape[3]
    k_block, q_block = min(block_size, length), min(block_size, tq)
    num_q = -(-tq // q_block)
    f32 = jnp.float32
    q_NBHQD = _to_blocks(q.astype(f32) * resolve_scale(scale, d), q_block)
    position = jnp.asarray(position, jnp.int32)

    def query_block(xs):
        q_BHQD, i = xs
        q_pos_Q = position + i * q_block + jnp.arange(q_block, dtype=jnp.int32)
        # key blocks [0, n) hold every slot the block's last (unpadded) query may see
        last = position + jnp.minimum((i + 1) * q_block, tq)
        num_blocks = jnp.minimum((last + k_block - 1) // k_block, -(-length // k_block))

        def key_block(carry):
            j, max_BHQ, sum_BHQ, acc_BHQE = carry
            # The last block may be cut short: read the `k_block` slots ending at L and mask
            # the ones an earlier block already covered.
            start = jnp.minimum(j * k_block, length - k_block)
            k_BCHD = jax.lax.dynamic_slice_in_dim(k_cache, start, k_block, axis=1)
            v_BCHE = jax.lax.dynamic_slice_in_dim(v_cache, start, k_block, axis=1)
            # a non-finite value poisons only the queries that see its slot (module docstring);
            # the empty slots after the last query may hold anything and are never seen
            k_BCHD, v_BCHE = quarantine(k_BCHD, v_BCHE)
            logits_BHQC = jnp.einsum("bhqd,bchd->bhqc", q_BHQD, k_BCHD)
            k_pos_C = start + jnp.arange(k_block, dtype=jnp.int32)
            visible_QC = (k_pos_C[None, :] >= j * k_block) & (k_pos_C[None, :] <= q_pos_Q[:, None])
            logits_BHQC = jnp.where(visible_QC, logits_BHQC, -jnp.inf)
            new_max_BHQ = jnp.maximum(max_BHQ, jnp.max(logits_BHQC, axis=-1))
            shift_BHQ = jnp.where(jnp.isneginf(new_max_BHQ), 0.0, new_max_BHQ)  # as in _flash
            rescale_BHQ = jnp.exp(max_BHQ - shift_BHQ)
            p_BHQC = jnp.exp(logits_BHQC - shift_BHQ[..., None])
            sum_BHQ = rescale_BHQ * sum_BHQ + jnp.sum(p_BHQC, axis=-1)
            pv_BHQE = jnp.einsum("bhqc,bche->bhqe", p_BHQC, v_BCHE)
            return j + 1, new_max_BHQ, sum_BHQ, rescale_BHQ[..., None] * acc_BHQE + pv_BHQE

        init = (
            jnp.zeros((), jnp.int32),
            jnp.full((b, h, q_block), -jnp.inf, f32),
            jnp.zeros((b, h, q_block), f32),
            jnp.zeros((b, h, q_block, dv), f32),
        )
        _, _, sum_BHQ, acc_BHQE = jax.lax.while_loop(lambda c: c[0] < num_blocks, key_block, init)
        return acc_BHQE / jnp.where(sum_BHQ > 0, sum_BHQ, 1.0)[..., None]

    o_NBHQE = jax.lax.map(query_block, (q_NBHQD, jnp.arange(num_q, dtype=jnp.int32)))
    return _from_blocks(o_NBHQE, tq).astype(out_dtype)

"""Causal sliding-window softmax attention: each query sees the last `window` keys.

For every batch row b and head h, with `scale = 1/√D` unless given and W = `window`,

    o_t = Σ_{t−W < s ≤ t} p_ts v_s ,   p_ts = exp(s_ts − m_t) / Σ_{t−W < s' ≤ t} exp(s_ts' − m_t) ,
    s_ts = scale · q_t·k_s ,   m_t = max_s s_ts .

With W ≥ T it is plain causal softmax attention; with W = 1 every token returns its own value.
Logits, the softmax and its sums are float32 (masked with −∞ by `where` before `exp`); the
output has dtype `result_type(q, k, v)`.

Keys before the queries (a decoding cache or the previous shard's halo). `k, v` may hold
`Tk ≥ Tq` keys: the queries are the last `Tq` of them, as in `softmax_attention(causal=True)`.
`position` (an int scalar, may be traced) is the absolute position of the first query, so key j
sits at `position − (Tk − Tq) + j`; keys at negative positions (an empty cache slot, the halo of
the first shard) are never seen.

Algorithm, O(T·W) time and memory (never a T×T mask or logits):

  1. Cut the queries into blocks of `c = max(block_size, W)` steps and left-pad the keys so that
     key block i + 1 holds the keys of query block i, and key block 0 the keys before the
     queries. (Tq ≤ c: one query block against all the keys, unpadded: a decoding step
     costs O(W).)
  2. Query block i attends to key blocks i and i + 1 ([c, 2c] logits per block) under the band
     mask 0 ≤ (query position − key position) < W (plus key validity and segment ids).
  3. A softmax over the 2c keys of each row; rows with no visible key give zeros.

All blocks are computed at once (no loop); the gradient is autodiff of these blocked ops, so it
too keeps O(T·c) probabilities. Packed rows: with `segment_ids [B, T]` (then Tq = Tk) a query
sees only keys with its own id. Non-finite values poison only the queries that see them, as in
`softmax_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import check_positive_int
from linear_attention.kernels.softmax.softmax import check_inputs, quarantine, resolve_scale

__all__ = ["sliding_window_attention"]


def sliding_window_attention(
    q, k, v, *, window: int, scale=None, segment_ids=None, position=0, block_size: int = 64
):
    """Causal softmax attention of each query over its last `window` keys (module docstring).

    q `[B, Tq, H, D]`, k `[B, Tk, H, D]`, v `[B, Tk, H, Dv]` with Tk ≥ Tq (the queries are the
    last Tq keys' positions) -> o `[B, Tq, H, Dv]` in `result_type(q, k, v)`. `window` and
    `block_size` are static ints ≥ 1 (blocks have max(block_size, window) steps, fewer for a
    short input); `position` is the first query's absolute position (keys before position 0
    are masked); `segment_ids [B, T]` restricts each token to its own document (Tq = Tk only).
    """
    window, block_size, segment_ids = _check(
        q, k, v, window, scale, segment_ids, position, block_size
    )
    tq, tk = q.shape[1], k.shape[1]
    out_dtype = jnp.result_type(q, k, v)
    b, _, h, d = q.shape
    dv = v.shape[3]
    if tq == 0:
        return jnp.zeros((b, 0, h, dv), out_dtype)
    f32 = jnp.float32

    # ------------------------------------------------------------ 1. blocks, keys aligned
    # Keys more than W − 1 before the first query are seen by no query: drop them.
    num_prefix = min(tk - tq, window - 1)
    k, v = k[:, tk - tq - num_prefix :], v[:, tk - tq - num_prefix :]
    k32, v32 = quarantine(k, v)
    c = max(block_size, window)  # ≥ W − 1: a window lies in its own key block and the one before
    if tq <= c:
        # One query block (a decoding step, a short sequence): it sees all the keys, no padding.
        c, n, lead = tq, 1, num_prefix

        def key_blocks(x_BT_):
            return x_BT_[:, None]
    else:
        n, lead = -(-tq // c), c

        def key_blocks(x_BT_):
            """[B, Tk', ...] -> [B, N, 2c, ...]: key blocks i and i + 1 for query block i."""
            pad = ((0, 0), (c - num_prefix, n * c - tq)) + ((0, 0),) * (x_BT_.ndim - 2)
            x_BMC_ = jnp.pad(x_BT_, pad).reshape(b, n + 1, c, *x_BT_.shape[2:])
            return jnp.concatenate([x_BMC_[:, :-1], x_BMC_[:, 1:]], axis=2)

    q_scaled = jnp.asarray(q, f32) * resolve_scale(scale, d)
    q_BNCHD = jnp.pad(q_scaled, ((0, 0), (0, n * c - tq), (0, 0), (0, 0))).reshape(b, n, c, h, d)
    k_BNSHD, v_BNSHE = key_blocks(k32), key_blocks(v32)

    # ------------------------------------------------------------ 2. band-masked logits
    # Query row r of block i is query i·c + r; key slot s of its span is key i·c + s − lead of
    # the queries' own (slot `lead` is the key of the block's first query).
    logits_BHNCS = jnp.einsum("bnchd,bnshd->bhncs", q_BNCHD, k_BNSHD)
    visible_NCS = _band(n, c, k_BNSHD.shape[2], lead, num_prefix, tq, window, position)
    visible = visible_NCS[None]  # [1, N, C, S]
    if segment_ids is not None:  # (then num_prefix = 0)
        seg_BNC = jnp.pad(segment_ids, ((0, 0), (0, n * c - tq))).reshape(b, n, c)
        visible = visible & (seg_BNC[..., :, None] == key_blocks(segment_ids)[..., None, :])
    logits_BHNCS = jnp.where(visible[:, None], logits_BHNCS, -jnp.inf)

    # ------------------------------------------------------------ 3. softmax over the band
    # As in softmax_attention: the shift carries no gradient; an empty row's max −∞ becomes 0.
    max_BHNC1 = jax.lax.stop_gradient(jnp.max(logits_BHNCS, axis=-1, keepdims=True))
    max_BHNC1 = jnp.where(jnp.isneginf(max_BHNC1), 0.0, max_BHNC1)
    p_BHNCS = jnp.exp(logits_BHNCS - max_BHNC1)
    denom_BHNC1 = jnp.sum(p_BHNCS, axis=-1, keepdims=True)
    p_BHNCS = p_BHNCS / jnp.where(denom_BHNC1 > 0, denom_BHNC1, 1.0)
    o_BNCHE = jnp.einsum("bhncs,bnshe->bnche", p_BHNCS, v_BNSHE)
    return o_BNCHE.reshape(b, n * c, h, dv)[:, :tq].astype(out_dtype)


def _check(q, k, v, window, scale, segment_ids, position, block_size):
    """`sliding_window_attention`'s checks; `(window, block_size, segment_ids)` checked."""
    window = check_positive_int("window", window)
    block_size = check_positive_int("block_size", block_size)
    segment_ids = check_inputs(q, k, v, scale, segment_ids)
    if k.shape[1] < q.shape[1]:
        raise ValueError(
            f"sliding_window_attention needs at least as many keys as queries (the queries are "
            f"the last Tq keys), got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if jnp.ndim(position) != 0:
        raise ValueError(f"position must be a scalar, got shape {tuple(jnp.shape(position))}")
    return window, block_size, segment_ids


def _band(n, c, span, lead, num_prefix, tq, window, position):
    """`[N, C, S]` bool: whether query row r of block i sees key slot s of its span (query
    i·c + r, key i·c + s − lead): within the last `window` keys, a key of the sequence, and
    not before absolute position 0."""
    i_N11 = jnp.arange(n)[:, None, None]
    r_1C1 = jnp.arange(c)[None, :, None]
    s_11S = jnp.arange(span)[None, None, :]
    lag_NCS = r_1C1 + lead - s_11S  # query position − key position
    key_index_NCS = i_N11 * c + s_11S - lead + num_prefix  # index into the (trimmed) keys
    visible_NCS = (lag_NCS >= 0) & (lag_NCS < window)
    visible_NCS &= (key_index_NCS >= 0) & (key_index_NCS < tq + num_prefix)
    # absolute key position = position − num_prefix + key index: never before the sequence
    return visible_NCS & (jnp.asarray(position, jnp.int32) - num_prefix + key_index_NCS >= 0)

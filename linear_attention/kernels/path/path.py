"""PaTH attention (Yang et al. 2025, "PaTH Attention: Position Encoding via Accumulating
Householder Transformations"): softmax attention whose key is transported to the query by the
Householder transforms of the tokens between them.

Per head, with H_t = I − β_t w_t w_tᵀ (w_t a unit vector and β_t ∈ (0, 2) for a reflection-like,
non-expansive map: the layer L2-normalises w and takes β = 2·sigmoid) and an optional log forget
gate a_t = log f_t ≤ 0 (FoX's, −inf a reset):

    s_ij = scale · q_iᵀ H_i H_{i−1} ⋯ H_{j+1} k_j + Σ_{j<l≤i} a_l        (j ≤ i; −∞ for j > i)
    o_i  = Σ_j softmax_j(s_ij) v_j

H_i is included and H_j is not: a token's own key is not transformed (s_ii = scale·q_i·k_i), as
in the paper and FLA's `naive_path_attn` (whose `A_local` is q_iᵀ k_j − Σ over the tokens in
(j, i] only). The gate is FoX's, added unscaled; FLA's naive form scales the gate by `scale`
too (softmax(scale·(qᵀPk + G_i − G_j))), which is this kernel with a = g·scale.

Checked values (`check_householder`). H_t is non-expansive exactly when 0 ≤ β_t‖w_t‖² ≤ 2, so the
kernel refuses β outside [0, 2] (the closed range: β = 0 is the identity, β = 2 an exact
reflection), NaN in β or w, and ‖w_t‖ > 1 (a non-unit w; a shorter one is accepted, as
`l2norm`'s ε shortens a near-zero w, and the map stays non-expansive). β and w are data: like
every value check of the kernels (`checks.concrete`), these run when the values are concrete
(eagerly, or constants closed over under `jit`) and are skipped for traced values, where the
layer's β = 2·sigmoid and L2-normalised w are in range by construction.

Resets (−inf in the gate, or a document start of `segment_ids`) cut attention across them as in
FoX: c and the reset count n come from `segments.cumulative_log_decay(restart=True)` and query i
sees key j only when n_i = n_j. No logit ever uses an H from across a reset: P_ij involves
H_{j+1} … H_i only, all in i's document when j is.

Methods: "quadratic" (the reference: a `lax.scan` over time carries every key transported to
the current token, K̂ ← H_t K̂ then K̂_t = k_t, and reads the row q_tᵀ K̂ of the logits; the
masked [T, T] softmax follows) and "chunk" (`blockwise.py`: UT/WY products inside blocks,
queries carried back across blocks, online softmax, O(T) memory, custom VJP).

Decoding. A `ForgettingCache` (`softmax/gated_cache.py`, shared with FoX) whose keys are kept
transported to the last filled position: slot j holds H_{p−1} ⋯ H_{j+1} k_j (float32: the keys
are rewritten at every token and would collect rounding in bfloat16). Tq new tokens at p: the
stored keys meet the new queries carried back to p (q_iᵀ H_i ⋯ H_p), the new keys among
themselves take the in-block logits, then every stored key is moved by the new tokens' product
(A k: O(L·D) per token, FLA's `prepare_k_cache` idea) and the new keys are written carried to
the new end. The gate and reset counts continue as FoX's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.kernels.checks import (
    check_float,
    check_layouts,
    check_log_decay,
    concrete,
    refuse_axis_name,
)
from linear_attention.kernels.delta.checks import check_beta
from linear_attention.kernels.path.blockwise import block_terms, path_blockwise
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
from linear_attention.kernels.softmax.softmax import resolve_scale

# How far past 1 a concrete ‖w‖ may be: rounding of an L2-normalised w in its dtype.
W_NORM_SLACK = {2: 1e-2, 4: 1e-4, 8: 1e-8}


def check_householder(w, beta) -> None:
    """Raise unless the concrete values of `beta` lie in [0, 2] and those of `w` are rows of norm
    at most 1 (module docstring, "Checked values"); traced values are not read."""
    check_beta(beta, 0.0, 2.0)
    values = concrete(w)
    if values is None or not values.size:
        return
    norms = np.linalg.norm(values.astype(np.float64), axis=-1)
    slack = W_NORM_SLACK.get(values.dtype.itemsize, 1e-4)
    bad = np.isnan(norms) | (norms > 1.0 + slack)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"w must hold unit vectors (norm at most 1; L2-normalise it) along its last axis, "
            f"got norm {float(norms[at]):.4g} at index {at} [B, T, H] ({int(bad.sum())} rows of "
            f"{norms.size} have norm > 1 or NaN)"
        )


def path_attention(
    q,
    k,
    v,
    w,
    beta,
    log_forget=None,
    *,
    segment_ids=None,
    method: str = "chunk",
    block_size: int = 64,
    scale=None,
    axis_name: str | None = None,
):
    """Causal PaTH attention, see the module docstring.

    Args:
      q, k, w: `[B, T, H, D]`; v: `[B, T, H, Dv]`; beta: `[B, T, H]`.
      log_forget: log f ≤ 0 per token and head, `[B, T, H]` (or `[H]`); −inf is a reset. None:
        no forget gate.
      segment_ids: `[B, T]` integers or a `Segments`: each token sees its own document only.
      method: "chunk" (blockwise, O(T) memory, the training path) or "quadratic" (the
        reference).
      block_size: the block of "chunk" (the UT transform's size and the key/query block).
      scale: the logits' scale (None: 1/√D).
      axis_name: refused (softmax attention has no affine state to pass across shards).
    Returns:
      `o: [B, T, H, Dv]` in `result_type(q, k, v)`; transforms, logits and softmax in float32.
      T = 0 gives the empty output, as `softmax_attention`.
    """
    method, block_size = PATH.check(method, block_size, "block_size")
    refuse_axis_name("path_attention", axis_name)
    check_float(("q", "k", "v", "w", "beta"), (q, k, v, w, beta))
    sizes = check_layouts(
        q=(q, "[B, T, H, D]"),
        k=(k, "[B, T, H, D]"),
        v=(v, "[B, T, H, Dv]"),
        w=(w, "[B, T, H, D]"),
        beta=(beta, "[B, T, H]"),
    )
    B, T, H = sizes["B"], sizes["T"], sizes["H"]
    check_householder(w, beta)
    a_BTH = check_log_decay(log_forget, (B, T, H), "[B, T, H]")
    if T == 0:  # (no block to split)
        return jnp.zeros(v.shape, jnp.result_type(q, k, v))
    a_BTH = fold_resets(segment_resets(segment_ids, B, T), a_BTH, H)
    if a_BTH is None:
        a_BTH = jnp.zeros((B, T, H), jnp.float32)
    f32 = jnp.float32
    q32 = jnp.asarray(q, f32) * resolve_scale(scale, q.shape[-1])
    k32, v32, w32, beta32 = (jnp.asarray(x, f32) for x in (k, v, w, beta))
    # a bad key, value, reflection or gate reaches the later queries of its document only (the
    # transforms of tokens in (j, i] move key j for query i): computed clean, selected to NaN
    guard = nan_guard((B, T, H), (k32, v32, w32, beta32), a_BTH)
    k32, v32, w32, beta32 = (clean(guard, x) for x in (k32, v32, w32, beta32))
    c_BTH, n_BTH = cumulative_log_decay(clean_log_decay(a_BTH), axis=1, restart=True)
    kernel = PATH.kernel(method, block_size=block_size)
    o = kernel(q32, k32, v32, w32, beta32, c_BTH, n_BTH)
    return poison(guard, o).astype(jnp.result_type(q, k, v))


def _quadratic(q_BTHD, k_BTHD, v_BTHE, w_BTHD, beta_BTH, c_BTH, n_BTH):
    """The transported [T, T] logits by a scan over time, then the masked softmax."""
    B, T, H, D = q_BTHD.shape

    def token(keys_BHTD, xs):
        q_BHD, k_BHD, w_BHD, beta_BH, t = xs
        # every stored key moves through H_t; token t's own key enters untransformed
        along_BHT = jnp.einsum("bhtd,bhd->bht", keys_BHTD, w_BHD)
        keys_BHTD = keys_BHTD - (beta_BH[..., None] * along_BHT)[..., None] * w_BHD[:, :, None]
        keys_BHTD = jax.lax.dynamic_update_index_in_dim(keys_BHTD, k_BHD, t, axis=2)
        return keys_BHTD, jnp.einsum("bhtd,bhd->bht", keys_BHTD, q_BHD)

    xs = (q_BTHD, k_BTHD, w_BTHD, beta_BTH)
    xs = (*(jnp.moveaxis(x, 1, 0) for x in xs), jnp.arange(T))
    _, rows_TBHS = jax.lax.scan(token, jnp.zeros((B, H, T, D), jnp.float32), xs)
    logits_BHTS = jnp.moveaxis(rows_TBHS, 0, 2)
    c_BHT, n_BHT = (jnp.moveaxis(x, 1, 2) for x in (c_BTH, n_BTH))
    bias_BHTS = c_BHT[..., :, None] - c_BHT[..., None, :]
    visible = jnp.tril(jnp.ones((T, T), bool)) & (n_BHT[..., :, None] == n_BHT[..., None, :])
    p_BHTS = jax.nn.softmax(jnp.where(visible, logits_BHTS + bias_BHTS, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshe->bthe", p_BHTS, v_BTHE)


def cached_path_attention(
    cache: ForgettingCache, position, q, k, v, w, beta, log_forget=None, *, scale=None
):
    """Tq new tokens at positions `position + i` after the cache's filled slots (a prefill, or
    one decoded token): attends, moves the stored keys through the new tokens' transforms and
    writes the new keys, values, gates and reset counts (module docstring, "Decoding").

    q, k, w: `[B, Tq, H, D]`; v: `[B, Tq, H, Dv]`; beta, log_forget: `[B, Tq, H]`; `position`
    an int32 scalar (may be traced). Returns `(o [B, Tq, H, Dv], new cache)`. Reads all L slots
    (masked before `exp`) and builds the new tokens' [Tq, Tq] block: O(Tq·(L + Tq)·D).
    """
    check_float(("q", "k", "v", "w", "beta"), (q, k, v, w, beta))
    check_layouts(
        q=(q, "[B, T, H, D]"),
        k=(k, "[B, T, H, D]"),
        v=(v, "[B, T, H, Dv]"),
        w=(w, "[B, T, H, D]"),
        beta=(beta, "[B, T, H]"),
        k_cache=(cache.k, "[B, L, H, D]"),
        v_cache=(cache.v, "[B, L, H, Dv]"),
    )
    B, Tq, H, _ = q.shape
    check_householder(w, beta)
    a_BTH = check_log_decay(log_forget, (B, Tq, H), "[B, T, H]")
    if a_BTH is None:
        a_BTH = jnp.zeros((B, Tq, H), jnp.float32)
    position = jnp.asarray(position, jnp.int32)
    c_new, n_new = extend_gates(cache, position, a_BTH)
    f32 = jnp.float32
    q32 = jnp.asarray(q, f32) * resolve_scale(scale, q.shape[-1])
    heads_first = lambda x: jnp.moveaxis(jnp.asarray(x, f32), 2, 1)  # noqa: E731
    terms = block_terms(*map(heads_first, (q32, k, w, beta)))  # one block: [B, H, Tq, ·]
    stored_BLHD = cache.k.astype(f32)
    logits_BHTL = jnp.einsum("bhid,blhd->bhil", terms.q, stored_BLHD)
    logits_BHTL = jax.lax.dynamic_update_slice(logits_BHTL, terms.s, (0, 0, 0, position))
    moved_BLHD = jnp.einsum("bhed,blhd->blhe", terms.a, stored_BLHD)  # k ← A k
    cache = cache._replace(k=moved_BLHD.astype(cache.k.dtype))
    cache = write_slots(cache, position, jnp.moveaxis(terms.k, 1, 2), v, c_new, n_new)
    o = attend_slots(cache, position, logits_BHTL, c_new, n_new)
    return o.astype(jnp.result_type(q, k, v)), cache


def path_attention_step(
    cache: ForgettingCache, position, q, k, v, w, beta, log_forget=None, *, scale=None
):
    """One token (`q, k, w: [B, H, D]`, `v: [B, H, Dv]`, `beta, log_forget: [B, H]`) at
    `position`: `(o [B, H, Dv], new cache)`, as `cached_path_attention` with Tq = 1 (the stored
    keys move by one rank-one update, k ← k − β (w·k) w)."""
    a = None if log_forget is None else jnp.asarray(log_forget)[:, None]
    o, cache = cached_path_attention(
        cache,
        position,
        q[:, None],
        k[:, None],
        v[:, None],
        w[:, None],
        jnp.asarray(beta)[:, None],
        a,
        scale=scale,
    )
    return o[:, 0], cache


def _chunk(q, k, v, w, beta, c, n, *, block_size):
    return path_blockwise(q, k, v, w, beta, c, n, block_size)


def chunk_flops(*, seq_len, heads, dk, dv, chunk_size, **_):
    """ "chunk" per token, blocks of C = min(block, T): 2·H·(T·(dk + dv) + T·dk²/C + 5·C·dk +
    C² + dk²): softmax attention's count (every block pair is computed, the masked ones too),
    the queries carried through one [dk, dk] block product per key block, and per token the
    block's UT terms (the Gram and key matrices, T(β⊙W), q̃, k̃ and ℓ: about five C·dk
    products, the C×C inverse and products, and A's dk² share)."""
    t, c = seq_len, min(chunk_size, seq_len)
    return 2.0 * heads * (t * (dk + dv) + t * dk * dk / c + 5 * c * dk + c * c + dk * dk)


def quadratic_flops(*, seq_len, heads, dk, dv, **_):
    """ "quadratic" per token: 2·H·T·(2·dk + dv) (each step moves all T stored keys through
    H_t and reads a row of logits)."""
    return 2.0 * heads * seq_len * (2 * dk + dv)


PATH = Family(
    name="path_attention",
    methods={
        "chunk": Method(_chunk, chunk_flops, static=("block_size",)),
        "quadratic": Method(_quadratic, quadratic_flops),
    },
    step=path_attention_step,
    state=ForgettingCache,
    old_words=("blockwise",),
)

"""Log-linear attention (Guo, Yang, Goel, Xing, Dao, Kim 2025, "Log-Linear Attention"): linear
attention whose past is held in a Fenwick tree of O(log T) states, each read with its own
data-dependent weight.

Per head, with a scalar log decay a_t ≤ 0 per token (Mamba-2; −inf: a reset) and level weights
λ_t^ℓ ≥ 0 for ℓ = 0..L − 1,

    o_t = Σ_{j ≤ t} λ_t^{ℓ(t, j)} exp(Σ_{j<u≤t} a_u) (q_t·k_j) v_j,   ℓ(t, j) = bit_length(t ⊕ j)

that is O = (Q Kᵀ ⊙ M^S ⊙ M^H) V with M^S the Mamba-2 decay mask and M^H_tj = λ_t^{ℓ(t, j)}.
Level ℓ ≥ 1 of position t is the bucket of the Fenwick decomposition of t's prefix whose size
is 2^(ℓ−1) (present iff bit ℓ − 1 of t is set); level 0 is the token itself. Positions are
absolute, counted from the row's first token (or `position`); L weights cover positions below
2^(L−1). This is the indexing of flash-linear-attention's `naive.py`. With all λ = 1 it is
Mamba-2 (gated linear attention with a scalar decay).

Methods (`fenwick` derives the level arithmetic, each file its form):
- "quadratic": builds M^H and M^S exactly, O(T²) memory — the reference;
- "chunk": chunks of C = 2^c tokens aligned to absolute positions; levels ≤ c are a masked
  quadratic inside a chunk, levels > c are the chunk-level Fenwick states carried by a scan
  over chunks (`chunked`); the training path;
- "scan": the decoding step (`log_linear_attention_step`) scanned over time.

Resets. A −inf log decay empties every level (the Mamba-2 mask is 0 across it); packed rows
(`segment_ids`) are resets at document starts, the library's one reset mechanism. The Fenwick
buckets keep following the row's positions across a reset: a document that starts at row
position p is bucketed as positions p, p + 1, …, not 0, 1, … (flash-linear-attention's
variable-length form restarts them; a chunk form aligned to the row cannot, so a packed
document's outputs differ from its outputs alone, while it still reads no other document).

States. The state after t tokens is the list of its level states (`fenwick`), one array
`[B, H, L, K, V]` float32: slot s holds level s + 1, L = the number of level weights
(O(log T) matrices). An initial state is the state of a prefix and means nothing without the
prefix's length: it is given with `position`, the absolute position of the first token here
(the prefix's length), and every method reads it in parallel (a key of the state's level ℓ
sits at level max(ℓ, bit_length((P + i) ⊕ P)) of query P + i). `return_state` gives the
state at P + T, collected in parallel (key j at level bit_length((P + T) ⊕ (P + j))).

Sequence parallelism is refused: the Fenwick buckets of a span depend on its absolute position
and its summary is an [L, L] level map, not the library's affine `S_out = A S_in + U` on one
[K, V] state (`primitives.combine`).
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.checks import (
    check_choice,
    check_float,
    check_layouts,
    check_log_decay,
    check_positive_int,
    concrete,
)
from linear_attention.kernels.log_linear.chunked import log_linear_chunked
from linear_attention.kernels.log_linear.fenwick import capacity, final_state, read_state
from linear_attention.kernels.log_linear.quadratic import log_linear_quadratic
from linear_attention.kernels.log_linear.recurrent import log_linear_scan, step
from linear_attention.kernels.segments import fold_resets, segment_resets

METHODS = ("chunk", "quadratic", "scan")


def empty_state(batch: int, heads: int, num_levels: int, key_dim: int, value_dim: int):
    """The state before the first token: `[B, H, L, K, V]` float32 zeros."""
    return jnp.zeros((batch, heads, num_levels, key_dim, value_dim), jnp.float32)


def _check_position(position):
    if isinstance(position, bool):
        raise ValueError(f"position must be an integer >= 0, got {position!r}")
    if jnp.ndim(position) != 0 or not jnp.issubdtype(jnp.result_type(position), jnp.integer):
        raise ValueError(f"position must be an integer scalar, got {position!r}")
    value = concrete(position)
    if value is not None and int(value) < 0:
        raise ValueError(f"position must be an integer >= 0, got {int(value)}")
    return value


def _check_state(state, B, H, L, K, V):
    want = (B, H, L, K, V)
    if tuple(jnp.shape(state)) != want:
        raise ValueError(
            f"initial_state must be the level states [B, H, L, K, V] = {want}, got shape "
            f"{tuple(jnp.shape(state))}"
        )
    check_float(("initial_state",), (state,))
    return jnp.asarray(state, jnp.float32)


def log_linear_attention(
    q,
    k,
    v,
    log_decay,
    level_weights,
    *,
    segment_ids=None,
    method: str = "chunk",
    chunk_size: int = 64,
    initial_state=None,
    position=0,
    return_state: bool = False,
    axis_name: str | None = None,
):
    """Causal log-linear attention (see the module docstring).

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, H, V]` (no scaling inside).
      log_decay: `[B, T, H]` (or `[H]`, fixed; None: no decay), ≤ 0, −inf a reset.
      level_weights: λ `[B, T, H, L]`, the weight of each level ℓ = 0..L − 1 per query; the
        tokens must lie below position 2^(L−1).
      segment_ids: `[B, T]` integers or a `Segments`: resets at document starts.
      method: "chunk" (the training path), "quadratic" (the reference) or "scan".
      chunk_size: a power of two (the chunk used is at most 2^(L−1) and the next power of two
        of T).
      initial_state: the level states `[B, H, L, K, V]` of the `position` tokens before these
        (None: empty).
      position: the absolute position of the first token, an int or a traced int32 scalar;
        past the capacity 2^(L−1) the outputs are NaN (a ValueError when it is known).
      return_state: also return the level states after the last token.
      axis_name: refused (see the module docstring).
    Returns:
      `o [B, T, H, V]` in `result_type(q, k, v)`, and with `return_state` the final state.
    """
    check_choice("method", method, METHODS)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if chunk_size & (chunk_size - 1):
        raise ValueError(
            f"chunk_size must be a power of two (chunks align to the levels), got {chunk_size}"
        )
    if axis_name is not None:
        raise ValueError(
            "log_linear_attention has no sequence-parallel form (axis_name): its Fenwick levels "
            "depend on absolute positions and a span's summary is a map between levels, not "
            "the affine S_out = A S_in + U on one state; run it with time unsplit (mesh.seq = 1)"
        )
    check_float(("q", "k", "v", "level_weights"), (q, k, v, level_weights))
    sizes = check_layouts(
        q=(q, "[B, T, H, K]"),
        k=(k, "[B, T, H, K]"),
        v=(v, "[B, T, H, V]"),
        level_weights=(level_weights, "[B, T, H, L]"),
    )
    B, T, H, K, V, L = (sizes[x] for x in "BTHKVL")
    p_static = _check_position(position)
    if p_static is not None and int(p_static) + T > capacity(L):
        raise ValueError(
            f"level_weights has L={L} levels, which cover positions below 2^(L-1) = "
            f"{capacity(L)}; the tokens reach position {int(p_static) + T - 1} (give at least "
            f"{(int(p_static) + T - 1).bit_length() + 1} levels)"
        )
    a_BTH = check_log_decay(log_decay, (B, T, H), "[B, T, H]")
    a_BTH = fold_resets(segment_resets(segment_ids, B, T), a_BTH, H)
    if a_BTH is None:
        a_BTH = jnp.zeros((B, T, H), jnp.float32)
    dtype = jnp.result_type(q, k, v)
    q32, k32, v32, lam32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v, level_weights))
    s0 = None if initial_state is None else _check_state(initial_state, B, H, L, K, V)
    match method:
        case "chunk":
            C = min(chunk_size, capacity(L), 1 << max(T - 1, 0).bit_length())
            o = log_linear_chunked(q32, k32, v32, a_BTH, lam32, position, C)
        case "quadratic":
            o = log_linear_quadratic(q32, k32, v32, a_BTH, lam32, position)
        case "scan":
            start = empty_state(B, H, L, K, V) if s0 is None else s0
            o, s_scan = log_linear_scan(q32, k32, v32, a_BTH, lam32, start, position)
        case _:
            raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    p = jnp.asarray(position, jnp.int32)
    if method != "scan" and s0 is not None:
        o = o + read_state(q32, lam32, a_BTH, s0, p)
    over_T = p + jnp.arange(T) >= capacity(L)
    o = jnp.where(over_T[None, :, None, None], jnp.nan, o).astype(dtype)
    if not return_state:
        return o
    if method == "scan":
        s = s_scan
    else:
        start = empty_state(B, H, L, K, V) if s0 is None else s0
        s = final_state(k32, v32, a_BTH, start, p)
    return o, jnp.where(p + T > capacity(L), jnp.nan, s)


def log_linear_attention_step(state, position, q, k, v, log_decay, level_weights):
    """One token at `position` (an int32 scalar, may be traced) from the level states `state`
    `[B, H, L, K, V]`: q, k `[B, H, K]`, v `[B, H, V]`, log_decay `[B, H]` (or `[H]`; None: no
    decay), level_weights `[B, H, L]`. Returns `(o [B, H, V], new state)`: the levels decay,
    are read, and merge as the Fenwick counter steps to position + 1 (see `recurrent.step`);
    the number of levels L is static (the shapes), the position alone picks the merge. o is NaN
    at or past position 2^(L−1)."""
    check_float(("q", "k", "v", "level_weights"), (q, k, v, level_weights))
    sizes = check_layouts(
        q=(q, "[B, H, K]"),
        k=(k, "[B, H, K]"),
        v=(v, "[B, H, V]"),
        level_weights=(level_weights, "[B, H, L]"),
    )
    B, H, K, V, L = (sizes[x] for x in "BHKVL")
    _check_position(position)
    s = _check_state(state, B, H, L, K, V)
    a_BH = check_log_decay(log_decay, (B, H), "[B, H]")
    if a_BH is None:
        a_BH = jnp.zeros((B, H), jnp.float32)
    q32, k32, v32, lam32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v, level_weights))
    o, s = step(s, jnp.asarray(position, jnp.int32), q32, k32, v32, a_BH, lam32)
    return o.astype(jnp.result_type(q, k, v)), s

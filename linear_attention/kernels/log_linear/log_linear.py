"""Log-linear attention (Guo, Yang, Goel, Xing, Dao, Kim 2025, "Log-Linear Attention"): linear
attention whose past is held in a Fenwick tree of O(log T) states, each read with its own
data-dependent weight.

Per head, with a scalar log decay a_t ≤ 0 per token (Mamba-2; −inf: a reset) and level weights
λ_t^ℓ ≥ 0 for ℓ = 0..L − 1,

    o_t = Σ_{j ≤ t} λ_t^{ℓ(t, j)} exp(Σ_{j<u≤t} a_u) (q_t·k_j) v_j,  ℓ(t, j) = bit_length(p_t ⊕ p_j)

with p_t the position of token t in its sequence: O = (Q Kᵀ ⊙ M^S ⊙ M^H) V with M^S the Mamba-2
decay mask and M^H_tj = λ_t^{ℓ(t, j)}. Level ℓ ≥ 1 of position p is the bucket of the Fenwick
decomposition of p's prefix whose size is 2^(ℓ−1) (present iff bit ℓ − 1 of p is set); level 0
is the token itself; L weights cover positions below 2^(L−1). This is the indexing of
flash-linear-attention's `naive.py`. With all λ = 1 it is Mamba-2 (gated linear attention with
a scalar decay).

Methods (`fenwick` derives the level arithmetic, each file its form):
- "quadratic": builds M^H and M^S exactly, O(T²) memory — the reference;
- "chunk": a masked quadratic inside each chunk (any size), the L level states entering each
  chunk carried by a scan over chunks, read with one weight per query and level (`chunked`);
  the training path;
- "scan": the decoding step (`log_linear_attention_step`) scanned over time (its autodiff keeps
  the level states of every token: for checking and decoding, not training).

Gradient memory (XLA's temporaries of `jax.grad`, CPU, B = 1, T = 2048, H = 2, K = V = 32,
L = 12, chunks of 64): "chunk" 33 MiB, "scan" 538 MiB (one set of level states per token is
192 MiB, one per chunk 3 MiB).

Resets and positions. Positions count from a sequence's first token: a −inf log decay (or a
document start of `segment_ids`, the library's one reset mechanism, folded into −inf) empties
every level and restarts the positions at 0, so a packed document is bucketed as it is alone,
as in flash-linear-attention's variable-length form. A −inf of one head restarts that head
only, so positions are kept per row and head.

States. The state is a `LogLinearState`: the list of level states `[B, H, L, K, V]` float32
(slot s: level s + 1; L = the number of level weights, O(log T) matrices) and the position
`[B, H]` of the sequence it summarizes. A state means nothing without its position (it decides
which levels the next tokens read and merge), so the position travels in it. Every method reads
an initial state in parallel (a key of the state's level ℓ sits at level
max(ℓ, bit_length(p ⊕ P)) of a query at p) and returns the final one.

Sequence parallelism (`axis_name`): a span's positions continue from those before it and its
outputs read the levels entering it; both are a prefix over the spans (an integer one for the
positions, then an affine S_out = M S_in + U with M an [L, L] level map), see
`sequence_parallel`.
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
)
from linear_attention.kernels.log_linear.chunked import log_linear_chunked
from linear_attention.kernels.log_linear.fenwick import LogLinearState, capacity, positions
from linear_attention.kernels.log_linear.quadratic import log_linear_quadratic
from linear_attention.kernels.log_linear.recurrent import log_linear_scan, step
from linear_attention.kernels.log_linear.sequence_parallel import split_over
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.primitives.nan_guard import guard_inputs, poison, poison_state
from linear_attention.kernels.segments import fold_resets, segment_resets


def check_state(state, B, H, L, K, V, name="initial_state") -> LogLinearState:
    if not isinstance(state, LogLinearState):
        raise ValueError(f"{name} must be a LogLinearState, got {type(state).__name__}")
    want = (B, H, L, K, V)
    if tuple(jnp.shape(state.levels)) != want:
        raise ValueError(
            f"{name}.levels must be [B, H, L, K, V] = {want}, got shape "
            f"{tuple(jnp.shape(state.levels))}"
        )
    if tuple(jnp.shape(state.position)) != (B, H):
        raise ValueError(
            f"{name}.position must be [B, H] = {(B, H)}, got shape "
            f"{tuple(jnp.shape(state.position))}"
        )
    check_float((f"{name}.levels",), (state.levels,))
    if not jnp.issubdtype(jnp.result_type(state.position), jnp.integer):
        raise ValueError(f"{name}.position must be integers, got {jnp.result_type(state.position)}")
    return LogLinearState(
        jnp.asarray(state.levels, jnp.float32), jnp.asarray(state.position, jnp.int32)
    )


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
    initial_state: LogLinearState | None = None,
    return_state: bool = False,
    axis_name: str | None = None,
):
    """Causal log-linear attention (see the module docstring).

    Args:
      q, k: `[B, T, H, K]`; v: `[B, T, H, V]` (no scaling inside).
      log_decay: `[B, T, H]` (or `[H]`, fixed; None: no decay), ≤ 0, −inf a reset.
      level_weights: λ `[B, T, H, L]` ≥ 0 (checked when concrete), the weight of each level
        ℓ = 0..L − 1 per query; 1 ≤ T ≤ 2^(L−1) (the positions L levels cover).
      segment_ids: `[B, T]` integers or a `Segments`: a new sequence at each document start.
      method: "chunk" (the training path), "quadratic" (the reference) or "scan".
      chunk_size: the chunk of "chunk" (any size).
      initial_state: a `LogLinearState` (None: empty, position 0); outputs at positions past
        2^(L−1) are NaN, and so is a final state past it.
      return_state: also return the `LogLinearState` after the last token.
      axis_name: inside `jax.shard_map` with time split over this mesh axis, the result
        (outputs, gradients, the global final state on every shard) equals the unsplit call's
        (`sequence_parallel`).
    Returns:
      `o [B, T, H, V]` in `result_type(q, k, v)`, and with `return_state` the final state.
    """
    method, chunk_size = LOG_LINEAR.check(method, chunk_size)
    check_float(("q", "k", "v", "level_weights"), (q, k, v, level_weights))
    sizes = check_layouts(
        q=(q, "[B, T, H, K]"),
        k=(k, "[B, T, H, K]"),
        v=(v, "[B, T, H, V]"),
        level_weights=(level_weights, "[B, T, H, L]"),
    )
    B, T, H, K, V, L = (sizes[x] for x in "BTHKVL")
    spans = 1 if axis_name is None else jax.lax.axis_size(axis_name)
    check_level_weights(level_weights, T * spans)
    a_BTH = check_log_decay(log_decay, (B, T, H), "[B, T, H]")
    a_BTH = fold_resets(segment_resets(segment_ids, B, T, axis_name), a_BTH, H)
    if a_BTH is None:
        a_BTH = jnp.zeros((B, T, H), jnp.float32)
    dtype = jnp.result_type(q, k, v)
    q32, k32, v32, lam32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v, level_weights))
    lam32, state = entering_state(initial_state, lam32, (B, H, L, K, V), T * spans)
    guard, (k32, v32), a_BTH, state = guarded(
        (k32, v32), a_BTH, state, axis_name is None and initial_state is not None
    )

    def core(state):
        o, state, p_BTH = _core(state)
        # poisoned here, inside a span, so that a time split carries the NaN as unsplit does
        return poison(guard, o), state._replace(levels=poison_state(guard, state.levels)), p_BTH

    def _core(state):
        p_BTH = positions(a_BTH, state.position)
        kernel = LOG_LINEAR.kernel(method, chunk_size=chunk_size)
        return (*kernel(q32, k32, v32, a_BTH, lam32, p_BTH, state), p_BTH)

    if axis_name is None:
        o, state, p_BTH = core(state)
    else:
        o, state, p_BTH = split_over(core, q32, lam32, a_BTH, state, axis_name)
    return finish(o, state, p_BTH, L, dtype, return_state)


def check_level_weights(level_weights, T: int | None = None) -> None:
    """Raise unless the level weights λ `[..., L]` are ≥ 0 and not NaN (read when concrete, as
    every value check of the kernels: `checks.concrete`) and, given the row length `T`, there is
    at least one token and the L levels cover T positions (`check_levels`)."""
    if T is not None:
        if T == 0:
            raise ValueError(
                f"q, k, v must have at least one time step, got level_weights of shape "
                f"{tuple(jnp.shape(level_weights))} [B, T, H, L]"
            )
        check_levels(jnp.shape(level_weights)[-1], T)
    values = concrete(level_weights)
    if values is None or not values.size:
        return
    values = values.astype(np.float32)
    bad = np.isnan(values) | (values < 0)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"level_weights must be >= 0 (a weight per level, λ in [0, inf)), got "
            f"{float(values[at])} at index {at} ({int(bad.sum())} of {values.size} values "
            "negative or NaN)"
        )


def guarded(writes, a_BTH, state: LogLinearState, initial: bool):
    """The NaN guard of a log-linear call (`primitives.nan_guard`): `(guard, clean writes, clean
    log decay, clean entering state)`; the entering state's levels poison up to the first
    reset when `initial` (a given initial state, time unsplit)."""
    guard, writes, a_BTH, (levels,) = guard_inputs(
        a_BTH.shape, writes, a_BTH, (state.levels,), split=not initial
    )
    return guard, writes, a_BTH, state._replace(levels=levels)


def check_levels(L: int, T: int) -> None:
    """Raise unless `L` levels cover `T` positions (those below 2^(L−1))."""
    if T > capacity(L):
        raise ValueError(
            f"level_weights has L={L} levels, which cover positions below 2^(L-1) = "
            f"{capacity(L)}; T={T} needs at least {(T - 1).bit_length() + 1} levels"
        )


def entering_state(initial_state, lam32, sizes, T: int):
    """`(level weights, state)` entering the first of `T` tokens; `sizes` is `(B, H, L, K, V)`.
    From zeros (`initial_state` None) the levels above bit_length(T − 1) stay empty: only the
    others are carried, with their weights (the rest get no gradient either way), and `finish`
    pads the final state back to L."""
    B, H, L, K, V = sizes
    if initial_state is None:
        lam32 = lam32[..., : min(L, (T - 1).bit_length() + 1)]
        return lam32, LogLinearState.zeros(B, H, lam32.shape[-1], K, V)
    return lam32, check_state(initial_state, B, H, L, K, V)


def finish(o, state: LogLinearState, p_BTH, L: int, dtype, return_state: bool):
    """The outputs in `dtype`, NaN at positions past 2^(L−1) (beyond the levels), and with
    `return_state` the final state padded back to `L` levels (NaN once its position passed)."""
    o = jnp.where((p_BTH >= capacity(L))[..., None], jnp.nan, o).astype(dtype)
    if not return_state:
        return o
    over_BH = (state.position > capacity(L))[..., None, None, None]
    levels = jnp.pad(state.levels, ((0, 0), (0, 0), (0, L - state.levels.shape[2]), (0, 0), (0, 0)))
    return o, LogLinearState(jnp.where(over_BH, jnp.nan, levels), state.position)


def log_linear_attention_step(state: LogLinearState, q, k, v, log_decay, level_weights):
    """One token from `state` (a `LogLinearState`): q, k `[B, H, K]`, v `[B, H, V]`, log_decay
    `[B, H]` (or `[H]`; None: no decay; −inf: a reset, the position restarts at 0),
    level_weights `[B, H, L]`. Returns `(o [B, H, V], new state)`: the levels decay, are read,
    and merge as the Fenwick counter steps from the state's position to the next (see
    `recurrent.step`); L is static (the shapes), the position (traced) picks the merge. o is NaN
    at positions past 2^(L−1)."""
    check_float(("q", "k", "v", "level_weights"), (q, k, v, level_weights))
    sizes = check_layouts(
        q=(q, "[B, H, K]"),
        k=(k, "[B, H, K]"),
        v=(v, "[B, H, V]"),
        level_weights=(level_weights, "[B, H, L]"),
    )
    B, H, K, V, L = (sizes[x] for x in "BHKVL")
    state = check_state(state, B, H, L, K, V, name="state")
    check_level_weights(level_weights)
    a_BH = check_log_decay(log_decay, (B, H), "[B, H]")
    if a_BH is None:
        a_BH = jnp.zeros((B, H), jnp.float32)
    q32, k32, v32, lam32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v, level_weights))
    o, state = step(state, q32, k32, v32, a_BH, lam32)
    return o.astype(jnp.result_type(q, k, v)), state


def _chunk(q, k, v, a, lam, p, state, *, chunk_size):
    return log_linear_chunked(q, k, v, a, lam, p, state, chunk_size)


def _scan(q, k, v, a, lam, p, state):
    del p  # (the scan steps the positions itself)
    return log_linear_scan(q, k, v, a, lam, state)


def levels_reached(num_levels: int, seq_len: int) -> int:
    """The levels that positions below `seq_len` reach (the kernel carries only those)."""
    return min(num_levels, (seq_len - 1).bit_length() + 1)


def chunk_flops(*, seq_len, heads, dk, dv, chunk_size, num_levels, **_):
    """ "chunk" per token: 2·H·(C·(dk + dv) + 2·L·dk·dv) (the intra-chunk scores and their
    sum; reading the L level states and writing the chunk's keys into their slots),
    L = `levels_reached`, C = min(chunk_size, T)."""
    c = min(chunk_size, seq_len)
    return 2.0 * heads * (c * (dk + dv) + 2 * levels_reached(num_levels, seq_len) * dk * dv)


def scan_flops(*, seq_len, heads, dk, dv, num_levels, **_):
    """ "scan" per token: 2·H·(L + 1)·dk·dv (reading every level, writing the token)."""
    return 2.0 * heads * (levels_reached(num_levels, seq_len) + 1) * dk * dv


def quadratic_flops(*, seq_len, heads, dk, dv, **_):
    """ "quadratic" per token: 2·H·T·(dk + dv)."""
    return 2.0 * heads * seq_len * (dk + dv)


LOG_LINEAR = Family(
    name="log_linear_attention",
    methods={
        "chunk": Method(_chunk, chunk_flops, static=("chunk_size",)),
        "quadratic": Method(log_linear_quadratic, quadratic_flops),
        "scan": Method(_scan, scan_flops),
    },
    step=log_linear_attention_step,
    state=LogLinearState,
    splits_time=True,
)

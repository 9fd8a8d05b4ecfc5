"""Log-linear Gated DeltaNet (Guo et al. 2025, section 3): the hierarchical mask applied to Gated
DeltaNet. Gated DeltaNet's output is o_t = Σ_{j ≤ t} A_tj v_j with the effective weights

    A_tj = q_tᵀ Π_{j<u≤t} [exp(a_u)(I − β_u k_u k_uᵀ)] β_j k_j        (the transitions after j)

(in matrix form A = (Q Kᵀ ⊙ M^S)(I + K Kᵀ ⊙ (M^S − I) diag β)⁻¹ diag β up to the ordering of
the decay); the log-linear variant weights them by level, O = (A ⊙ M^H) V, M^H_tj =
λ_t^{ℓ(t, j)} with the Fenwick levels of `fenwick`. As a recurrence: every level state follows the
same delta-rule transition, and the levels merge as in log-linear Mamba-2,

    S^ℓ ← exp(a_t)(I − β_t k_t k_tᵀ) S^ℓ    for every level ℓ ≥ 1      (a reset: all emptied)
    o_t = λ_t^0 β_t (q_t·k_t) v_t + Σ_ℓ λ_t^ℓ S^ℓᵀ q_t
    then the token's β_t k_t v_tᵀ and levels 1..r merge into level r + 1 (`fenwick.merge`).

Methods: "chunk" (the WY form per chunk with the level states carried across chunks,
`delta_chunked`; the training path), "scan" (the recurrence, `lax.scan` over time in chunks of
`chunk_size` tokens whose scan is rematerialised, `jax.checkpoint`: the backward pass keeps the
L level states entering each chunk and recomputes a chunk's tokens from them, holding one
chunk's per-token states at a time) and "quadratic" (the reference: A from `delta.delta_rule`
run on one-hot values, masked by M^H; no states). The state is a `LogLinearState` as for
`log_linear_attention`; positions restart at resets. Sequence parallelism is refused, as for
log-linear Mamba-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.checks import (
    check_float,
    check_layouts,
    check_log_decay,
)
from linear_attention.kernels.delta.checks import check_beta
from linear_attention.kernels.delta.delta import delta_rule
from linear_attention.kernels.log_linear.delta_chunked import delta_chunked
from linear_attention.kernels.log_linear.fenwick import (
    LogLinearState,
    capacity,
    merge,
    padded_weights,
    positions,
)
from linear_attention.kernels.log_linear.log_linear import (
    check_level_weights,
    check_state,
    entering_state,
    finish,
    guarded,
    levels_reached,
)
from linear_attention.kernels.log_linear.quadratic import hierarchical_mask
from linear_attention.kernels.primitives.family import Family, Method
from linear_attention.kernels.primitives.layout import pad_time
from linear_attention.kernels.primitives.nan_guard import poison, poison_state
from linear_attention.kernels.segments import decay_state, fold_resets, segment_resets


def delta_step(state: LogLinearState, q_BHK, k_BHK, v_BHV, beta_BH, a_BH, lam_BHL, valid=True):
    """One token, float32 arrays: `(o [B, H, V], state)` (o NaN past the capacity); with
    `valid [B]` False (a padding token) the state is returned unchanged."""
    P_BH = jnp.where(jnp.isneginf(a_BH), 0, state.position)
    s = decay_state(a_BH[..., None, None, None], state.levels)  # a reset selects 0
    kS = jnp.einsum("bhk,bhlkv->bhlv", k_BHK, s)
    s = s - (beta_BH[..., None] * k_BHK)[:, :, None, :, None] * kS[..., None, :]
    read = jnp.einsum("bhk,bhlkv->bhlv", q_BHK, s)
    o = jnp.einsum("bhl,bhlv->bhv", padded_weights(lam_BHL)[..., 1:], read)
    o += (lam_BHL[..., 0] * beta_BH * jnp.sum(q_BHK * k_BHK, -1))[..., None] * v_BHV
    o = jnp.where((P_BH >= capacity(lam_BHL.shape[-1]))[..., None], jnp.nan, o)
    u = (beta_BH[..., None] * k_BHK)[..., :, None] * v_BHV[..., None, :]
    new = LogLinearState(merge(s, u, P_BH), P_BH + 1)
    if valid is True:
        return o, new
    keep = lambda n, old: jnp.where(jnp.reshape(valid, (-1,) + (1,) * (n.ndim - 1)), n, old)  # noqa: E731
    return o, jax.tree.map(keep, new, state)


def delta_scan(q, k, v, beta, a, lam, state: LogLinearState, chunk_size: int):
    """The recurrence over time, in rematerialised chunks of `chunk_size` tokens."""
    T = q.shape[1]
    C = min(chunk_size, T)
    valid = pad_time(jnp.ones((q.shape[0], T), bool), C)
    xs = [pad_time(x, C) for x in (q, k, v, beta, a, lam)] + [valid]
    N = xs[0].shape[1] // C
    # [B, N·C, ...] -> [N, C, B, ...]: chunks, then tokens, scanned
    xs = [jnp.moveaxis(x.reshape(x.shape[0], N, C, *x.shape[2:]), (1, 2), (0, 1)) for x in xs]

    @jax.checkpoint
    def chunk(state, xs_chunk):
        def token(state, x):
            *x, ok = x
            o, state = delta_step(state, *x, valid=ok)
            return state, o

        return jax.lax.scan(token, state, xs_chunk)

    state, o_NCBHV = jax.lax.scan(chunk, state, xs)
    o = jnp.moveaxis(o_NCBHV, (0, 1), (1, 2)).reshape(q.shape[0], N * C, *o_NCBHV.shape[3:])
    return o[:, :T], state


def delta_quadratic(q, k, v, beta, a, lam, p):
    """O = (A ⊙ M^H) V with A read off the delta rule run on one-hot values (value j = e_j)."""
    B, T, H, _ = q.shape
    onehot = jnp.broadcast_to(jnp.eye(T, dtype=jnp.float32)[None, :, None, :], (B, T, H, T))
    A_BTHS = delta_rule(q, k, onehot, beta, log_decay=a, method="scan")  # [B, T, H, T]
    mask = hierarchical_mask(jnp.moveaxis(lam, 1, 2), jnp.moveaxis(p, 1, 2))  # [B, H, T, T]
    return jnp.einsum("bths,bhts,bshv->bthv", A_BTHS, mask, v)


def log_linear_delta_rule(
    q,
    k,
    v,
    beta,
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
    """Log-linear Gated DeltaNet (see the module docstring).

    Args:
      q, k: `[B, T, H, K]` (unit keys for a contraction); v: `[B, T, H, V]`; beta: `[B, T, H]`
        in [0, 2]; log_decay: `[B, T, H]` or `[H]` (≤ 0, −inf a reset; None: DeltaNet);
        level_weights: λ `[B, T, H, L]` ≥ 0 (checked when concrete), 1 ≤ T ≤ 2^(L−1).
      segment_ids: `[B, T]` integers or a `Segments`: a new sequence at each document start.
      method: "chunk" (WY form, the training path), "scan" (chunk-rematerialised recurrence) or
        "quadratic" (the reference).
      chunk_size: the chunk of "chunk", the rematerialised span of "scan".
      initial_state / return_state: a `LogLinearState` ("chunk" and "scan").
      axis_name: refused.
    Returns:
      `o [B, T, H, V]` in `result_type(q, k, v)`, and with `return_state` the final state.
    """
    method, chunk_size = LOG_LINEAR_DELTA.check(method, chunk_size)
    if axis_name is not None:
        raise ValueError(
            "log_linear_delta_rule has no sequence-parallel form (axis_name): run it with time "
            "unsplit (mesh.seq = 1)"
        )
    if method == "quadratic" and (initial_state is not None or return_state):
        raise ValueError(
            "method 'quadratic' (the reference) has no states: initial_state and return_state "
            "need method 'chunk' or 'scan'"
        )
    check_float(("q", "k", "v", "beta", "level_weights"), (q, k, v, beta, level_weights))
    sizes = check_layouts(
        q=(q, "[B, T, H, K]"),
        k=(k, "[B, T, H, K]"),
        v=(v, "[B, T, H, V]"),
        beta=(beta, "[B, T, H]"),
        level_weights=(level_weights, "[B, T, H, L]"),
    )
    B, T, H, K, V, L = (sizes[x] for x in "BTHKVL")
    check_level_weights(level_weights, T)
    check_beta(beta, 0.0, 2.0)
    a = check_log_decay(log_decay, (B, T, H), "[B, T, H]")
    a = fold_resets(segment_resets(segment_ids, B, T), a, H)
    if a is None:
        a = jnp.zeros((B, T, H), jnp.float32)
    dtype = jnp.result_type(q, k, v)
    q32, k32, v32, b32, lam32 = (
        jnp.asarray(x, jnp.float32) for x in (q, k, v, beta, level_weights)
    )
    lam32, state = entering_state(initial_state, lam32, (B, H, L, K, V), T)
    guard, (k32, v32, b32), a, state = guarded((k32, v32, b32), a, state, initial_state is not None)
    p = positions(a, state.position)
    kernel = LOG_LINEAR_DELTA.kernel(method, chunk_size=chunk_size)
    o, state = kernel(q32, k32, v32, b32, a, lam32, p, state)
    state = state._replace(levels=poison_state(guard, state.levels))
    return finish(poison(guard, o), state, p, L, dtype, return_state)


def log_linear_delta_rule_step(state: LogLinearState, q, k, v, beta, log_decay, level_weights):
    """One token of log-linear Gated DeltaNet from `state`: q, k `[B, H, K]`, v `[B, H, V]`,
    beta `[B, H]`, log_decay `[B, H]` or `[H]` (None: none), level_weights `[B, H, L]`.
    Returns `(o [B, H, V], new state)`."""
    check_float(("q", "k", "v", "beta", "level_weights"), (q, k, v, beta, level_weights))
    sizes = check_layouts(
        q=(q, "[B, H, K]"),
        k=(k, "[B, H, K]"),
        v=(v, "[B, H, V]"),
        beta=(beta, "[B, H]"),
        level_weights=(level_weights, "[B, H, L]"),
    )
    B, H, K, V, L = (sizes[x] for x in "BHKVL")
    state = check_state(state, B, H, L, K, V, name="state")
    check_level_weights(level_weights)
    check_beta(beta, 0.0, 2.0)
    a = check_log_decay(log_decay, (B, H), "[B, H]")
    a = jnp.zeros((B, H), jnp.float32) if a is None else a
    args = (jnp.asarray(x, jnp.float32) for x in (q, k, v, beta))
    o, state = delta_step(state, *args, a, jnp.asarray(level_weights, jnp.float32))
    return o.astype(jnp.result_type(q, k, v)), state


def _chunk(q, k, v, beta, a, lam, p, state, *, chunk_size):
    return delta_chunked(q, k, v, beta, a, lam, p, state, chunk_size)


def _scan(q, k, v, beta, a, lam, p, state, *, chunk_size):
    del p  # (the scan steps the positions itself)
    return delta_scan(q, k, v, beta, a, lam, state, chunk_size)


def _quadratic(q, k, v, beta, a, lam, p, state):
    return delta_quadratic(q, k, v, beta, a, lam, p), state  # (no states: refused above)


def chunk_flops(*, seq_len, heads, dk, dv, chunk_size, num_levels, **_):
    """ "chunk" per token: 2·H·(3·C·dk + 2·C·dv + C²/3 + 2·dk·dv + 2·L·dk·dv + L·dk²·dv/C)
    (the UT transform, W, Q̃ and the intra weights as the delta rule's chunk form; reading the
    L level states, writing the chunk's keys, and the level maps P S once per chunk),
    L = `levels_reached`, C = min(chunk_size, T)."""
    c, L = min(chunk_size, seq_len), levels_reached(num_levels, seq_len)
    per_head = 3 * c * dk + 2 * c * dv + c * c / 3 + 2 * dk * dv
    return 2.0 * heads * (per_head + 2 * L * dk * dv + L * dk * dk * dv / c)


def scan_flops(*, seq_len, heads, dk, dv, num_levels, **_):
    """ "scan" per token: 2·H·(3·L + 1)·dk·dv (kᵀS and the rank-one update on each level
    state, then reading them)."""
    return 2.0 * heads * (3 * levels_reached(num_levels, seq_len) + 1) * dk * dv


def quadratic_flops(*, seq_len, heads, dk, dv, **_):
    """ "quadratic" per token (the delta rule on T one-hot values, then the masked weights):
    2·H·T·(3·dk + dv)."""
    return 2.0 * heads * seq_len * (3 * dk + dv)


LOG_LINEAR_DELTA = Family(
    name="log_linear_delta_rule",
    methods={
        "chunk": Method(_chunk, chunk_flops, static=("chunk_size",)),
        "scan": Method(_scan, scan_flops, static=("chunk_size",)),
        "quadratic": Method(_quadratic, quadratic_flops),
    },
    step=log_linear_delta_rule_step,
    state=LogLinearState,
)

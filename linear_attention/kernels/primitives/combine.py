"""Sequence parallelism for the recurrent kernels: time split over a mesh axis (LASP-2).

Inside `jax.shard_map`, each of the n shards of `axis_name` holds a contiguous span of T/n
tokens. Every recurrent update over a span is affine in the state entering it,

    S_out = A S_in + U

with A the product of the span's transitions: exp(Σ a_t) per head or per key dimension for
causal linear attention (0 after a reset, a log decay of −inf), and the K×K matrix
Π_t exp(a_t)(I − β_t k_t k_tᵀ) for the delta rule. Affine maps compose associatively,
(A₂, U₂)∘(A₁, U₁) = (A₂A₁, A₂U₁ + U₂), so:

  1. every shard runs the local kernel from a zero state, which gives its local outputs and its
     summary (A, U) — for the delta rule in the same run, on extra value columns: from the
     initial state [0 | I] with values [v | 0] the recurrence, linear in (S, v) jointly, ends
     in [U | A] and its extra output columns are A_tᵀ q_t, the entering state's read-out map
     (`affine_sequence_parallel`, which takes any such local kernel: the delta rule, KDA, DPLR,
     DeltaProduct);
  2. the summaries are gathered over the axis (`all_gather`, O(n·state) per device) and an
     inclusive `associative_scan` over shards composes them; shard i enters with the prefix of
     shards < i applied to the global initial state (which so flows into shard 0 only), and
     every shard gets the global final state from the full prefix (a `psum` of the last
     shard's copy, so that it is typed as replicated over the axis);
  3. each shard adds the entering state's contribution to its outputs: q_tᵀ diag(exp(b_t)) S_in
     to the numerator (and q_tᵀ diag(exp(b_t)) z_in to the normaliser) with b_t the cumulative
     log decay from the span's start, or (A_tᵀ q_t)ᵀ S_in for the delta rule.

Work per device is O(T/n) plus O(n) state-sized combines. Packed rows (`segment_ids`) reset at
span starts too: the previous shard's last id arrives by `ppermute`. Gradients are JAX's own
through the collectives (the transpose of `all_gather` is a reduce-scatter), so they equal the
unsplit call's, including those of an initial state replicated over the axis.

Softmax attention has no such state: `softmax_context_parallel` gathers the keys and values of
every shard instead (context parallelism, O(T/n · T) logits per device) and masks with the
global positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.state import LinearAttentionState


def linear_sequence_parallel(local, qkva, state0, segment_ids, axis_name, normalize, eps):
    """Causal linear attention with time split over `axis_name`, on float32 arrays.

    `local(q, k, v, log_decay=, return_state=True)` is the unsplit kernel, unnormalised, from a
    zero state. `qkva = (q_BTHM, k_BTHM, v_BTHD, a_BTH)` with the log decay `[B,T,H]`,
    `[B,T,H,M]` or None and the shard's own resets folded in; `state0 = (kv0_BHMD, z0_BHM)`,
    `z0_BHM` None when the normaliser state is not tracked. Returns `(o_BTHD, kv_BHMD, z_BHM)`
    with the global final state.
    """
    q_BTHM, k_BTHM, v_BTHD, a_BTH = qkva
    kv0_BHMD, z0_BHM = state0
    B, T, H, M = q_BTHM.shape
    Dv = v_BTHD.shape[-1]
    a_BTH = _like(span_resets(a_BTH, segment_ids, H, axis_name), q_BTHM)

    # ---- 1. local outputs and summary from a zero state (normaliser: a value that is 1) ----
    with_sum = normalize or z0_BHM is not None
    if normalize:
        v_BTHD = jnp.concatenate([v_BTHD, jnp.ones((B, T, H, 1), jnp.float32)], axis=-1)
    Dx = v_BTHD.shape[-1]
    zero = LinearAttentionState(
        kv=_like(jnp.zeros((B, H, M, Dx), jnp.float32), q_BTHM),
        k_sum=_like(jnp.zeros((B, H, M), jnp.float32), q_BTHM),
    )
    out_BTHD, u_state = local(
        q_BTHM, k_BTHM, v_BTHD, log_decay=a_BTH, initial_state=zero, return_state=True
    )
    u_BHMD = u_state.kv[..., :Dv]
    s0_BHMD = kv0_BHMD
    if with_sum:  # the normaliser state rides along as one more value column
        u_BHMD = jnp.concatenate([u_BHMD, u_state.k_sum[..., None]], axis=-1)
        z0 = jnp.zeros((B, H, M), jnp.float32) if z0_BHM is None else z0_BHM
        s0_BHMD = jnp.concatenate([kv0_BHMD, z0[..., None]], axis=-1)
    if a_BTH is None:
        w_BTHM = None
        A_BHM1 = jnp.ones((B, H, 1, 1), jnp.float32)
    else:
        b_BTH = jnp.cumsum(a_BTH, axis=1)  # −inf after a reset: exp gives 0, never NaN
        w_BTHM = jnp.exp(b_BTH if a_BTH.ndim == 4 else b_BTH[..., None])
        A_BHM1 = w_BTHM[:, -1, :, :, None]

    # ---- 2. gather the summaries, compose them over shards ----
    s_in_BHMD, s_out_BHMD = _prefix(A_BHM1, u_BHMD, s0_BHMD, axis_name, lambda A, S: A * S)

    # ---- 3. the entering state's contribution ----
    qw_BTHM = q_BTHM if w_BTHM is None else q_BTHM * w_BTHM
    carry_BTHD = jnp.einsum("bthm,bhmd->bthd", qw_BTHM, s_in_BHMD)
    o_BTHD = out_BTHD[..., :Dv] + carry_BTHD[..., :Dv]
    if normalize:
        den_BTH = out_BTHD[..., Dv] + carry_BTHD[..., Dv]
        o_BTHD = o_BTHD / (den_BTH[..., None] + eps)
    kv_BHMD = s_out_BHMD[..., :Dv]
    z_BHM = s_out_BHMD[..., Dv] if z0_BHM is not None else None
    return o_BTHD, kv_BHMD, z_BHM


def affine_sequence_parallel(local, v, s0_BHKD, axis_name, *, like):
    """Any recurrence whose state update is affine in the entering state, with time split over
    `axis_name`, on float32 arrays: the one combine of the delta family.

    `local(v_ext, s_init) -> (o_ext, s_final)` is the unsplit kernel on this shard's tokens: it
    must be linear in (s_init, v_ext) jointly (S_t = M_t S_{t−1} + k_t v_tᵀ-like writes, any
    transition M_t) and read its outputs as o_t = S_tᵀ q_t. `v: [..., Dv]` (e.g. `[B, T, H, Dv]`
    or `[B, T, H, n, Dv]`), `s0_BHKD` the global initial state, `like` an input that varies over
    the mesh (the zero/identity columns are typed like it). One local run on [v | 0] from
    [0 | I] gives outputs [o | A_tᵀ q_t] (o `[B, T, H, Dv + K]`) and the state [U | A]; the
    summaries (A, U) compose over shards (`_prefix`). Returns `(o_BTHD, s_BHKD)` with the global
    final state.
    """
    Kd, Dv = s0_BHKD.shape[-2:]
    v_ext = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], Kd), jnp.float32)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(Kd, dtype=jnp.float32), (*s0_BHKD.shape[:-1], Kd))
    init = jnp.concatenate([jnp.zeros_like(s0_BHKD), eye], axis=-1)
    out_BTHX, state_BHKX = local(_like(v_ext, like), _like(init, like))
    u_BHKD, A_BHKK = state_BHKX[..., :Dv], state_BHKX[..., Dv:]

    s_in_BHKD, s_out_BHKD = _prefix(A_BHKK, u_BHKD, s0_BHKD, axis_name, jnp.matmul)

    # the entering state's contribution: (A_t S_in)ᵀ q_t
    o_BTHD = out_BTHX[..., :Dv] + jnp.einsum("bthk,bhkd->bthd", out_BTHX[..., Dv:], s_in_BHKD)
    return o_BTHD, s_out_BHKD


def softmax_context_parallel(q_BTHD, k_BTHD, v_BTHD, *, axis_name, scale, segment_ids=None):
    """Causal softmax attention with time split over `axis_name`: this shard's queries attend
    to the gathered keys and values of every shard, query s·T + t seeing key j iff j ≤ s·T + t
    (and, with `segment_ids [B, T]`, the same id). Logits and softmax in float32, masked before
    `exp`; the output has dtype `result_type(q, k, v)`."""
    dtype = jnp.result_type(q_BTHD, k_BTHD, v_BTHD)
    T = q_BTHD.shape[1]
    k_BSHD = jax.lax.all_gather(k_BTHD, axis_name, axis=1, tiled=True)
    v_BSHD = jax.lax.all_gather(v_BTHD, axis_name, axis=1, tiled=True)
    q_pos_T = jax.lax.axis_index(axis_name) * T + jnp.arange(T)
    visible_BTS = (jnp.arange(k_BSHD.shape[1])[None, :] <= q_pos_T[:, None])[None]
    if segment_ids is not None:
        ids_BS = jax.lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
        visible_BTS = visible_BTS & (segment_ids[:, :, None] == ids_BS[:, None, :])
    logits_BHTS = jnp.einsum(
        "bthd,bshd->bhts", q_BTHD, k_BSHD, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    logits_BHTS = jnp.where(visible_BTS[:, None], logits_BHTS, -jnp.inf)
    probs_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)  # every query sees itself: no empty row
    o_BTHD = jnp.einsum("bhts,bshd->bthd", probs_BHTS, v_BSHD.astype(jnp.float32))
    return o_BTHD.astype(dtype)


def _vma(x):
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)  # the set of varying mesh axes (renamed across versions)
    return aval.manual_axis_type.varying if varying is None else varying


def _like(x, ref):
    """`x` typed as varying over every mesh axis `ref` varies over. The local kernels' scans
    carry per-shard states, so their zero states and inputs (e.g. a fixed `[H]` decay, typed as
    replicated) must vary like the queries."""
    if x is None:
        return x
    missing = tuple(sorted(_vma(ref) - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def span_start_reset(segment_ids, axis_name):
    """`[B]` bool: this span's first token starts a new document (its id differs from the
    previous span's last id, which arrives by `ppermute`); False on the first shard."""
    n = jax.lax.axis_size(axis_name)
    idx = jax.lax.axis_index(axis_name)
    prev_last_B = jax.lax.ppermute(
        segment_ids[:, -1], axis_name, perm=[(i, i + 1) for i in range(n - 1)]
    )
    return (idx > 0) & (segment_ids[:, 0] != prev_last_B)


def span_resets(a_BTH, segment_ids, num_heads, axis_name):
    """Fold the reset at this span's first token (`span_start_reset`) into the log decay
    `[B, T, H]` or `[B, T, H, K]` (None: zeros `[B, T, H]` are made); the kernels reset only
    inside a row, never at its first token. Without `segment_ids`, `a_BTH` is returned."""
    if segment_ids is None:
        return a_BTH
    reset_B = span_start_reset(segment_ids, axis_name)
    if a_BTH is None:
        a_BTH = jnp.zeros((*segment_ids.shape, num_heads), jnp.float32)
    first = a_BTH[:, 0]
    reset = reset_B.reshape(reset_B.shape + (1,) * (first.ndim - 1))
    return a_BTH.at[:, 0].set(jnp.where(reset, -jnp.inf, first))


def _prefix(A, U, s0, axis_name, apply):
    """The state entering this shard and the global final state, from the shards' (A, U).

    `apply(A, S)` is A acting on a state (a broadcast product, or a matrix product).
    """
    idx = jax.lax.axis_index(axis_name)
    A_n = jax.lax.all_gather(A, axis_name)
    U_n = jax.lax.all_gather(U, axis_name)

    def compose(earlier, later):  # later ∘ earlier
        (A1, U1), (A2, U2) = earlier, later
        return apply(A2, A1), apply(A2, U1) + U2

    A_cum, U_cum = jax.lax.associative_scan(compose, (A_n, U_n))
    through_n = apply(A_cum, s0[None]) + U_cum  # the state leaving shard i
    prev = jax.lax.dynamic_index_in_dim(through_n, jnp.maximum(idx - 1, 0), 0, keepdims=False)
    s_in = jnp.where(idx == 0, s0, prev)
    # Every shard holds the final state, but `all_gather` output is typed as varying over the
    # axis: a `psum` of the last shard's copy makes it replicated for `out_specs=P()`.
    last = jax.lax.axis_size(axis_name) - 1
    s_out = jax.lax.psum(jnp.where(idx == last, through_n[-1], 0.0), axis_name)
    return s_in, s_out

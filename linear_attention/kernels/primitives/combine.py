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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def affine_sequence_parallel(local, v, s0_BHKD, axis_name, *, like):
    """Any recurrence whose state update is affine in the entering state, with time split over
    `axis_name`, on float32 arrays: the one combine of the delta family.

    `local(v_ext, s_init) -> (o_ext, s_final)` is the unsplit kernel on this shard's tokens: it
    must be linear in (s_init, v_ext) jointly (S_t = M_t S_{t−1} + k_t v_tᵀ-like writes, any
    transition M_t) and read its outputs as o_t = S_tᵀ q_t. `v: [..., Dv]` (e.g. `[B, T, H, Dv]`
    or `[B, T, H, n, Dv]`), `s0_BHKD` the global initial state, `like` an input that varies over
    the mesh (the zero/identity columns are typed like it). One local run on [v | 0] from
    [0 | I] gives outputs [o | A_tᵀ q_t] (o `[B, T, H, Dv + K]`) and the state [U | A]; the
    summaries (A, U) compose over shards (`prefix`). Returns `(o_BTHD, s_BHKD)` with the global
    final state.
    """
    Kd, Dv = s0_BHKD.shape[-2:]
    v_ext = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], Kd), jnp.float32)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(Kd, dtype=jnp.float32), (*s0_BHKD.shape[:-1], Kd))
    init = jnp.concatenate([jnp.zeros_like(s0_BHKD), eye], axis=-1)
    out_BTHX, state_BHKX = local(vary_like(v_ext, like), vary_like(init, like))
    u_BHKD, A_BHKK = state_BHKX[..., :Dv], state_BHKX[..., Dv:]

    s_in_BHKD, s_out_BHKD = prefix(A_BHKK, u_BHKD, s0_BHKD, axis_name, jnp.matmul)

    # the entering state's contribution: (A_t S_in)ᵀ q_t
    o_BTHD = out_BTHX[..., :Dv] + jnp.einsum("bthk,bhkd->bthd", out_BTHX[..., Dv:], s_in_BHKD)
    return o_BTHD, s_out_BHKD


def _vma(x):
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)  # the set of varying mesh axes (renamed across versions)
    return aval.manual_axis_type.varying if varying is None else varying


def vary_like(x, ref):
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


def prefix(A, U, s0, axis_name, apply):
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

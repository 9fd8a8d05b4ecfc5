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

A non-finite key or value (NaN outputs of the local kernel, a NaN summary) is carried as a flag
beside clean numbers (`prefix`), so that it reaches later shards only up to a reset, as in the
unsplit call, and no 0·NaN enters the outputs or the gradient. Work per device is O(T/n) plus
O(n) state-sized combines. Packed rows (`segment_ids`) reset at
span starts too (`segments.segment_resets`, before the local kernel runs). Gradients are JAX's own
through the collectives (the transpose of `all_gather` is a reduce-scatter), so they equal the
unsplit call's, including those of an initial state replicated over the axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def affine_sequence_parallel(local, v, s0_BHKD, axis_name, *, like, resets_BTH=None):
    """Any recurrence whose state update is affine in the entering state, with time split over
    `axis_name`, on float32 arrays: the one combine of the delta family.

    `local(v_ext, s_init) -> (o_ext, s_final)` is the unsplit kernel on this shard's tokens: it
    must be linear in (s_init, v_ext) jointly (S_t = M_t S_{t−1} + k_t v_tᵀ-like writes, any
    transition M_t) and read its outputs as o_t = S_tᵀ q_t. `v: [..., Dv]` (e.g. `[B, T, H, Dv]`
    or `[B, T, H, n, Dv]`), `s0_BHKD` the global initial state, `like` an input that varies over
    the mesh (the zero/identity columns are typed like it). One local run on [v | 0] from
    [0 | I] gives outputs [o | A_tᵀ q_t] (o `[B, T, H, Dv + K]`) and the state [U | A]; the
    summaries (A, U) compose over shards (`prefix`). `resets_BTH`: whether a reset (a
    transition that zeroes every state) lies in this span at or before each token, so that a
    NaN carried in from an earlier shard stops there; None: no resets known. Returns
    `(o_BTHD, s_BHKD)` with the global final state.
    """
    Kd, Dv = s0_BHKD.shape[-2:]
    v_ext = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], Kd), jnp.float32)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(Kd, dtype=jnp.float32), (*s0_BHKD.shape[:-1], Kd))
    init = jnp.concatenate([jnp.zeros_like(s0_BHKD), eye], axis=-1)
    out_BTHX, state_BHKX = local(vary_like(v_ext, like), vary_like(init, like))
    u_BHKD, A_BHKK = state_BHKX[..., :Dv], state_BHKX[..., Dv:]
    # NaN local outputs (tokens a bad input of this span reaches) are set aside and marked again
    # at the end: kept in the sums below, a NaN cotangent there (a loss's own NaN terms, zeroed
    # by a select) would meet their zero reads (0·NaN) in the entering state's gradient
    poisoned_BTH = ~jnp.all(jnp.isfinite(out_BTHX), axis=-1)
    out_BTHX = jnp.where(poisoned_BTH[..., None], 0.0, out_BTHX)

    # ---- gather the summaries, compose them over shards ----
    resets_BTH = jnp.zeros(out_BTHX.shape[:3], bool) if resets_BTH is None else resets_BTH
    s_in_BHKD, bad_in_BH, s_out_BHKD = prefix(
        A_BHKK, u_BHKD, s0_BHKD, resets_BTH[:, -1], axis_name, jnp.matmul
    )

    # the entering state's contribution: (A_t S_in)ᵀ q_t; a bad one reaches tokens up to a reset
    read_BTHK = out_BTHX[..., Dv:]
    o_BTHD = out_BTHX[..., :Dv] + jnp.einsum("bthk,bhkd->bthd", read_BTHK, s_in_BHKD)
    reached_BTH = poisoned_BTH | (bad_in_BH[:, None] & ~resets_BTH)
    o_BTHD = jnp.where(reached_BTH[..., None], jnp.nan, o_BTHD)
    return o_BTHD, s_out_BHKD


def varying_axes(x):
    """The mesh axes `x` is typed as varying over (inside `jax.shard_map`; empty outside)."""
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)  # the set of varying mesh axes (renamed across versions)
    return aval.manual_axis_type.varying if varying is None else varying


def vary_like(x, ref):
    """`x` typed as varying over every mesh axis `ref` varies over. The local kernels' scans
    carry per-shard states, so their zero states and inputs (e.g. a fixed `[H]` decay, typed as
    replicated) must vary like the queries."""
    if x is None:
        return x
    missing = tuple(sorted(varying_axes(ref) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def prefix(A, U, s0, reset_BH, axis_name, apply):
    """The state entering this shard and the global final state, from the shards' (A, U).

    `apply(A, S)` is A acting on a state (a broadcast product, or a matrix product);
    `reset_BH` whether this shard's span holds a reset (its A zeroes every state).

    Non-finite values (a NaN key or value, as the local kernels mark them) travel beside the
    numbers, never inside them: a state is (clean values, bad flag per [B, H]), composed as
    bad = bad₂ | (bad₁ & ¬reset₂), the recurrence's own rule (a reset forgets a NaN). Products
    then only ever meet finite values, so a NaN cannot leak through 0·NaN into a shard past a
    reset, in the forward pass or in the gradient (whose cotangents of a masked product are 0).
    Returns `(s_in, bad_in_BH, s_out)`: the entering state's clean values and bad flag (the
    caller marks the outputs it reaches), and the final state with NaN where it is bad.
    """
    idx = jax.lax.axis_index(axis_name)
    lead = U.shape[:2]
    bad_BH = ~jnp.all(jnp.isfinite(U), axis=(2, 3)) | ~jnp.all(
        jnp.isfinite(A).reshape(*jnp.shape(A)[:2], -1), axis=-1
    )
    bad0_BH = ~jnp.all(jnp.isfinite(s0), axis=(2, 3))
    A = jnp.where(bad_BH[..., None, None], 0.0, A)
    U = jnp.where(bad_BH[..., None, None], 0.0, U)
    s0 = jnp.where(bad0_BH[..., None, None], 0.0, s0)
    reset_BH = jnp.broadcast_to(reset_BH, lead)
    A_n, U_n, r_n, b_n = (jax.lax.all_gather(x, axis_name) for x in (A, U, reset_BH, bad_BH))

    def compose(earlier, later):  # later ∘ earlier
        (A1, U1, r1, b1), (A2, U2, r2, b2) = earlier, later
        return apply(A2, A1), apply(A2, U1) + U2, r1 | r2, b2 | (b1 & ~r2)

    A_cum, U_cum, r_cum, b_cum = jax.lax.associative_scan(compose, (A_n, U_n, r_n, b_n))
    through_n = apply(A_cum, s0[None]) + U_cum  # the state leaving shard i
    bad_through_n = b_cum | (bad0_BH[None] & ~r_cum)
    prev = jnp.maximum(idx - 1, 0)
    s_in = jnp.where(idx == 0, s0, jax.lax.dynamic_index_in_dim(through_n, prev, 0, False))
    bad_in = jnp.where(
        idx == 0, bad0_BH, jax.lax.dynamic_index_in_dim(bad_through_n, prev, 0, False)
    )
    # Every shard holds the final state, but `all_gather` output is typed as varying over the
    # axis: a `psum` of the last shard's copy makes it replicated for `out_specs=P()`.
    is_last = idx == jax.lax.axis_size(axis_name) - 1
    s_out = jax.lax.psum(jnp.where(is_last, through_n[-1], 0.0), axis_name)
    bad_out = jax.lax.psum(
        jnp.where(is_last, bad_through_n[-1], False).astype(jnp.int32), axis_name
    )
    s_out = jnp.where(bad_out[..., None, None] > 0, jnp.nan, s_out)
    return s_in, bad_in, s_out

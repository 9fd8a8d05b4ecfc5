"""Log-linear attention with time split over a mesh axis.

A span's computation depends on the state entering it in two ways: its Fenwick positions
continue from the entering position P (until its first reset), and its outputs read the
entering level states. The first is an integer prefix, the second is affine once P is known:

  1. positions: each span reports (a reset seen, the tokens after its last reset or all of
     them); gathered over the axis, a prefix gives every span its entering position P_i
     (the global initial state's position flows into the first span);
  2. every span runs the local kernel from empty levels at P_i: its outputs, and the level
     states U_i it leaves at E_i = its end position; the entering levels cross the span by
     the [L, L] map M_i = exp(Σ a) · move(P_i → E_i) (`fenwick.move`; 0 past a reset), so
     S_out = M_i S_in + U_i, composed over spans by an associative scan of the gathered
     (M, U) (O(n·L·K·V) per device);
  3. each span adds the entering levels' reads, λ at level max(s + 1, |p_t ⊕ P_i|) times the
     decay from the span's start (`fenwick.read_weights`).

Every shard gets the global final state (a `psum` of the last shard's copy, typed replicated).
Gradients are JAX's through the collectives. A non-finite state (a NaN input of a span, which
the guard marks in its outputs and levels) travels as a flag beside clean numbers, as in
`combine.prefix`: it reaches later spans up to their first reset, as in the unsplit call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention.kernels.log_linear.fenwick import LogLinearState, move, read_weights
from linear_attention.kernels.primitives.combine import vary_like
from linear_attention.kernels.segments import cumulative_log_decay, masked_exp


def split_over(core, q_BTHK, lam_BTHL, a_BTH, state: LogLinearState, axis_name: str):
    """`core(state) -> (o, state, p)`, the local kernel from a state, run on this shard's span
    with time split over `axis_name` (see the module docstring). Returns `(o, global final
    state, p)`."""
    n = jax.lax.axis_size(axis_name)
    idx = jax.lax.axis_index(axis_name)
    T, L = a_BTH.shape[1], lam_BTHL.shape[-1]

    # ---- 1. the position entering every span ----
    reset = jnp.isneginf(a_BTH)
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    last_BH = jnp.max(jnp.where(reset, t, -1), axis=1)
    seen_BH = last_BH >= 0
    count_BH = jnp.where(seen_BH, T - last_BH, T)
    seen_n, count_n = (
        jax.lax.all_gather(seen_BH, axis_name),
        jax.lax.all_gather(count_BH, axis_name),
    )
    entering = [state.position]
    for j in range(n):  # over shards (static), not time
        entering.append(jnp.where(seen_n[j], count_n[j], entering[-1] + count_n[j]))
    P_in = jax.lax.dynamic_index_in_dim(jnp.stack(entering), idx, 0, False)

    # ---- 2. the local kernel from empty levels; the span's map of the entering levels ----
    empty = LogLinearState(vary_like(jnp.zeros_like(state.levels), q_BTHK), vary_like(P_in, q_BTHK))
    o, local, p = core(empty)
    o, poisoned_BTH, U, bad_in_BH, bad_out_BH, levels0 = _set_aside(
        o, local.levels, state.levels, seen_n, axis_name
    )
    state = state._replace(levels=levels0)
    b, nres = cumulative_log_decay(a_BTH, axis=1, restart=True)
    total_BH = masked_exp(nres[:, -1] == 0, b[:, -1])
    M = move(P_in, local.position, L) * total_BH[..., None, None]  # [B, H, L, L]
    M_n, U_n = jax.lax.all_gather(M, axis_name), jax.lax.all_gather(U, axis_name)

    def compose(earlier, later):  # later ∘ earlier, maps as [from, to]
        (M1, U1), (M2, U2) = earlier, later
        return M1 @ M2, jnp.einsum("...sl,...skv->...lkv", M2, U1) + U2

    M_cum, U_cum = jax.lax.associative_scan(compose, (M_n, U_n))
    through = jnp.einsum("nbhsl,bhskv->nbhlkv", M_cum, state.levels) + U_cum
    prev = jnp.maximum(idx - 1, 0)
    s_in = jnp.where(idx == 0, state.levels, jax.lax.dynamic_index_in_dim(through, prev, 0, False))
    is_last = idx == n - 1
    s_out = jax.lax.psum(jnp.where(is_last, through[-1], 0.0), axis_name)
    s_out = jnp.where(bad_out_BH[..., None, None, None], jnp.nan, s_out)
    P_out = jax.lax.psum(jnp.where(is_last, entering[-1], 0), axis_name)

    # ---- 3. the entering levels' reads ----
    start_BTH = masked_exp(nres == 0, b)
    read = read_weights(jnp.moveaxis(lam_BTHL, 1, 2), jnp.moveaxis(p, 1, 2), P_in, L)
    o = o + jnp.einsum("bhtl,bthk,bhlkv->bthv", read, q_BTHK * start_BTH[..., None], s_in)
    reached_BTH = poisoned_BTH | (bad_in_BH[:, None] & (nres == 0))
    return jnp.where(reached_BTH[..., None], jnp.nan, o), LogLinearState(s_out, P_out), p


def _set_aside(o, levels, levels0, seen_n, axis_name):
    """NaN set aside as flags (`combine.prefix`'s rule, bad = bad₂ | (bad₁ & ¬reset₂)): the
    span's outputs and levels with their NaN zeroed, the tokens that were NaN, and whether the
    levels entering and leaving (globally, replicated) this span are bad; the initial levels
    zeroed where bad. `seen_n` [n, B, H]: whether each span holds a reset. Kept in the sums, a
    NaN would meet zero weights (0·NaN) in the outputs and the gradient."""
    idx, n = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
    poisoned_BTH = ~jnp.all(jnp.isfinite(o), -1)
    bad_BH = ~jnp.all(jnp.isfinite(levels), axis=(2, 3, 4))
    bad0_BH = ~jnp.all(jnp.isfinite(levels0), axis=(2, 3, 4))

    def compose(earlier, later):
        (r1, b1), (r2, b2) = earlier, later
        return r1 | r2, b2 | (b1 & ~r2)

    r_cum, b_cum = jax.lax.associative_scan(
        compose, (seen_n, jax.lax.all_gather(bad_BH, axis_name))
    )
    bad_through = b_cum | (bad0_BH[None] & ~r_cum)
    prev = jax.lax.dynamic_index_in_dim(bad_through, jnp.maximum(idx - 1, 0), 0, False)
    bad_in = jnp.where(idx == 0, bad0_BH, prev)
    bad_out = jax.lax.psum(
        jnp.where(idx == n - 1, bad_through[-1], False).astype(jnp.int32), axis_name
    )
    zero = lambda x, bad: jnp.where(bad.reshape(bad.shape + (1,) * (x.ndim - bad.ndim)), 0.0, x)  # noqa: E731
    return (
        zero(o, poisoned_BTH), poisoned_BTH, zero(levels, bad_BH), bad_in, bad_out > 0,
        zero(levels0, bad0_BH),
    )  # fmt: skip

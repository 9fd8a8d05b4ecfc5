"""The delta rule's chunk forward pass as one Pallas TPU kernel, the UT transform inside it:
`delta_rule(method="pallas")` (DeltaNet, Gated DeltaNet and KDA, every decay read per key
channel) and `delta_product(method="pallas")` through it.

One grid step per (batch·head row, chunk), chunks in order, the state S [K, Dv] carried in
VMEM. A step reads its chunk's raw q, k, v [C, ·], β [1, C] and the cumulative log decay b and
reset count n [C, K] (`segments.cumulative_log_decay`, restarting at resets) and makes, in
VMEM, what `delta._per_key_forward` makes in XLA, then the walk step:

    L_ts = Σ_m k_tm k_sm e^{b_tm − b_sm} (s < t),   P_ts = Σ_m q_tm k_sm e^{b_tm − b_sm} (s ≤ t)
    U = (I + diag(β) L)⁻¹ diag(β) V,   W = (I + diag(β) L)⁻¹ diag(β) (K ⊙ e^b)
    U' = U − W S,   O = (Q ⊙ e^b) S + P U',   S' = e^{b_C} ⊙ S + (K ⊙ e^{b_C − b})ᵀ U'

The scores are taken in sub-blocks of 16 queries (`primitives.pallas_decays.key_sub_blocks`,
every exponent ≤ 0: −30 per token is exact; a factor across a reset is masked to 0 before
`exp`). The unit-lower-triangular system is solved by block forward substitution over the
sub-blocks: for sub-block i, Yᵢ = Rᵢ − diag(βᵢ) L_{i,<i} X_{<i} (one [16, C] matmul with the
rows already solved, the rest zero), then Xᵢ = (I + Aᵢᵢ)⁻¹ Yᵢ with the 16 × 16 inverse by the
iteration Z ← I − Aᵢᵢ Z from Z = I: Aᵢᵢ is strictly lower-triangular, so after m rounds rows
0..m of Z are final, each the same arithmetic as forward substitution on it (15 rounds). Only
matmuls, elementwise work, row slices at multiples of 16 and row concatenations: what Mosaic
lowers.

The backward pass is not in this kernel: `primitives.pallas_chunk_scan` walks the chunks last
to first with its Pallas walk kernel, remaking each chunk's terms and residuals by the family's
XLA `forward` and mapping the terms' cotangents to the inputs by its hand-written XLA pullback
(`delta._per_key_backward`), from the state entering each chunk this kernel keeps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from linear_attention.kernels.primitives.pallas import (
    compiler_params,
    cost_estimate,
    mxu_dot,
    result_struct,
    vary_together,
    vmem_f32,
)
from linear_attention.kernels.primitives.pallas_chunk_scan import (
    chunk_spec,
    rows_major,
    state_spec,
)
from linear_attention.kernels.primitives.pallas_decays import SUB_BLOCK, as_column, key_sub_blocks
from linear_attention.kernels.segments import masked_exp


def ut_walk(s0_BHKD, xs, interpret: bool, keep: bool):
    """The forward pass over every chunk: `xs = (q, k, v, β, b, n)` chunk-major float32
    `[N, B, H, C, ...]` (β `[N, B, H, C]`; b and n `[N, B, H, C, K]`, n integer), the state
    entering the first chunk `s0_BHKD`. Returns `(O [N, B, H, C, Dv], S_final [B, H, K, Dv],
    the state entering each chunk [N, B·H, K, Dv] with `keep`, else None)`."""
    q, k, v, beta, b, n = xs
    N, B, H, C, Kd = q.shape
    Dv = v.shape[-1]
    R = B * H
    beta_rows = beta.reshape(N, R, 1, C)  # a lane-dense row per chunk (a [C, 1] column pads)
    arrays = [rows_major(x) for x in (q, k, v)] + [beta_rows] + [rows_major(x) for x in (b, n)]
    inputs = vary_together([*arrays, s0_BHKD.reshape(R, Kd, Dv)])
    struct = functools.partial(result_struct, like=inputs[0])
    widths = (Kd, Kd, Dv)
    in_specs = [chunk_spec((None, None, C, X), False, N) for X in widths]
    in_specs.append(chunk_spec((None, None, 1, C), False, N))
    in_specs += [chunk_spec((None, None, C, Kd), False, N)] * 2
    in_specs.append(state_spec(Kd, Dv))
    out_shape = [struct((N, R, C, Dv), jnp.float32), struct((R, Kd, Dv), jnp.float32)]
    out_specs = [chunk_spec((None, None, C, Dv), False, N), state_spec(Kd, Dv)]
    if keep:
        out_shape.append(struct((N, R, Kd, Dv), jnp.float32))
        out_specs.append(chunk_spec((None, None, Kd, Dv), False, N))
    outs = pl.pallas_call(
        functools.partial(_kernel, keep=keep),
        out_shape=out_shape,
        grid=(R, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[vmem_f32((Kd, Dv))],
        compiler_params=compiler_params(),
        cost_estimate=cost_estimate(
            flops=R * N * _flops(C, Kd, Dv),
            transcendentals=R * N * (2 * C * SUB_BLOCK * Kd + 4 * C * Kd),
            arrays=inputs + out_shape,
        ),
        interpret=interpret,
        name="delta_ut_walk_fwd",
    )(*inputs)
    entering = outs[2] if keep else None
    return outs[0].reshape(N, B, H, C, Dv), outs[1].reshape(B, H, Kd, Dv), entering


def _flops(C, Kd, Dv):
    """A chunk's matmul and elementwise FLOPs (the scores' diagonal blocks elementwise, the
    15 rounds of each 16 × 16 inverse, the solve, the walk)."""
    c = SUB_BLOCK
    scores = 2 * 2 * C * C * Kd + 2 * 3 * C * c * Kd
    inverse = (C // c) * 15 * 2 * c * c * c
    solve = 2 * C * C * (Kd + Dv)
    walk = 2 * (3 * C * Kd * Dv + C * C * Dv)
    return scores + inverse + solve + walk


def _kernel(q_ref, k_ref, v_ref, beta_ref, b_ref, n_ref, s0_ref, o_ref, s_ref, *rest, keep):
    s_acc = rest[-1]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        s_acc[...] = s0_ref[...]

    S = s_acc[...]
    if keep:  # the state entering this chunk, for the backward pass
        rest[0][...] = S
    q, k, v = (r[...].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))
    beta = as_column(beta_ref[...])  # [C, 1]
    b, n = b_ref[...], n_ref[...]
    C = q.shape[0]
    b_end, n_end = b[C - 1 :], n[C - 1 :]  # [1, K]
    start = masked_exp(n == 0, b)
    end = masked_exp(n == n_end, b_end - b)
    total = as_column(masked_exp(n_end == 0, b_end))  # [K, 1]: scales the state's rows
    blocks = list(key_sub_blocks(b, n))
    u, w = _ut_transform(k, v * beta, k * start * beta, beta, blocks)
    x = u - mxu_dot(w, S)  # U' = U − W S: the state-corrected, β-scaled values
    o = mxu_dot(q * start, S) + _scores_times(q, k, x, blocks)
    o_ref[...] = o
    S = total * S + mxu_dot(k * end, x, trans_a=True)
    s_acc[...] = S

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        s_ref[...] = S


def _scores_times(q, k, x, blocks):
    """P X: the decayed scores Σ_m q_tm k_sm e^{b_tm − b_sm} (s ≤ t) times x [C, X], by
    sub-blocks of queries."""
    out = []
    for rows, q_scale, k_scale, diag in blocks:
        q_i, k_i = q[rows], k[rows]
        p_ii = jnp.sum(q_i[:, None, :] * k_i[None, :, :] * diag, axis=-1)  # [c, c]
        y = mxu_dot(p_ii, x[rows])
        if q_scale is not None:
            y = y + mxu_dot(mxu_dot(q_i * q_scale, k * k_scale, trans_b=True), x)
        out.append(y)
    return jnp.concatenate(out, 0)


def _ut_transform(k, r_u, r_w, beta, blocks):
    """(U, W) = (I + A)⁻¹ (R_u, R_w) with A = diag(β) L, L the strict decayed scores of k with
    itself, by block forward substitution over the query sub-blocks (module docstring)."""
    C = k.shape[0]
    us, ws = [], []
    for rows, q_scale, k_scale, diag in blocks:
        k_i = k[rows]
        c = k_i.shape[0]
        strict = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0) > jax.lax.broadcasted_iota(
            jnp.int32, (c, c), 1
        )
        l_ii = jnp.sum(k_i[:, None, :] * k_i[None, :, :] * diag, axis=-1)
        a_ii = beta[rows] * jnp.where(strict, l_ii, 0.0)
        y_u, y_w = r_u[rows], r_w[rows]
        if q_scale is not None:  # the rows solved so far, zeros below them
            a_off = beta[rows] * mxu_dot(k_i * q_scale, k * k_scale, trans_b=True)  # [c, C]
            pad = C - len(us) * c
            u_done = jnp.concatenate([*us, jnp.zeros((pad, r_u.shape[1]), jnp.float32)], 0)
            w_done = jnp.concatenate([*ws, jnp.zeros((pad, r_w.shape[1]), jnp.float32)], 0)
            y_u = y_u - mxu_dot(a_off, u_done)
            y_w = y_w - mxu_dot(a_off, w_done)
        inv = _invert_unit_lower(a_ii)
        us.append(mxu_dot(inv, y_u))
        ws.append(mxu_dot(inv, y_w))
    return jnp.concatenate(us, 0), jnp.concatenate(ws, 0)


def _invert_unit_lower(a_cc):
    """(I + A)⁻¹ for a strictly lower-triangular [c, c] A by Z ← I − A Z from Z = I: row r of
    Z is final after r rounds (it reads rows < r only), so c − 1 rounds are exact, each row the
    arithmetic of forward substitution (no powers of A are formed, unlike (I − N)⁻¹ =
    Π (I + N^(2^j)), which is unstable for β near 2)."""
    c = a_cc.shape[0]
    eye = (
        jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        == jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    ).astype(jnp.float32)
    z = eye - a_cc
    for _ in range(c - 2):
        z = eye - mxu_dot(a_cc, z)
    return z

"""The delta family's chunk forward pass as one Pallas TPU kernel, the UT transform inside it:
`delta_rule(method="pallas")` (DeltaNet, Gated DeltaNet and KDA, every decay read per key
channel), `delta_product(method="pallas")` through it (`ut_walk`), and
`dplr_delta_rule(method="pallas")` with its generalised transform (`dplr_walk`).

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

DPLR (`dplr_walk`, `dplr` module docstring) is the same kernel with (I − L_ab)⁻¹ for the
system, its right-hand sides [L_ak V, A ⊙ e^{g⁻}], four decayed score matrices, and the
exclusive decays g⁻, n⁻ (the decay before each token's own, which L_ab and L_ak read on the
query side) taken in the kernel by a matmul with the [C, C] shift.

The backward pass is not in this kernel: `primitives.pallas_chunk_scan` walks the chunks last
to first with its Pallas walk kernel, remaking each chunk's terms and residuals by the family's
XLA `forward` and mapping the terms' cotangents to the inputs by its hand-written XLA pullback
(`delta._per_key_backward`, `dplr._backward`), from the state entering each chunk this
kernel keeps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from linear_attention.kernels.primitives.pallas import (
    carry_state,
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
    """The delta rule's forward pass over every chunk: `xs = (q, k, v, β, b, n)` chunk-major
    float32 `[N, B, H, C, ...]` (β `[N, B, H, C]`; b and n `[N, B, H, C, K]`, n integer), the
    state entering the first chunk `s0_BHKD`. Returns `(O [N, B, H, C, Dv], S_final
    [B, H, K, Dv], the state entering each chunk [N, B·H, K, Dv] with `keep`, else None)`."""
    q, k, v, beta, b, n = xs
    C, Kd, Dv = q.shape[3], q.shape[4], v.shape[-1]
    c, P = SUB_BLOCK, C // SUB_BLOCK
    flops = 2 * 2 * C * C * Kd + 2 * 3 * C * c * Kd  # two score matrices
    flops += P * 15 * 2 * c * c * c + 2 * C * C * (Kd + Dv)  # the inverses, the solve
    flops += 2 * (3 * C * Kd * Dv + C * C * Dv)  # the walk
    exps = 2 * C * c * Kd + 4 * C * Kd
    return _chunk_call(_delta_chunk, "delta_ut_walk_fwd", s0_BHKD, (q, k, v, b, n), (beta,),
                       interpret, keep, flops, exps)  # fmt: skip


def dplr_walk(s0_BHKD, xs, interpret: bool, keep: bool):
    """DPLR's forward pass over every chunk (`dplr._forward`'s terms and the walk in one
    kernel): `xs = (q, k, v, a, b, g, n)` chunk-major float32 `[N, B, H, C, ...]`, g and n the
    cumulative log decay and reset count `[N, B, H, C, K]`. Returns as `ut_walk`."""
    q, k, v, a, b, g, n = xs
    C, Kd, Dv = q.shape[3], q.shape[4], v.shape[-1]
    c, P = SUB_BLOCK, C // SUB_BLOCK
    flops = 2 * (C * C * Kd + C * c * Kd) * 4 + 2 * 2 * C * C * Kd  # four scores, two shifts
    # the solve: the 16 × 16 inverses' 14 rounds, the off-diagonal updates, the inverses' products
    X = Kd + Dv
    flops += P * 14 * 2 * c * c * c + C * C * X + 2 * C * c * X + 2 * C * C * Dv  # and L_ak V
    flops += 2 * (4 * C * Kd * Dv + 2 * C * C * Dv)  # the walk
    exps = 2 * (C * c * Kd + (P + 2) * C * Kd) + 3 * C * Kd
    return _chunk_call(_dplr_chunk, "dplr_walk_fwd", s0_BHKD, (q, k, v, a, b, g, n), (),
                       interpret, keep, flops, exps)  # fmt: skip


def _chunk_call(body, name, s0_BHKD, chunked, rows, interpret, keep, flops, transcendentals):
    """One `pallas_call` over the grid (B·H rows, N chunks), chunks in order, the state in VMEM:
    `body(S, *blocks) -> (O [C, Dv], S')` on a chunk's blocks of the `chunked` arrays
    `[N, B, H, C, X]` (`[C, X]` each) and of the `rows` arrays `[N, B, H, C]` (a lane-dense
    `[1, C]` row each: a `[C, 1]` column block would be padded to 128 lanes). `flops` and
    `transcendentals` per chunk."""
    N, B, H, C = chunked[0].shape[:4]
    Kd, Dv = s0_BHKD.shape[-2:]
    R = B * H
    arrays = [rows_major(x) for x in chunked] + [x.reshape(N, R, 1, C) for x in rows]
    inputs = vary_together([*arrays, s0_BHKD.reshape(R, Kd, Dv)])
    struct = functools.partial(result_struct, like=inputs[0])
    in_specs = [chunk_spec((None, None, *x.shape[2:]), False, N) for x in arrays]
    in_specs.append(state_spec(Kd, Dv))
    out_shape = [struct((N, R, C, Dv), jnp.float32), struct((R, Kd, Dv), jnp.float32)]
    out_specs = [chunk_spec((None, None, C, Dv), False, N), state_spec(Kd, Dv)]
    if keep:
        out_shape.append(struct((N, R, Kd, Dv), jnp.float32))
        out_specs.append(chunk_spec((None, None, Kd, Dv), False, N))
    outs = pl.pallas_call(
        functools.partial(_kernel, body=body, num_inputs=len(arrays), keep=keep),
        out_shape=out_shape,
        grid=(R, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[vmem_f32((Kd, Dv))],
        compiler_params=compiler_params(),
        cost_estimate=cost_estimate(
            flops=R * N * flops,
            transcendentals=R * N * transcendentals,
            arrays=inputs + out_shape,
        ),
        interpret=interpret,
        name=name,
    )(*inputs)
    entering = outs[2] if keep else None
    return outs[0].reshape(N, B, H, C, Dv), outs[1].reshape(B, H, Kd, Dv), entering


def _kernel(*refs, body, num_inputs, keep):
    s0_ref, o_ref, s_ref = refs[num_inputs : num_inputs + 3]
    keep_ref = refs[num_inputs + 3] if keep else None

    def step(S):
        o, S = body(S, *(r[...] for r in refs[:num_inputs]))
        o_ref[...] = o
        return S

    carry_state(s0_ref, s_ref, refs[-1], keep_ref, step)


def _delta_chunk(S, q, k, v, b, n, beta_row):
    """One chunk of the delta rule (module docstring): (O, S')."""
    beta = as_column(beta_row)  # [C, 1]
    C = q.shape[0]
    b_end, n_end = b[C - 1 :], n[C - 1 :]  # [1, K]
    start = masked_exp(n == 0, b)
    end = masked_exp(n == n_end, b_end - b)
    total = as_column(masked_exp(n_end == 0, b_end))  # [K, 1]: scales the state's rows
    blocks = list(key_sub_blocks(b, n))
    a_blocks = [
        (rows, beta[rows] * l_ii, None if l_off is None else beta[rows] * l_off)
        for rows, l_ii, l_off in _scores(k, k, blocks, strict=True)
    ]
    u, w = _solve(a_blocks, [v * beta, k * start * beta])
    x = u - mxu_dot(w, S)  # U' = U − W S: the state-corrected, β-scaled values
    o = mxu_dot(q * start, S) + _times(_scores(q, k, blocks), x)
    S = total * S + mxu_dot(k * end, x, trans_a=True)
    return o, S


def _dplr_chunk(S, q, k, v, a, b, g, n):
    """One chunk of DPLR (`dplr` module docstring): with g⁻, n⁻ the decay and count before each
    token's own (rows shifted down by one),

        (I − L_ab) W = (A ⊙ e^{g⁻}) S + L_ak V,   O = (Q ⊙ e^g) S + M_qb W + M_qk V,
        S' = e^{g_C} ⊙ S + (B ⊙ e^{g_C − g})ᵀ W + (K ⊙ e^{g_C − g})ᵀ V

    as W = X S + W₀ with [W₀ X] = (I − L_ab)⁻¹ [L_ak V, A ⊙ e^{g⁻}]."""
    C = q.shape[0]
    n = n.astype(jnp.float32)  # exact small integers: the shift below is a matmul
    g_prev, n_prev = _previous_rows(g), _previous_rows(n)
    g_end, n_end = g[C - 1 :], n[C - 1 :]
    start = masked_exp(n == 0, g)
    start_prev = masked_exp(n_prev == 0, g_prev)
    end = masked_exp(n == n_end, g_end - g)
    total = as_column(masked_exp(n_end == 0, g_end))
    inclusive = list(key_sub_blocks(g, n))
    exclusive = list(key_sub_blocks(g, n, g_query=g_prev, n_query=n_prev, strict=True))
    a_blocks = [
        (rows, -l_ii, None if l_off is None else -l_off)
        for rows, l_ii, l_off in _scores(a, b, exclusive)
    ]
    w0, x = _solve(a_blocks, [_times(_scores(a, k, exclusive), v), a * start_prev])
    w = mxu_dot(x, S) + w0
    o = mxu_dot(q * start, S) + _times(_scores(q, b, inclusive), w)
    o = o + _times(_scores(q, k, inclusive), v)
    S = total * S + mxu_dot(b * end, w, trans_a=True) + mxu_dot(k * end, v, trans_a=True)
    return o, S


def _previous_rows(x_CK):
    """Row t of the result is row t − 1 of x (row 0 is 0): a matmul with the [C, C] shift,
    exact at `Precision.HIGHEST` (one product of 1 per entry)."""
    C = x_CK.shape[0]
    shift = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0) == (
        jax.lax.broadcasted_iota(jnp.int32, (C, C), 1) + 1
    )
    return mxu_dot(shift.astype(jnp.float32), x_CK)


def _scores(x, y, blocks, strict=False):
    """The decayed scores Σ_m x_tm y_sm e^{b_tm − b_sm} of the sub-blocks' decays (`blocks`
    from `key_sub_blocks`), per query sub-block: `(rows, diagonal block [c, c], the earlier
    keys [c, C] or None)`; with `strict`, the diagonal block's diagonal is 0."""
    out = []
    for rows, q_scale, k_scale, diag in blocks:
        x_i, y_i = x[rows], y[rows]
        s_ii = jnp.sum(x_i[:, None, :] * y_i[None, :, :] * diag, axis=-1)  # [c, c]
        if strict:
            c = s_ii.shape[0]
            below = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0) > jax.lax.broadcasted_iota(
                jnp.int32, (c, c), 1
            )
            s_ii = jnp.where(below, s_ii, 0.0)
        s_off = None if q_scale is None else mxu_dot(x_i * q_scale, y * k_scale, trans_b=True)
        out.append((rows, s_ii, s_off))
    return out


def _times(score_blocks, x):
    """The scores (`_scores`) times x [C, X]."""
    out = []
    for rows, s_ii, s_off in score_blocks:
        y = mxu_dot(s_ii, x[rows])
        out.append(y if s_off is None else y + mxu_dot(s_off, x))
    return jnp.concatenate(out, 0)


def _solve(a_blocks, rhs):
    """(I + A)⁻¹ R for each R [C, X] of `rhs`, A strictly lower-triangular given by query
    sub-blocks `(rows, A_ii [c, c], A_{i,<i} [c, C] (0 from column i·c) or None)`, by block
    forward substitution (module docstring)."""
    C = rhs[0].shape[0]
    done = [[] for _ in rhs]
    for rows, a_ii, a_off in a_blocks:
        c = a_ii.shape[0]
        ys = [r[rows] for r in rhs]
        if a_off is not None:  # the rows solved so far, zeros below them
            pad = C - len(done[0]) * c
            for m, r in enumerate(rhs):
                solved = jnp.concatenate([*done[m], jnp.zeros((pad, r.shape[1]), jnp.float32)], 0)
                ys[m] = ys[m] - mxu_dot(a_off, solved)
        inv = _invert_unit_lower(a_ii)
        for m, y in enumerate(ys):
            done[m].append(mxu_dot(inv, y))
    return [jnp.concatenate(parts, 0) for parts in done]


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

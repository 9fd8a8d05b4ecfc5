"""The delta family's chunk form as Pallas TPU kernels, the forward pass one kernel and the
backward pass one kernel, the UT transform inside each: `delta_rule(method="pallas")` (DeltaNet,
Gated DeltaNet and KDA, every decay read per key channel), `delta_product(method="pallas")`
through it (`ut_walk`, `ut_walk_back`), and `dplr_delta_rule(method="pallas")` with its
generalised transform (`dplr_walk`, `dplr_walk_back`).

One grid step per (batch·head row, chunk), chunks in order, the state S [K, Dv] carried in
VMEM. A step reads its chunk's raw q, k, v [C, ·] in their input dtype (bfloat16 stays
bfloat16 in HBM; float32 in VMEM), β [1, C] and the cumulative log decay b and reset count n
(`segments.cumulative_log_decay`, restarting at resets): [C, K] for a decay per key channel,
rows [1, C] for a decay per token (Gated DeltaNet, DeltaProduct, and DeltaNet's zeros),
broadcast over the K channels in VMEM. It makes, in VMEM, what `chunk_terms.per_key_forward` makes
in XLA, then the walk step, and writes O in the inputs' dtype:

    L_ts = Σ_m k_tm k_sm e^{b_tm − b_sm} (s < t),   P_ts = Σ_m q_tm k_sm e^{b_tm − b_sm} (s ≤ t)
    U = (I + diag(β) L)⁻¹ diag(β) V,   W = (I + diag(β) L)⁻¹ diag(β) (K ⊙ e^b)
    U' = U − W S,   O = (Q ⊙ e^b) S + P U',   S' = e^{b_C} ⊙ S + (K ⊙ e^{b_C − b})ᵀ U'

The scores are taken in sub-blocks of 16 queries (`primitives.pallas_decays.key_sub_blocks`,
every exponent ≤ 0: −30 per token is exact; a factor across a reset is masked to 0 before
`exp`). The unit-lower-triangular system is solved by block forward substitution over the
sub-blocks: for sub-block i, Yᵢ = Rᵢ − diag(βᵢ) L_{i,<i} X_{<i} (one [16, C] matmul with the
rows already solved, the rest zero), then Xᵢ = (I + Aᵢᵢ)⁻¹ Yᵢ with the 16 × 16 inverse by the
iteration Z ← I − Aᵢᵢ Z from Z = I: Aᵢᵢ is strictly lower-triangular, so after m rounds rows
0..m of Z are final, each the same arithmetic as forward substitution on it (15 rounds: the
first is I − Aᵢᵢ, the other 14 a matmul each). Only matmuls, elementwise work (2-D, and 3-D on a
diagonal block's [16, 16, K] decays), row slices at multiples of 16 and row concatenations: what
Mosaic lowers.

DPLR (`dplr_walk`, `dplr` module docstring) is the same kernel with (I − L_ab)⁻¹ for the
system, its right-hand sides [L_ak V, A ⊙ e^{g⁻}], four decayed score matrices, and the
exclusive decays g⁻, n⁻ (the decay before each token's own, which L_ab and L_ak read on the
query side) taken in the kernel by a matmul with the [C, C] shift.

Backward (`ut_walk_back`, the delta rule): one grid step per (row, chunk), chunks last to
first, dS carried in VMEM. A step reads the state entering its chunk (the forward kernel keeps
one [K, Dv] state per chunk, nothing else), dO and the chunk's inputs, makes the chunk's terms
again as the forward step does (`_DeltaChunk`), and maps dO and dS' to the inputs' cotangents
and dS (`_delta_chunk_back`, the lines of `chunk_terms.per_key_backward`): the transposed system
(I + A)⁻ᵀ by block back substitution over the same sub-blocks and their 16 × 16 inverses, and
the decayed scores' pullback by the same sub-block factors (diagonal blocks from their
[16, 16, K] decays, earlier keys by matmuls), so −30 per token and resets stay exact. Its
outputs, dq, dk, dv, db [C, ·] and dβ [1, C] per chunk, are the chunk-major cotangents of
`ut_walk`'s inputs; autodiff outside carries db through the cumulative sums to the log decays.

DPLR's backward kernel (`dplr_walk_back`) is the same walk with `dplr._backward`'s lines
(`_dplr_chunk_back`): (I − L_ab)⁻ᵀ by block back substitution, the four scores' pullbacks (the
exclusive ones' query side reads g⁻), and g⁻'s cotangent moved up a row onto g's by a matmul
with the transposed shift. `primitives.pallas_chunk_scan` joins each pair of kernels in one
custom VJP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from linear_attention.kernels.primitives.pallas import (
    BACKWARD_VMEM_BYTES,
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
from linear_attention.kernels.primitives.pallas_decays import (
    SUB_BLOCK,
    as_column,
    as_row,
    key_sub_blocks,
)
from linear_attention.kernels.segments import masked_exp


def ut_walk(s0_BHKD, xs, interpret: bool, keep: bool):
    """The delta rule's forward pass over every chunk: `xs = (q, k, v, β, b, n)` chunk-major
    `[N, B, H, C, ...]` (q, k, v in any float dtype; β `[N, B, H, C]` float32; b float32 and n
    integer, `[N, B, H, C, K]` for a decay per key channel or `[N, B, H, C]` per token), the
    state entering the first chunk `s0_BHKD`. Returns `(O [N, B, H, C, Dv] in q, k, v's dtype,
    S_final [B, H, K, Dv], the state entering each chunk [N, B·H, K, Dv] with `keep`, else
    None)`."""
    q, k, v, beta, b, n = xs
    C, Kd, Dv = q.shape[3], q.shape[4], v.shape[-1]
    c, P = SUB_BLOCK, C // SUB_BLOCK
    flops = 2 * 2 * C * C * Kd + 2 * 3 * C * c * Kd  # two score matrices
    flops += P * 15 * 2 * c * c * c + 2 * C * C * (Kd + Dv)  # the inverses, the solve
    flops += 2 * (3 * C * Kd * Dv + C * C * Dv)  # the walk
    exps = 2 * C * c * Kd + 4 * C * Kd
    if b.ndim == 4:  # a decay per token: b, n as rows [1, C], read per key channel in VMEM
        body, chunked, rows = _delta_chunk_per_token, (q, k, v), (beta, b, _counts(n))
    else:
        body, chunked, rows = _delta_chunk, (q, k, v, b, n), (beta,)
    return _chunk_call(body, "delta_ut_walk_fwd", s0_BHKD, chunked, rows,
                       jnp.result_type(q, k, v), interpret, keep, flops, exps)  # fmt: skip


def dplr_walk(s0_BHKD, xs, interpret: bool, keep: bool):
    """DPLR's forward pass over every chunk (`dplr._forward`'s terms and the walk in one
    kernel): `xs = (q, k, v, a, b, g, n)` chunk-major `[N, B, H, C, ...]` (q, k, v, a, b in any
    float dtype), g and n the cumulative log decay (float32) and reset count
    `[N, B, H, C, K]`. Returns as `ut_walk`."""
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
                       jnp.result_type(q, k, v), interpret, keep, flops, exps)  # fmt: skip


def ut_walk_back(ds_BHKD, xs, entering, do_NBHCD, interpret: bool):
    """The backward pass of `ut_walk` as one Pallas kernel, chunks last to first carrying dS:
    each chunk's terms made again in VMEM from `xs` (as `ut_walk`; nothing per chunk is kept
    but the state entering it, `entering [N, B·H, K, Dv]` from `ut_walk` with `keep`), and
    their pullback to the inputs (`_delta_chunk_back`), from dO `[N, B, H, C, Dv]` and dS after
    the last chunk `ds_BHKD`. Returns `(dS₀ [B, H, K, Dv], (dq, dk, dv, dβ, db, None))` shaped
    and typed as `xs` (n, the reset counts, is an integer: no cotangent; a per-token db is the
    per-key one summed over the channels)."""
    q, k, v, beta, b, n = xs
    N, B, H, C, Kd = q.shape
    Dv = v.shape[-1]
    c, P = SUB_BLOCK, C // SUB_BLOCK
    # the terms again (scores, inverses, the solve), then the walk's lines back, the transposed
    # solve, dA, dP, and the two scores' pullbacks
    flops = 2 * 2 * C * C * Kd + 2 * 3 * C * c * Kd + P * 15 * 2 * c * c * c
    flops += 2 * C * C * (Kd + Dv) * 3 + 2 * (7 * C * Kd * Dv + 2 * C * C * Dv)
    flops += 2 * (2 * 2 * C * C * Kd + 3 * C * c * Kd)
    exps = 2 * C * c * Kd + 4 * C * Kd
    # dq, dk, dv, db, dβ [1, C], each in its input's dtype
    grads = [((C, Kd), q.dtype), ((C, Kd), k.dtype), ((C, Dv), v.dtype), ((C, Kd), b.dtype),
             ((1, C), beta.dtype)]  # fmt: skip
    if b.ndim == 4:  # a decay per token: db a row [1, C] too
        body, chunked = _delta_chunk_back_per_token, (q, k, v, do_NBHCD)
        rows = (beta, b, _counts(n))
        grads[3] = ((1, C), b.dtype)
    else:
        body, chunked, rows = _delta_chunk_back, (q, k, v, b, n, do_NBHCD), (beta,)
    ds0, (dq, dk, dv, db, dbeta) = _back_call(body, "delta_ut_walk_bwd", ds_BHKD, entering,
                                              chunked, rows, grads, interpret, flops,
                                              exps)  # fmt: skip
    return ds0, (dq, dk, dv, dbeta.reshape(N, B, H, C), db.reshape(b.shape), None)


def dplr_walk_back(ds_BHKD, xs, entering, do_NBHCD, interpret: bool):
    """The backward pass of `dplr_walk` as one Pallas kernel, as `ut_walk_back`: each chunk's
    terms again from `xs` and the state entering it, and their pullback (`_dplr_chunk_back`).
    Returns `(dS₀, (dq, dk, dv, da, db, dg, None))` shaped as `xs`."""
    q, k, v, a, b, g, n = xs
    C, Kd, Dv = q.shape[3], q.shape[4], v.shape[-1]
    c, P = SUB_BLOCK, C // SUB_BLOCK
    X = Kd + Dv
    # the terms again (as `dplr_walk`, without O), the walk's lines back, the transposed solve,
    # the four score cotangents and their pullbacks, the shift of dg⁻
    flops = 2 * (C * C * Kd + C * c * Kd) * 4 + 2 * 3 * C * C * Kd
    flops += P * 14 * 2 * c * c * c + 2 * (C * C * X + 2 * C * c * X) + 2 * C * C * Dv
    flops += 2 * (8 * C * Kd * Dv + 4 * C * C * Dv) + 2 * C * C * (Kd + 2 * Dv)
    flops += 4 * 2 * (2 * C * C * Kd + 3 * C * c * Kd)
    exps = 2 * (C * c * Kd + (P + 2) * C * Kd) + 3 * C * Kd
    # dq, dk, dv, da, db, dg, each in its input's dtype
    grads = [((C, Kd), x.dtype) for x in (q, k)] + [((C, Dv), v.dtype)]
    grads += [((C, Kd), x.dtype) for x in (a, b, g)]
    ds0, dxs = _back_call(_dplr_chunk_back, "dplr_walk_bwd", ds_BHKD, entering,
                          (q, k, v, a, b, g, n, do_NBHCD), (), grads, interpret, flops,
                          exps)  # fmt: skip
    return ds0, (*dxs, None)


def _back_call(body, name, ds_BHKD, entering, chunked, rows, grads, interpret, flops, exps):
    """One `pallas_call` over the grid (B·H rows, N chunks), chunks last to first, dS in VMEM:
    `body(dS', S, *blocks) -> (dS, cotangents)` on the state entering the chunk and the chunk's
    blocks of the `chunked` arrays `[N, B, H, C, X]` and `rows` arrays `[N, B, H, C]` (as
    `_chunk_call`, read as `_chunk_call` reads them); the cotangents have the block shapes and
    dtypes of `grads` (`(shape, dtype)` each). `flops` and `exps` per chunk. Returns
    `(dS₀ [B, H, K, Dv], the cotangents [N, B, H, *shape] of `grads`)`."""
    N, B, H, C = chunked[0].shape[:4]
    Kd, Dv = ds_BHKD.shape[-2:]
    R = B * H
    arrays = [entering, *(rows_major(x) for x in chunked)]
    arrays += [x.reshape(N, R, 1, C) for x in rows]  # lane-dense rows, as `_chunk_call`
    inputs = vary_together([*arrays, ds_BHKD.reshape(R, Kd, Dv)])
    struct = functools.partial(result_struct, like=inputs[0])
    in_specs = [chunk_spec((None, None, *x.shape[2:]), True, N) for x in arrays]
    in_specs.append(state_spec(Kd, Dv))
    out_shape = [struct((N, R, *g), dtype) for g, dtype in grads]
    out_shape.append(struct((R, Kd, Dv), jnp.float32))
    out_specs = [chunk_spec((None, None, *g), True, N) for g, _ in grads]
    out_specs.append(state_spec(Kd, Dv))
    *outs, ds0 = pl.pallas_call(
        functools.partial(_back_kernel, body=body, num_inputs=len(arrays), num_grads=len(grads)),
        out_shape=out_shape,
        grid=(R, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[vmem_f32((Kd, Dv))],
        compiler_params=compiler_params(vmem_limit_bytes=BACKWARD_VMEM_BYTES),
        cost_estimate=cost_estimate(
            flops=R * N * flops,
            transcendentals=R * N * exps,
            arrays=inputs + out_shape,
        ),
        interpret=interpret,
        name=name,
    )(*inputs)
    return ds0.reshape(B, H, Kd, Dv), [x.reshape(N, B, H, *x.shape[2:]) for x in outs]


def _back_kernel(*refs, body, num_inputs, num_grads):
    """`body` on a chunk's blocks (the entering state first), dS carried from the last chunk
    (`carry_state` over the reversed chunk axis)."""
    se_ref, *in_refs = refs[:num_inputs]
    ds_end_ref = refs[num_inputs]
    grad_refs = refs[num_inputs + 1 : num_inputs + 1 + num_grads]

    def step(dS):
        dS, grads = body(dS, se_ref[...], *(_read_f32(r) for r in in_refs))
        for ref, g in zip(grad_refs, grads, strict=True):
            ref[...] = g.astype(ref.dtype)
        return dS

    carry_state(ds_end_ref, refs[-2], refs[-1], None, step)


def _chunk_call(body, name, s0_BHKD, chunked, rows, out_dtype, interpret, keep, flops,
                transcendentals):  # fmt: skip
    """One `pallas_call` over the grid (B·H rows, N chunks), chunks in order, the state in VMEM:
    `body(S, *blocks) -> (O [C, Dv], S')` on a chunk's blocks of the `chunked` arrays
    `[N, B, H, C, X]` (`[C, X]` each) and of the `rows` arrays `[N, B, H, C]` (a lane-dense
    `[1, C]` row each: a `[C, 1]` column block would be padded to 128 lanes), O written in
    `out_dtype`. The inputs are read in their own dtype and taken to float32 in VMEM
    (`_read_f32`): a float32 chunk-major copy made by XLA before the call is a temporary twice
    a bfloat16 input's size. `flops` and `transcendentals` per chunk."""
    N, B, H, C = chunked[0].shape[:4]
    Kd, Dv = s0_BHKD.shape[-2:]
    R = B * H
    arrays = [rows_major(x) for x in chunked] + [x.reshape(N, R, 1, C) for x in rows]
    inputs = vary_together([*arrays, s0_BHKD.reshape(R, Kd, Dv)])
    struct = functools.partial(result_struct, like=inputs[0])
    in_specs = [chunk_spec((None, None, *x.shape[2:]), False, N) for x in arrays]
    in_specs.append(state_spec(Kd, Dv))
    out_shape = [struct((N, R, C, Dv), out_dtype), struct((R, Kd, Dv), jnp.float32)]
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
        o, S = body(S, *(_read_f32(r) for r in refs[:num_inputs]))
        o_ref[...] = o.astype(o_ref.dtype)
        return S

    carry_state(s0_ref, s_ref, refs[-1], keep_ref, step)


def _read_f32(ref):
    """A block in float32, the kernels' arithmetic; an integer block (reset counts) as it is."""
    x = ref[...]
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _counts(n):
    """Reset counts handed to a kernel as float32 rows (exact small integers): `as_column`
    reads a row through its diagonal in float32."""
    return n.astype(jnp.float32)


def _per_key(b_row, n_row, Kd):
    """A per-token cumulative decay and reset count, rows [1, C], as the [C, K] arrays of a
    decay per key channel (the same value on every channel), made in VMEM: XLA never holds a
    [B, T, H, K] copy of a per-token decay."""
    C = b_row.shape[-1]
    return tuple(jnp.broadcast_to(as_column(x), (C, Kd)) for x in (b_row, n_row))


def _delta_chunk_per_token(S, q, k, v, beta_row, b_row, n_row):
    """`_delta_chunk` with a decay per token (b, n rows [1, C])."""
    b, n = _per_key(b_row, n_row, q.shape[1])
    return _delta_chunk(S, q, k, v, b, n, beta_row)


def _delta_chunk_back_per_token(dS, S, q, k, v, do, beta_row, b_row, n_row):
    """`_delta_chunk_back` with a decay per token: its db [C, K] summed over the key channels
    (each reads the same b_t), as a row [1, C]."""
    b, n = _per_key(b_row, n_row, q.shape[1])
    dS, (dq, dk, dv, db, dbeta) = _delta_chunk_back(dS, S, q, k, v, b, n, do, beta_row)
    return dS, (dq, dk, dv, as_row(jnp.sum(db, axis=-1, keepdims=True)), dbeta)


class _DeltaChunk:
    """The state-independent part of one chunk of the delta rule (module docstring), made in
    VMEM: the decays (start = e^b, end = e^{b_C − b}, total = e^{b_C} as a row [1, K] and a
    column [K, 1]), the sub-blocks' factors, the strict scores L and A = diag(β) L by query
    sub-block with the inverses of A's diagonal blocks, [U, W], Qₛ = Q ⊙ e^b, Kₛ = K ⊙ e^b,
    E = K ⊙ e^{b_C − b} and the scores P."""

    def __init__(self, q, k, v, b, n, beta_row):
        self.beta = beta = as_column(beta_row)  # [C, 1]
        C = q.shape[0]
        b_end, n_end = b[C - 1 :], n[C - 1 :]  # [1, K]
        start = masked_exp(n == 0, b)
        self.total_row = masked_exp(n_end == 0, b_end)
        self.total = as_column(self.total_row)  # [K, 1]: scales the state's rows
        self.start, self.end = start, masked_exp(n == n_end, b_end - b)
        self.qs, self.ks, self.e = q * start, k * start, k * self.end
        self.blocks = list(key_sub_blocks(b, n))
        self.l_blocks = _scores(k, k, self.blocks, strict=True)
        self.a_blocks = [
            (rows, beta[rows] * l_ii, None if l_off is None else beta[rows] * l_off)
            for rows, l_ii, l_off in self.l_blocks
        ]
        self.invs = _inverses(self.a_blocks)
        self.u, self.w = _solve(self.a_blocks, self.invs, [v * beta, self.ks * beta])
        self.p_blocks = _scores(q, k, self.blocks)


def _delta_chunk(S, q, k, v, b, n, beta_row):
    """One chunk of the delta rule (module docstring): (O, S')."""
    t = _DeltaChunk(q, k, v, b, n, beta_row)
    x = t.u - mxu_dot(t.w, S)  # U' = U − W S: the state-corrected, β-scaled values
    o = mxu_dot(t.qs, S) + _times(t.p_blocks, x)
    S = t.total * S + mxu_dot(t.e, x, trans_a=True)
    return o, S


def _delta_chunk_back(dS, S, q, k, v, b, n, do, beta_row):
    """One chunk of the delta rule backwards (`ut_walk_back`): from S entering the chunk, dS'
    after it and dO, the chunk's terms again (`_DeltaChunk`), then

        dX = Pᵀ dO + E dS',   dS = Qₛᵀ dO + e^{b_C} ⊙ dS' − Wᵀ dX
        dQₛ = dO Sᵀ,   dP = dO Xᵀ,   dE = X dS'ᵀ,   d e^{b_C} = Σ_d S ⊙ dS',   dW = −dX Sᵀ
        [dR_u dR_w] = (I + A)⁻ᵀ [dX dW],   dA = −strict_lower(dR_u Uᵀ + dR_w Wᵀ)
        dV = diag(β) dR_u,   dKₛ = diag(β) dR_w,   dL = diag(β) dA
        dβ_t = Σ_s dA_ts L_ts + ⟨dR_u, V⟩_t + ⟨dR_w, Kₛ⟩_t

    (X = U − W S; `chunk_terms.per_key_backward` derives the same lines), and the scores' pullback
    (`_scores_vjp`) for P and L. Every decay factor is a masked exp, its own derivative (0
    across a reset): db = dKₛ ⊙ Kₛ + dQₛ ⊙ Qₛ − dE ⊙ E + the scores' terms, and the last row
    adds Σ_t dE ⊙ E + d e^{b_C} ⊙ e^{b_C}. Returns (dS, (dq, dk, dv, db, dβ [1, C]))."""
    t = _DeltaChunk(q, k, v, b, n, beta_row)
    C = q.shape[0]
    x = t.u - mxu_dot(t.w, S)
    dx = _times_transposed(t.p_blocks, do) + mxu_dot(t.e, dS)
    dS_prev = mxu_dot(t.qs, do, trans_a=True) + t.total * dS - mxu_dot(t.w, dx, trans_a=True)
    dqs = mxu_dot(do, S, trans_b=True)
    de = mxu_dot(x, dS, trans_b=True)
    d_total = as_row(jnp.sum(S * dS, axis=-1, keepdims=True))  # [1, K]
    dr_u, dr_w = _solve_transposed(t.a_blocks, t.invs, [dx, -mxu_dot(dx, S, trans_b=True)])
    da_blocks = _outer_blocks(t.blocks, [(-dr_u, t.u), (-dr_w, t.w)], strict=True)
    dbeta = jnp.sum(dr_u * v, axis=-1, keepdims=True) + jnp.sum(dr_w * t.ks, -1, keepdims=True)
    dbeta = dbeta + _row_sums(da_blocks, t.l_blocks)
    dl_blocks = [
        (rows, t.beta[rows] * da_ii, None if da_off is None else t.beta[rows] * da_off)
        for rows, da_ii, da_off in da_blocks
    ]
    dq_p, dk_p = _scores_vjp(q, k, t.blocks, _outer_blocks(t.blocks, [(do, x)]))
    dk_l1, dk_l2 = _scores_vjp(k, k, t.blocks, dl_blocks)
    dks = t.beta * dr_w
    dq = dqs * t.start + dq_p
    dk = dks * t.start + de * t.end + dk_p + dk_l1 + dk_l2
    db = dks * t.ks + dqs * t.qs - de * t.e + q * dq_p - k * dk_p + k * (dk_l1 - dk_l2)
    db_end = jnp.sum(de * t.e, axis=0, keepdims=True) + d_total * t.total_row  # [1, K]
    last = jax.lax.broadcasted_iota(jnp.int32, db.shape, 0) == C - 1
    db = db + jnp.where(last, db_end, 0.0)
    return dS_prev, (dq, dk, t.beta * dr_u, db, as_row(dbeta))


class _DplrChunk:
    """The state-independent part of one chunk of DPLR (`_dplr_chunk`), made in VMEM: the
    decays (with g⁻, n⁻ the decay and count before each token's own), the sub-blocks' factors
    (inclusive, and exclusive: the query side reads g⁻), the scores M_qb, M_qk, L_ak and
    −L_ab by query sub-block with the inverses of (I − L_ab)'s diagonal blocks, [W₀ X],
    Qₛ = Q ⊙ e^g, Aₛ = A ⊙ e^{g⁻}, B_e = B ⊙ e^{g_C − g} and K_e = K ⊙ e^{g_C − g}."""

    def __init__(self, q, k, v, a, b, g, n):
        C = q.shape[0]
        n = n.astype(jnp.float32)  # exact small integers: the shift below is a matmul
        g_prev, n_prev = _previous_rows(g), _previous_rows(n)
        g_end, n_end = g[C - 1 :], n[C - 1 :]
        self.start = masked_exp(n == 0, g)
        self.start_prev = masked_exp(n_prev == 0, g_prev)
        self.end = masked_exp(n == n_end, g_end - g)
        self.total_row = masked_exp(n_end == 0, g_end)
        self.total = as_column(self.total_row)
        self.qs, self.as_ = q * self.start, a * self.start_prev
        self.be, self.ke = b * self.end, k * self.end
        self.inclusive = list(key_sub_blocks(g, n))
        self.exclusive = list(key_sub_blocks(g, n, g_query=g_prev, n_query=n_prev, strict=True))
        self.a_blocks = [
            (rows, -l_ii, None if l_off is None else -l_off)
            for rows, l_ii, l_off in _scores(a, b, self.exclusive)
        ]
        self.invs = _inverses(self.a_blocks)
        self.l_ak = _scores(a, k, self.exclusive)
        self.w0, self.x = _solve(self.a_blocks, self.invs, [_times(self.l_ak, v), self.as_])
        self.m_qb = _scores(q, b, self.inclusive)
        self.m_qk = _scores(q, k, self.inclusive)


def _dplr_chunk(S, q, k, v, a, b, g, n):
    """One chunk of DPLR (`dplr` module docstring): with g⁻, n⁻ the decay and count before each
    token's own (rows shifted down by one),

        (I − L_ab) W = (A ⊙ e^{g⁻}) S + L_ak V,   O = (Q ⊙ e^g) S + M_qb W + M_qk V,
        S' = e^{g_C} ⊙ S + (B ⊙ e^{g_C − g})ᵀ W + (K ⊙ e^{g_C − g})ᵀ V

    as W = X S + W₀ with [W₀ X] = (I − L_ab)⁻¹ [L_ak V, A ⊙ e^{g⁻}]."""
    t = _DplrChunk(q, k, v, a, b, g, n)
    w = mxu_dot(t.x, S) + t.w0
    o = mxu_dot(t.qs, S) + _times(t.m_qb, w) + _times(t.m_qk, v)
    S = t.total * S + mxu_dot(t.be, w, trans_a=True) + mxu_dot(t.ke, v, trans_a=True)
    return o, S


def _dplr_chunk_back(dS, S, q, k, v, a, b, g, n, do):
    """One chunk of DPLR backwards (`dplr_walk_back`): the chunk's terms again (`_DplrChunk`),
    then, with W = X S + W₀,

        dW = M_qbᵀ dO + B_e dS',   dS = Qₛᵀ dO + e^{g_C} ⊙ dS' + Xᵀ dW,   dX = dW Sᵀ
        dQₛ = dO Sᵀ,  dM_qb = dO Wᵀ,  dM_qk = dO Vᵀ,  dB_e = W dS'ᵀ,  dK_e = V dS'ᵀ
        [dR₀ dAₛ] = (I − L_ab)⁻ᵀ [dW dX],   dL_ab = strict_lower(dR₀ W₀ᵀ + dAₛ Xᵀ),   dL_ak = dR₀ Vᵀ
        dV = M_qkᵀ dO + K_e dS' + L_akᵀ dR₀

    (`dplr._backward` derives the same lines), the four scores' pullbacks (`_scores_vjp`; L_ab
    and L_ak read g⁻ on the query side), and the decays' cotangent: dg⁻ = dAₛ ⊙ Aₛ + the
    exclusive scores' query terms, moved up a row onto dg (g⁻_t = g_{t−1}) by a matmul with the
    shift; dg = dQₛ ⊙ Qₛ − dB_e ⊙ B_e − dK_e ⊙ K_e + the other scores' terms, the last row adding
    Σ_t (dB_e ⊙ B_e + dK_e ⊙ K_e) + d e^{g_C} ⊙ e^{g_C}. Returns (dS, (dq, dk, dv, da, db, dg))."""
    t = _DplrChunk(q, k, v, a, b, g, n)
    C = q.shape[0]
    w = mxu_dot(t.x, S) + t.w0
    dw = _times_transposed(t.m_qb, do) + mxu_dot(t.be, dS)
    dS_prev = mxu_dot(t.qs, do, trans_a=True) + t.total * dS + mxu_dot(t.x, dw, trans_a=True)
    dqs = mxu_dot(do, S, trans_b=True)
    dbe = mxu_dot(w, dS, trans_b=True)
    dke = mxu_dot(v, dS, trans_b=True)
    d_total = as_row(jnp.sum(S * dS, axis=-1, keepdims=True))  # [1, K]
    dr0, das = _solve_transposed(t.a_blocks, t.invs, [dw, mxu_dot(dw, S, trans_b=True)])
    dv = _times_transposed(t.m_qk, do) + mxu_dot(t.ke, dS) + _times_transposed(t.l_ak, dr0)
    # the exclusive blocks' diagonal factors are strict: no mask on dL's diagonal blocks
    dl_ab = _outer_blocks(t.exclusive, [(dr0, t.w0), (das, t.x)])
    dl_ak = _outer_blocks(t.exclusive, [(dr0, v)])
    dm_qb = _outer_blocks(t.inclusive, [(do, w)])
    dm_qk = _outer_blocks(t.inclusive, [(do, v)])
    da_ab, db_ab = _scores_vjp(a, b, t.exclusive, dl_ab)
    da_ak, dk_ak = _scores_vjp(a, k, t.exclusive, dl_ak)
    dq_qb, db_qb = _scores_vjp(q, b, t.inclusive, dm_qb)
    dq_qk, dk_qk = _scores_vjp(q, k, t.inclusive, dm_qk)
    dq = dqs * t.start + dq_qb + dq_qk
    dk = dke * t.end + dk_ak + dk_qk
    da = das * t.start_prev + da_ab + da_ak
    db = dbe * t.end + db_ab + db_qb
    dg_prev = das * t.as_ + a * (da_ab + da_ak)
    dg = dqs * t.qs - dbe * t.be - dke * t.ke + q * (dq_qb + dq_qk)
    dg = dg - b * (db_ab + db_qb) - k * (dk_ak + dk_qk)
    dg = dg + _next_rows(dg_prev)
    dg_end = jnp.sum(dbe * t.be + dke * t.ke, axis=0, keepdims=True) + d_total * t.total_row
    last = jax.lax.broadcasted_iota(jnp.int32, dg.shape, 0) == C - 1
    dg = dg + jnp.where(last, dg_end, 0.0)
    return dS_prev, (dq, dk, dv, da, db, dg)


def _previous_rows(x_CK):
    """Row t of the result is row t − 1 of x (row 0 is 0): a matmul with the [C, C] shift,
    exact at `Precision.HIGHEST` (one product of 1 per entry)."""
    return mxu_dot(_shift(x_CK.shape[0]), x_CK)


def _next_rows(x_CK):
    """Row t of the result is row t + 1 of x (the last row is 0): the transpose of
    `_previous_rows`, its adjoint."""
    return mxu_dot(_shift(x_CK.shape[0]), x_CK, trans_a=True)


def _shift(C):
    """The [C, C] shift down by one row: 1 at (t, t − 1)."""
    shift = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0) == (
        jax.lax.broadcasted_iota(jnp.int32, (C, C), 1) + 1
    )
    return shift.astype(jnp.float32)


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


def _times_transposed(score_blocks, y):
    """The scores (`_scores`) transposed times y [C, X]: the diagonal blocks' products by
    sub-block, the earlier keys' [c, C]ᵀ products summed over the sub-blocks."""
    diagonal, total = [], None
    for rows, s_ii, s_off in score_blocks:
        diagonal.append(mxu_dot(s_ii, y[rows], trans_a=True))
        if s_off is not None:
            part = mxu_dot(s_off, y[rows], trans_a=True)
            total = part if total is None else total + part
    out = jnp.concatenate(diagonal, 0)
    return out if total is None else out + total


def _outer_blocks(blocks, pairs, strict=False):
    """Σ_(x, y) x yᵀ [C, C] of `pairs` as query sub-blocks `(rows, diagonal [c, c], [c, C] or
    None)`, the layout of `_scores` (the cotangent of scores); with `strict` the diagonal
    block is strictly lower-triangular. The [c, C] blocks are whole rows: their columns from
    the sub-block on meet the zeros of `k_scale` in `_scores_vjp`."""
    out = []
    for rows, q_scale, _, _ in blocks:
        s_ii = sum(mxu_dot(x[rows], y[rows], trans_b=True) for x, y in pairs)
        if strict:
            c = s_ii.shape[0]
            below = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0) > jax.lax.broadcasted_iota(
                jnp.int32, (c, c), 1
            )
            s_ii = jnp.where(below, s_ii, 0.0)
        s_off = None
        if q_scale is not None:
            s_off = sum(mxu_dot(x[rows], y, trans_b=True) for x, y in pairs)
        out.append((rows, s_ii, s_off))
    return out


def _row_sums(x_blocks, y_blocks):
    """Σ_s X_ts Y_ts [C, 1] of two sub-block layouts (`_scores`), sub-block by sub-block."""
    out = []
    for (_, x_ii, x_off), (_, y_ii, y_off) in zip(x_blocks, y_blocks, strict=True):
        r = jnp.sum(x_ii * y_ii, axis=-1, keepdims=True)
        out.append(r if x_off is None else r + jnp.sum(x_off * y_off, axis=-1, keepdims=True))
    return jnp.concatenate(out, 0)


def _scores_vjp(x, y, blocks, d_blocks):
    """The cotangents (dx, dy) [C, M] of the decayed scores Σ_m x_tm y_sm e^{b_tm − b_sm}
    (`_scores` on `blocks`) given theirs by sub-block (`d_blocks`): dx_t = Σ_s dS_ts y_s ⊙
    e^{b_t − b_s}, dy_s = Σ_t dS_ts x_t ⊙ e^{b_t − b_s}, by the forward pass's factors (the
    diagonal blocks from their [c, c, M] decays, the earlier keys by two matmuls each). The
    decays' cotangent follows: ∂/∂b_t of a factor is the factor, ∂/∂b_s minus it, so
    db = x ⊙ dx − y ⊙ dy."""
    dx, dy_diagonal, dy = [], [], None
    for (rows, q_scale, k_scale, diag), (_, d_ii, d_off) in zip(blocks, d_blocks, strict=True):
        x_i, y_i = x[rows], y[rows]
        weighted = d_ii[:, :, None] * diag  # [c, c, M]
        dx_i = jnp.sum(weighted * y_i[None, :, :], axis=1)
        dy_diagonal.append(jnp.sum(weighted * x_i[:, None, :], axis=0))
        if q_scale is not None:
            dx_i = dx_i + q_scale * mxu_dot(d_off, y * k_scale)
            part = k_scale * mxu_dot(d_off, x_i * q_scale, trans_a=True)
            dy = part if dy is None else dy + part
        dx.append(dx_i)
    dy_all = jnp.concatenate(dy_diagonal, 0)
    return jnp.concatenate(dx, 0), dy_all if dy is None else dy_all + dy


def _inverses(a_blocks):
    """(I + Aᵢᵢ)⁻¹ of each diagonal block of `a_blocks` (`_solve`)."""
    return [_invert_unit_lower(a_ii) for _, a_ii, _ in a_blocks]


def _solve(a_blocks, invs, rhs):
    """(I + A)⁻¹ R for each R [C, X] of `rhs`, A strictly lower-triangular given by query
    sub-blocks `(rows, A_ii [c, c], A_{i,<i} [c, C] (0 from column i·c) or None)` and `invs`
    their (I + Aᵢᵢ)⁻¹ (`_inverses`), by block forward substitution (module docstring)."""
    C = rhs[0].shape[0]
    done = [[] for _ in rhs]
    for (rows, a_ii, a_off), inv in zip(a_blocks, invs, strict=True):
        c = a_ii.shape[0]
        ys = [r[rows] for r in rhs]
        if a_off is not None:  # the rows solved so far, zeros below them
            pad = C - len(done[0]) * c
            for m, r in enumerate(rhs):
                solved = jnp.concatenate([*done[m], jnp.zeros((pad, r.shape[1]), jnp.float32)], 0)
                ys[m] = ys[m] - mxu_dot(a_off, solved)
        for m, y in enumerate(ys):
            done[m].append(mxu_dot(inv, y))
    return [jnp.concatenate(parts, 0) for parts in done]


def _solve_transposed(a_blocks, invs, rhs):
    """(I + A)⁻ᵀ R for each R [C, X] of `rhs` (A as in `_solve`), by block back substitution,
    sub-blocks last to first: Yᵢ = (I + Aᵢᵢ)⁻ᵀ (Rᵢ − Σ_{j>i} A_jiᵀ Y_j), the sum kept as
    Σ_j A_{j,<j}ᵀ Y_j [C, X] over the sub-blocks solved (its rows from j·c on are 0: A_{j,<j}'s
    columns from j·c are)."""
    done = [[] for _ in rhs]
    acc = [jnp.zeros(r.shape, jnp.float32) for r in rhs]
    for (rows, _, a_off), inv in reversed(list(zip(a_blocks, invs, strict=True))):
        for m, r in enumerate(rhs):
            y = mxu_dot(inv, r[rows] - acc[m][rows], trans_a=True)
            done[m].insert(0, y)
            if a_off is not None:
                acc[m] = acc[m] + mxu_dot(a_off, y, trans_a=True)
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

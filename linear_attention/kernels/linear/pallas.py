"""Causal linear attention as a Pallas TPU kernel: the chunk form of `chunked.py`, one grid step
per (batch row and group of heads, chunk), the heads' states carried across chunks in VMEM.

The kernels read q, k, v and a per-key decay `[B, T, H, ·]` and write the outputs and input
cotangents in that layout, as they lie in HBM (`primitives.pallas.HeadBlocks`: a step's block
holds all heads, or 8, and the kernel walks them in turn), so XLA makes no copy of them around
the `pallas_call`s.

Per chunk of C tokens, with b_t the cumulative log decay inside the chunk, n_t the resets counted
so far in it (exp(b_t − b_s) is kept only where n_t = n_s, masked before `exp`, so no exponent is
positive and −30 per token is exact), and (S, z) the state entering the chunk:

    num_t = Σ_{s ≤ t} A_ts v_s + (q_t ⊙ start_t)ᵀ S      A_ts = Σ_m q_tm k_sm exp(b_tm − b_sm)
    den_t = Σ_{s ≤ t} A_ts     + (q_t ⊙ start_t)ᵀ z      start_t = exp(b_t), 0 after a reset
    S'    = total ⊙ S + Σ_s (k_s ⊙ end_s) v_sᵀ           end_s = exp(b_C − b_s), 0 before one
    z'    = total ⊙ z + Σ_s  k_s ⊙ end_s                 total = exp(b_C), 0 with a reset
    o_t   = num_t / (den_t + eps)  (or num_t)

Decay kinds (static): "none"; "head" (one log decay per token and head: Mamba-2, simple GLA, a
fixed per-head decay, resets): A = (Q Kᵀ) ⊙ D with the C×C decay matrix D, all on the MXU;
"key" (one per key channel: GLA, KDA-style gates): the exponent depends on m, so A is built in
sub-blocks of 16 queries, as `decays.SubBlocks` does in XLA: keys in earlier sub-blocks by one
matmul of (q_t ⊙ exp(b_t − b_r)) and (k_s ⊙ exp(b_r − b_s)) around the sub-block's boundary r
(both exponents ≤ 0), the 16×16 diagonal block exactly from its [16, 16, M] decays.

The gradient is a `jax.custom_vjp`. The forward kernel keeps the state entering each chunk (one
[M, Dv] state per chunk, as the XLA chunk form does); the backward kernel walks the chunks last
to first carrying the state cotangent (dS, dz), recomputes each chunk's scores and normaliser,
and writes dq, dk, dv and dL/dB_t = q_t·dq_t − k_t·dk_t (per channel for "key"), from which the
log decays' cotangent is the suffix sum to the next reset (`decays.suffix_sum_to_reset`), as in
`chunked.py`. b and n are taken inside the kernels from the log decay itself, by matmuls with a
triangle. Inputs stay in their dtype in HBM (bfloat16 is read as bfloat16); every product is a
float32 matmul at `Precision.HIGHEST` (several bfloat16 passes on the MXU: exact to float32, not
the fastest; bfloat16 operands for the raw q·kᵀ products are not tried), states and sums are
float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from linear_attention.kernels.primitives.decays import suffix_sum_to_reset
from linear_attention.kernels.primitives.layout import pad_time
from linear_attention.kernels.primitives.pallas import (
    CHUNK_MULTIPLE,
    HeadBlocks,
    compiler_params,
    cost_estimate,
    mxu_dot,
    pallas_target,
    per_head,
    result_struct,
    round_up,
    vary_together,
    vmem_f32,
)
from linear_attention.kernels.primitives.pallas_decays import (
    SUB_BLOCK,
    as_column,
    key_sub_blocks,
)

DECAY_KINDS = ("none", "head", "key")
# Decay arrays each kind passes to the kernels (see `_decay_inputs`).
_NUM_DECAY = {"none": 0, "head": 1, "key": 1}


def causal_pallas(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, *, chunk_size, normalize, eps):
    """Causal linear attention by the Pallas kernels.

    `q, k, v` in their input dtype (read as is); `a_BTH` the float32 log decay `[B, T, H]`,
    `[B, T, H, M]` or None; `kv0_BHMD` the float32 initial state (zeros for none), `z0_BHM`
    its key sum (None: zeros, and the GPU kernel then carries no normaliser unless
    `normalize`). `chunk_size` a multiple of 16 (the chunk is cut to T rounded up to 16 for
    short inputs). On a GPU backend or under `pallas_interpret("gpu")` / `pallas_lowering("gpu")`
    the Mosaic GPU kernels run (`pallas_gpu.py`, `pallas_gpu_key.py`).
    Returns `(o_BTHD in result_type(q, k, v), kv_BHMD, z_BHM)` (z_BHM None where neither
    `z0_BHM` nor `normalize` asks for it on GPU).
    """
    backend, interpret = pallas_target('method="pallas"')
    if backend == "gpu":
        # Imported here: the Mosaic GPU modules add ~0.2 s to every `import linear_attention`.
        from linear_attention.kernels.linear.pallas_gpu import causal_pallas_gpu

        return causal_pallas_gpu(
            *(q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM),
            chunk_size=chunk_size,
            normalize=normalize,
            eps=eps,
            interpret=interpret,
        )
    if z0_BHM is None:
        z0_BHM = jnp.zeros(kv0_BHMD.shape[:-1], jnp.float32)
    T = q_BTHM.shape[1]
    C = min(chunk_size, round_up(T, CHUNK_MULTIPLE))
    if a_BTH is None:
        kind, a_BTHX = "none", None
    elif a_BTH.ndim == 4:
        kind, a_BTHX = "key", a_BTH
    else:
        kind, a_BTHX = "head", a_BTH[..., None]
    # padding: zero q, k, v and log decay, so the state passes the padded tokens unchanged
    q, k, v, a = (pad_time(x, C) for x in (q_BTHM, k_BTHM, v_BTHD, a_BTHX))
    config = (C, kind, bool(normalize), float(eps), interpret)
    o, kv, z = _linear_pallas(q, k, v, a, kv0_BHMD, z0_BHM, config)
    return o[:, :T], kv, z


# ---- layouts: [B, T, H, ...] read in place, G heads per grid step (`HeadBlocks`) ----


def _decay_inputs(a_BTHX, C):
    """The kernels' decay arrays from the padded log decay (None for "none"): the log decays
    themselves (the cumulative sums are taken inside the kernels, no [T, M] array of them is
    made). "head": one row `[1, C]` per head and chunk, `[B, N, H, C]` (a `[C, 1]` column
    block would fill a vector register's 128 lanes with one number each: 128× the array in
    HBM; the kernel takes the column from the row). "key": `[B, T, H, M]` as it is."""
    if a_BTHX is None:
        return []
    if a_BTHX.shape[-1] == 1:
        return [_head_rows(a_BTHX[..., 0], C)]
    return [a_BTHX]


def _head_rows(x_BTH, C):
    """`[B, T, H]` -> `[B, N, H, C]`: one lane-dense row per head and chunk."""
    B, T, H = x_BTH.shape
    return jnp.swapaxes(x_BTH.reshape(B, T // C, C, H), -1, -2)


def _decay_specs(kind, blocks, C, M):
    if kind == "none":
        return []
    if kind == "head":
        return [blocks.per_chunk(C)]
    return [blocks.time(C, M)]


# ---- the chunk algebra inside a kernel ----


def _mexp(keep, x):
    return jnp.exp(jnp.where(keep, x, -jnp.inf))


def _triangle(C, upper=False):
    """[C, C] float32 ones on and below (above with `upper`) the diagonal."""
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    return ((row <= col) if upper else (row >= col)).astype(jnp.float32)


def _cumulative(a, C, row=False):
    """(b, n): the cumulative log decay inside the chunk with −inf read as 0, and the resets
    counted so far (exact small integers in float32), along the chunk's axis of a `[C, X]`
    column block (or a `[1, C]` row with `row`), by a matmul with a triangle."""
    reset = a == -jnp.inf
    finite, count = jnp.where(reset, 0.0, a), reset.astype(jnp.float32)
    if row:
        upper = _triangle(C, upper=True)
        return mxu_dot(finite, upper), mxu_dot(count, upper)
    lower = _triangle(C)
    return mxu_dot(lower, finite), mxu_dot(lower, count)


def _sum(x, axis):
    return jnp.sum(x, axis=axis, keepdims=True)


class _Chunk:
    """One chunk's decay factors and intra-chunk scores, for a decay kind.

    start [C, X], end [C, X]: the weights of the entering state on q_t and of k_s in the leaving
    state; `decay_rows(S)` / `decay_row(z)` apply the chunk's total decay to a state [M, Dv] and
    to a normaliser row [1, M] (or their cotangents).
    """

    def __init__(self, kind, decay, C):
        self.kind, self.C = kind, C
        self.start = self.end = None
        if kind == "head":
            b_col, n_col = _cumulative(as_column(decay[0]), C)
            b_row, n_row = _cumulative(decay[0], C, row=True)
            b_end, n_end = b_row[:, C - 1 :], n_row[:, C - 1 :]  # [1, 1]
            row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
            col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
            self.D = _mexp((row >= col) & (n_col == n_row), b_col - b_row)  # [C, C]
            self.start = _mexp(n_col == 0, b_col)
            self.end = _mexp(n_col == n_end, b_end - b_col)
            self.total_col = self.total_row = _mexp(n_end == 0, b_end)
        elif kind == "key":
            self.b, self.n = _cumulative(decay[0], C)  # [C, M]
            b_end, n_end = self.b[C - 1 :], self.n[C - 1 :]  # [1, M]
            self.start = _mexp(self.n == 0, self.b)
            self.end = _mexp(self.n == n_end, b_end - self.b)
            self.total_row = _mexp(n_end == 0, b_end)
            self.total_col = as_column(self.total_row)  # scales the state's rows
        else:
            row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
            col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
            self.D = (row >= col).astype(jnp.float32)

    def q_start(self, x):
        return x if self.start is None else x * self.start

    def k_end(self, x):
        return x if self.end is None else x * self.end

    def decay_rows(self, s_MD):
        return s_MD if self.kind == "none" else s_MD * self.total_col

    def decay_row(self, z_1M):
        return z_1M if self.kind == "none" else z_1M * self.total_row

    # ---- "key": sub-blocks of c queries ----

    def _sub_blocks(self, q, k):
        """Per sub-block i: (rows, q_i, k_i, off-diagonal factors or None, diagonal decays)."""
        for rows, q_scale, k_scale, diag in key_sub_blocks(self.b, self.n):
            off = None
            if q_scale is not None:  # keys of earlier sub-blocks, factored around r = i·c − 1
                off = (q[rows] * q_scale, k * k_scale, q_scale, k_scale)
            yield rows, q[rows], k[rows], off, diag

    # ---- intra-chunk forward and backward ----

    def intra(self, q, k, v):
        """(Σ_s A_ts v_s [C, Dv], Σ_s A_ts [C, 1]) and what `intra_grads` reuses."""
        if self.kind != "key":
            A = mxu_dot(q, k, trans_b=True) * self.D
            return mxu_dot(A, v), _sum(A, -1), A
        nums, sums, saved = [], [], []
        for rows, q_i, k_i, off, diag in self._sub_blocks(q, k):
            A_ii = jnp.sum(q_i[:, None, :] * k_i[None, :, :] * diag, axis=-1)  # [c, c]
            num, total = mxu_dot(A_ii, v[rows]), _sum(A_ii, -1)
            A_off = None
            if off is not None:
                A_off = mxu_dot(off[0], off[1], trans_b=True)  # [c, C], 0 from s ≥ i·c
                num, total = num + mxu_dot(A_off, v), total + _sum(A_off, -1)
            nums.append(num)
            sums.append(total)
            saved.append((rows, q_i, k_i, off, diag, A_ii, A_off))
        return jnp.concatenate(nums, 0), jnp.concatenate(sums, 0), saved

    def intra_grads(self, saved, q, k, v, dnum, dden):
        """Cotangents (dq, dk, dv) of the intra-chunk terms, given those of num and den."""
        if self.kind != "key":
            A = saved
            dA = mxu_dot(dnum, v, trans_b=True)
            if dden is not None:
                dA = dA + dden
            dA = dA * self.D
            return mxu_dot(dA, k), mxu_dot(dA, q, trans_a=True), mxu_dot(A, dnum, trans_a=True)
        dqs, dk_diag, dv_diag = [], [], []
        dk = jnp.zeros(k.shape, jnp.float32)
        dv = jnp.zeros(v.shape, jnp.float32)
        for rows, q_i, k_i, off, diag, A_ii, A_off in saved:
            dnum_i = dnum[rows]
            dA_ii = mxu_dot(dnum_i, v[rows], trans_b=True)  # [c, c]
            if dden is not None:
                dA_ii = dA_ii + dden[rows]
            g = dA_ii[:, :, None] * diag  # [c, c, M]
            dq_i = jnp.sum(g * k_i[None, :, :], axis=1)
            dk_diag.append(jnp.sum(g * q_i[:, None, :], axis=0))
            dv_diag.append(mxu_dot(A_ii, dnum_i, trans_a=True))
            if off is not None:
                q_off, k_off, q_scale, k_scale = off
                dA = mxu_dot(dnum_i, v, trans_b=True)  # [c, C]
                if dden is not None:
                    dA = dA + dden[rows]
                dq_i = dq_i + q_scale * mxu_dot(dA, k_off)
                dk = dk + k_scale * mxu_dot(dA, q_off, trans_a=True)
                dv = dv + mxu_dot(A_off, dnum_i, trans_a=True)
            dqs.append(dq_i)
        dq = jnp.concatenate(dqs, 0)
        return dq, dk + jnp.concatenate(dk_diag, 0), dv + jnp.concatenate(dv_diag, 0)


# ---- kernels ----


def _forward_kernel(*refs, kind, C, normalize, eps, keep):
    nd = _NUM_DECAY[kind]
    q_ref, k_ref, v_ref = refs[:3]
    decay_refs = refs[3 : 3 + nd]
    s0_ref, z0_ref = refs[3 + nd : 5 + nd]
    o_ref, s_ref, z_ref = refs[5 + nd : 8 + nd]
    s_acc, z_acc = refs[-2:]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        s_acc[...] = s0_ref[...]
        z_acc[...] = z0_ref[...]

    S, z = s_acc[...], z_acc[...]
    if keep:  # the state entering this chunk, for the backward pass
        se_ref, ze_ref = refs[8 + nd : 10 + nd]
        se_ref[...] = S
        ze_ref[...] = z
    q, k, v = (r[...].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))
    chunk = _Chunk(kind, [r[...] for r in decay_refs], C)
    num, rowsum, _ = chunk.intra(q, k, v)
    qs, ke = chunk.q_start(q), chunk.k_end(k)
    num = num + mxu_dot(qs, S)
    if normalize:
        num = num / (rowsum + _sum(qs * z, -1) + eps)
    o_ref[...] = num.astype(o_ref.dtype)
    S = chunk.decay_rows(S) + mxu_dot(ke, v, trans_a=True)
    z = chunk.decay_row(z) + _sum(ke, 0)
    s_acc[...] = S
    z_acc[...] = z

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        s_ref[...] = S
        z_ref[...] = z


def _backward_kernel(*refs, kind, C, normalize, eps):
    nd = _NUM_DECAY[kind]
    q_ref, k_ref, v_ref, do_ref = refs[:4]
    decay_refs = refs[4 : 4 + nd]
    se_ref, ze_ref, dsT_ref, dzT_ref = refs[4 + nd : 8 + nd]
    dq_ref, dk_ref, dv_ref = refs[8 + nd : 11 + nd]
    db_ref = refs[11 + nd] if kind != "none" else None  # no decay: no decay's cotangent
    ds0_ref, dz0_ref = refs[-4:-2]
    ds_acc, dz_acc = refs[-2:]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        ds_acc[...] = dsT_ref[...]
        dz_acc[...] = dzT_ref[...]

    dS, dz = ds_acc[...], dz_acc[...]  # cotangents of the state leaving this chunk
    S, z = se_ref[...], ze_ref[...]  # the state entering it
    q, k, v, do = (r[...].astype(jnp.float32) for r in (q_ref, k_ref, v_ref, do_ref))
    chunk = _Chunk(kind, [r[...] for r in decay_refs], C)
    num, rowsum, saved = chunk.intra(q, k, v)
    qs, ke = chunk.q_start(q), chunk.k_end(k)
    dden = None
    if normalize:
        num = num + mxu_dot(qs, S)
        den = rowsum + _sum(qs * z, -1) + eps
        dnum = do / den
        dden = -_sum(dnum * num, -1) / den  # [C, 1]
    else:
        dnum = do
    dq, dk, dv = chunk.intra_grads(saved, q, k, v, dnum, dden)
    dqs = mxu_dot(dnum, S, trans_b=True)
    if dden is not None:
        dqs = dqs + dden * z
    dq = dq + chunk.q_start(dqs)
    dk = dk + chunk.k_end(mxu_dot(v, dS, trans_b=True) + dz)
    dv = dv + mxu_dot(ke, dS)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    if kind != "none":
        db = q * dq - k * dk  # dL/dB_t: every term carries exp(B_query − B_key)
        if kind == "head":  # summed over channels, as a row [1, C]
            db = mxu_dot(jnp.ones((1, db.shape[-1]), jnp.float32), db, trans_b=True)
        db_ref[...] = db
    dS = chunk.decay_rows(dS) + mxu_dot(qs, dnum, trans_a=True)
    if dden is not None:
        dz = chunk.decay_row(dz) + _sum(qs * dden, 0)
    else:
        dz = chunk.decay_row(dz)
    ds_acc[...] = dS
    dz_acc[...] = dz

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        ds0_ref[...] = dS
        dz0_ref[...] = dz


def _flops(kind, R, N, C, M, Dv, backward):
    """Matmul and elementwise FLOPs of the kernels (the MXU's share dominates)."""
    intra = 2 * C * C * (M + Dv)  # scores and A·V
    inter = 2 * 2 * C * M * Dv  # q·S and the state update
    if kind == "key":
        intra += 6 * C * SUB_BLOCK * M  # the diagonal blocks, elementwise
    per_chunk = intra + inter
    if backward:  # recompute, then about twice the forward's products
        per_chunk *= 3
    return R * N * per_chunk


def _transcendentals(kind, R, N, C, M):
    if kind == "none":
        return 0
    if kind == "head":
        return R * N * (C * C + 3 * C)
    return R * N * (C * SUB_BLOCK * M + 3 * C * M)


def _forward_call(q, k, v, a, kv0, z0, config, keep):
    C, kind, normalize, eps, interpret = config
    B, T, H, M = q.shape
    Dv = v.shape[-1]
    R, N = B * H, T // C
    dtype = jnp.result_type(q, k, v)
    blocks = HeadBlocks(B, H, N)
    inputs = vary_together([q, k, v, *_decay_inputs(a, C), kv0, z0])
    struct = functools.partial(result_struct, like=inputs[0])
    in_specs = [blocks.time(C, M)] * 2 + [blocks.time(C, Dv)]
    in_specs += _decay_specs(kind, blocks, C, M)
    in_specs += [blocks.per_row(M, Dv), blocks.per_row(M)]
    out_shape = [
        struct(v.shape, dtype),
        struct((B, H, M, Dv), jnp.float32),
        struct((B, H, M), jnp.float32),
    ]
    out_specs = [blocks.time(C, Dv), blocks.per_row(M, Dv), blocks.per_row(M)]
    if keep:
        out_shape += [
            struct((B, N, H, M, Dv), jnp.float32),
            struct((B, N, H, M), jnp.float32),
        ]
        out_specs += [blocks.per_chunk(M, Dv), blocks.per_chunk(M)]
    body = functools.partial(
        _forward_kernel, kind=kind, C=C, normalize=normalize, eps=eps, keep=keep
    )
    # head axis: 1 in the time blocks (q, k, v, a per key, o), 0 in the others
    time_blocks = 3 + (kind == "key")
    axes = [1] * time_blocks + [0] * (len(inputs) - time_blocks) + [1] + [0] * (len(out_shape) + 1)
    outs = pl.pallas_call(
        per_head(body, axes, blocks.G),
        out_shape=out_shape,
        grid=(blocks.rows, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[vmem_f32((blocks.G, M, Dv)), vmem_f32((blocks.G, M))],
        compiler_params=compiler_params(),
        cost_estimate=cost_estimate(
            flops=_flops(kind, R, N, C, M, Dv, backward=False),
            transcendentals=_transcendentals(kind, R, N, C, M),
            arrays=inputs + out_shape,
        ),
        interpret=interpret,
        name=f"linear_attention_fwd_{kind}",
    )(*inputs)
    return outs[0], outs[1], outs[2], tuple(outs[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _linear_pallas(q, k, v, a, kv0, z0, config):
    o, kv, z, _ = _forward_call(q, k, v, a, kv0, z0, config, keep=False)
    return o, kv, z


def _linear_pallas_fwd(q, k, v, a, kv0, z0, config):
    o, kv, z, entering = _forward_call(q, k, v, a, kv0, z0, config, keep=True)
    # Residuals: the inputs, the final state and the state entering each chunk.
    return (o, kv, z), (q, k, v, a, kv, z, entering)


def _linear_pallas_bwd(config, residuals, cotangents):
    C, kind, normalize, eps, interpret = config
    q, k, v, a, kv, z, (s_enter, z_enter) = residuals
    do, dkv, dz = cotangents
    B, T, H, M = q.shape
    Dv = v.shape[-1]
    R, N = B * H, T // C
    blocks = HeadBlocks(B, H, N, reverse=True)
    inputs = [q, k, v, do.astype(jnp.result_type(q, k, v)), *_decay_inputs(a, C)]
    inputs = vary_together(inputs + [s_enter, z_enter, dkv, dz])
    struct = functools.partial(result_struct, like=inputs[0])
    qk_spec, vo_spec = blocks.time(C, M), blocks.time(C, Dv)
    in_specs = [qk_spec] * 2 + [vo_spec] * 2 + _decay_specs(kind, blocks, C, M)
    in_specs += [blocks.per_chunk(M, Dv), blocks.per_chunk(M)]
    in_specs += [blocks.per_row(M, Dv), blocks.per_row(M)]
    out_shape = [struct(q.shape, q.dtype), struct(k.shape, k.dtype), struct(v.shape, v.dtype)]
    out_specs = [qk_spec] * 2 + [vo_spec]
    if kind == "head":  # dL/dB summed over channels: a row per head and chunk
        out_shape.append(struct((B, N, H, C), jnp.float32))
        out_specs.append(blocks.per_chunk(C))
    elif kind == "key":
        out_shape.append(struct(q.shape, jnp.float32))
        out_specs.append(qk_spec)
    out_shape += [struct((B, H, M, Dv), jnp.float32), struct((B, H, M), jnp.float32)]
    out_specs += [blocks.per_row(M, Dv), blocks.per_row(M)]
    body = functools.partial(_backward_kernel, kind=kind, C=C, normalize=normalize, eps=eps)
    # head axis: 1 in the time blocks (q, k, v, do, a per key; dq, dk, dv, db per key)
    time_in, time_out = 4 + (kind == "key"), 3 + (kind == "key")
    axes = [1] * time_in + [0] * (len(inputs) - time_in)
    axes += [1] * time_out + [0] * (len(out_shape) - time_out) + [0, 0]
    dq, dk, dv, *db, ds0, dz0 = pl.pallas_call(
        per_head(body, axes, blocks.G),
        out_shape=out_shape,
        grid=(blocks.rows, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[vmem_f32((blocks.G, M, Dv)), vmem_f32((blocks.G, M))],
        compiler_params=compiler_params(),
        cost_estimate=cost_estimate(
            flops=_flops(kind, R, N, C, M, Dv, backward=True),
            transcendentals=_transcendentals(kind, R, N, C, M),
            arrays=inputs + out_shape,
        ),
        interpret=interpret,
        name=f"linear_attention_bwd_{kind}",
    )(*inputs)
    da = None
    if a is not None:
        # the final state carries exp(B_T − B_s): ⟨dS_T, S_T⟩ enters dL/dB at the last token
        end_BHM = jnp.sum(dkv * kv, -1) + dz * z
        if kind == "key":
            end_BHX, db_BTHX = end_BHM, db[0]
        else:
            end_BHX = jnp.sum(end_BHM, -1, keepdims=True)
            db_BTHX = jnp.swapaxes(db[0], -1, -2).reshape(B, T, H, 1)
        db_BTHX = db_BTHX.at[:, -1].add(end_BHX)
        da = suffix_sum_to_reset(db_BTHX, jnp.isneginf(a))
    return dq, dk, dv, da, ds0, dz0


_linear_pallas.defvjp(_linear_pallas_fwd, _linear_pallas_bwd)

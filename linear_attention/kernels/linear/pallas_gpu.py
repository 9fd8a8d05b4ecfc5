"""Causal linear attention as Mosaic GPU (Hopper) kernels: the chunk form of `chunked.py`, one
thread block per (batch row · head, tile of value channels) walking the chunks in order with the
state in registers, the matmuls on the tensor cores (wgmma) and every chunk brought in and sent
out by TMA (`primitives.mosaic_gpu`). The forward kernel is a two-stage pipeline (the next
chunk's copies in flight while this one computes, `mosaic_gpu.walk`); the backward kernel,
whose buffers fill 185 KiB of the H100's 227 at K = 128, loads each chunk as it reaches it.

Per chunk of C tokens (C a multiple of 64, wgmma's row tile), with b_t the cumulative log decay
inside the chunk, n_t the resets counted so far in it (exp(b_t − b_s) is kept only where
n_t = n_s and s ≤ t, masked before `exp`, so no exponent is positive and −30 per token is
exact), and S the state `[M, V]` entering the chunk (V: the block's value tile):

    o_t = Σ_{s ≤ t} A_ts v_s + (q_t · start_t) S       A_ts = (q_t · k_s) exp(b_t − b_s)
    S'  = total · S + Σ_s (k_s · end_s) v_sᵀ           start_t = exp(b_t), 0 after a reset
                                                        end_s = exp(b_C − b_s), 0 before one
                                                        total = exp(b_C), 0 with a reset

This is the recurrence S_t = exp(a_t) S_{t−1} + k_t v_tᵀ, o_t = q_tᵀ S_t unrolled over a chunk:
S_t = exp(b_t) S + Σ_{s ≤ t} exp(b_t − b_s) k_s v_sᵀ. The log decay is one number per token and
head (`[B, T, H]`: no decay, a fixed per-head decay, Mamba-2 / simple GLA, resets); b, n, start,
end and total are taken per chunk outside the kernel in XLA (`decays.ChunkDecays`), `[B, H, T]`
rows of 1/M the size of q, since Mosaic GPU lowers no cumulative sum.

The normaliser is the same kernel on one more value tile of ones: its output is the
denominator q_tᵀ z_t and its state (every column) the key sum z; `causal_pallas_gpu` divides in
XLA. Value channels are cut into tiles of 64 (`VALUE_TILE`), one block each, so a block's state
is `[M, 64]` float32 in registers (the chunk's scores are recomputed per tile, as
flash-linear-attention's kernels do).

The gradient is a `jax.custom_vjp`. The forward kernel keeps the state entering each chunk
(one `[M, V]` state per chunk and tile, as the XLA chunk form does); the backward kernel walks
the chunks last to first carrying the state cotangent dS:

    dv = Aᵀ do + (k ⊙ end) dS                 dA = (do vᵀ) ⊙ D   (D: the decay mask above)
    dq = dA k + start ⊙ (do Sᵀ)               dS_prev = total · dS + (q ⊙ start)ᵀ do
    dk = dAᵀ q + end ⊙ (v dSᵀ)                dL/dB_t = q_t · dq_t − k_t · dk_t

Each value tile gives its share of dq, dk and dL/dB (float32, summed in XLA); the log decays'
cotangent is then the suffix sum of dL/dB to the next reset (`decays.suffix_sum_to_reset`), as
in `chunked.py` and the TPU kernel (`pallas.py`).

Numerics: q, k, v stay in their dtype (the wgmma operands: bfloat16 or float16 on Hopper;
float32 inputs run only interpreted: on the tensor cores they would be tf32, which takes no
transposed operand, and the compiled path raises). Scores, states and their cotangents are float32
in registers and are rounded to the input dtype only as the operands of the next matmul (as
flash-linear-attention's kernels do); decays, sums and outputs' accumulation are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.kernels.linear.pallas_gpu_key import key_decay_inputs, key_decay_walk
from linear_attention.kernels.primitives import mosaic_gpu as mg
from linear_attention.kernels.primitives.decays import ChunkDecays, suffix_sum_to_reset
from linear_attention.kernels.primitives.layout import pad_last, pad_time
from linear_attention.kernels.primitives.pallas import round_up

# Value channels per block; also the padding multiple of the key channels (a wgmma K tile of
# 128-byte swizzled bfloat16 rows).
VALUE_TILE = 64


def causal_pallas_gpu(
    q_BTHM, k_BTHM, v_BTHD, a_BTH, kv0_BHMD, z0_BHM, *, chunk_size, normalize, eps, interpret
):
    """Causal linear attention by the Mosaic GPU kernels.

    `q, k, v` in their input dtype; `a_BTH` the float32 log decay `[B, T, H]`, `[B, T, H, M]`
    (per key channel: `pallas_gpu_key.py`) or None; `kv0_BHMD`,
    `z0_BHM` the float32 initial state (`z0_BHM` None: zeros, and no normaliser is carried
    unless `normalize`). `chunk_size` a multiple of 64. Returns
    `(o_BTHD in result_type(q, k, v), kv_BHMD, z_BHM)`.
    """
    if chunk_size % mg.WGMMA_ROWS:
        raise ValueError(
            f'chunk_size must be a multiple of {mg.WGMMA_ROWS} for method="pallas" on GPU '
            f"(a chunk is whole wgmma row tiles), got {chunk_size}"
        )
    B, T, H, M = q_BTHM.shape
    Dv = v_BTHD.shape[-1]
    C = chunk_size
    dtype = jnp.result_type(q_BTHM, k_BTHM, v_BTHD)
    if not interpret and jnp.dtype(dtype).itemsize != 2:
        raise ValueError(
            'causal_linear_attention(method="pallas") on GPU: q, k and v must be bfloat16 or '
            "float16, the wgmma operand types (a float32 operand is tf32 on the tensor cores "
            f"and takes no transposed operand), got {jnp.dtype(dtype).name}; with axis_name "
            "each shard's call computes in float32, so a split run cannot use it. Cast the "
            'inputs, or use method="chunk"'
        )
    Mp, Dp = round_up(M, VALUE_TILE), round_up(Dv, VALUE_TILE)
    # zero channels and tokens change nothing: a padded token has zero q, k, v and log decay
    q, k = (pad_last(pad_time(x.astype(dtype), C), Mp) for x in (q_BTHM, k_BTHM))
    v = pad_last(pad_time(v_BTHD.astype(dtype), C), Dp)
    a = pad_time(jnp.zeros((B, T, H), jnp.float32) if a_BTH is None else a_BTH, C)
    if a.ndim == 4:  # a decay per key channel: zero on padded channels
        a = pad_last(a, Mp)
    s0 = pad_last(jnp.pad(kv0_BHMD, ((0, 0), (0, 0), (0, Mp - M), (0, 0))), Dp)
    with_sum = normalize or z0_BHM is not None
    if with_sum:  # one more value tile of ones: its output is the normaliser, its state z
        v = jnp.concatenate([v, jnp.ones((*v.shape[:3], VALUE_TILE), dtype)], -1)
        z0 = jnp.zeros((B, H, M), jnp.float32) if z0_BHM is None else z0_BHM
        z0 = jnp.pad(z0, ((0, 0), (0, 0), (0, Mp - M)))
        s0 = jnp.concatenate([s0, jnp.broadcast_to(z0[..., None], (*z0.shape, VALUE_TILE))], -1)
    if a.ndim == 4:  # the intra-chunk scores from XLA, the chunk walk in the kernels
        A, qs, ke, total = key_decay_inputs(q, k, a, C)
        out, s = key_decay_walk(
            A, qs, ke, v, total, s0, C=C, V=VALUE_TILE, interpret=interpret, check_smem=_check_smem
        )
    else:
        out, s = _linear_gpu(q, k, v, a, s0, (C, dtype, bool(interpret)))
    o = out[:, :T, :, :Dv]
    kv = s[:, :, :M, :Dv]
    z = s[:, :, :M, Dp] if with_sum else None
    if normalize:
        o = o / (out[:, :T, :, Dp : Dp + 1] + eps)
    return o.astype(dtype), kv, z


def _decay_rows(a_BTH, C, M):
    """The kernels' decay inputs from the padded log decay `[B, T, H]`: `[B, H, T]` float32
    rows b, n, start, end, and total `[B, H, N, M]` (the same number in each of the M entries:
    it scales the state's rows)."""
    B, T, H = a_BTH.shape
    N = T // C
    a = jnp.moveaxis(a_BTH, 1, 2).reshape(B, H, N, C, 1)
    d = ChunkDecays(a)
    rows = [x.reshape(B, H, T).astype(jnp.float32) for x in (d.b, d.n, d.start, d.end)]
    total = jnp.broadcast_to(d.total, (B, H, N, M)).astype(jnp.float32)
    return rows, total


# ---- kernels ----


class _Chunk:
    """One chunk's decay mask and factors inside a kernel, read from its shared buffers."""

    def __init__(self, b_s, n_s, start_s, end_s, total_s, C, interpret):
        self.C, self.interpret = C, interpret
        b_t, n_t = mg.read_rows(b_s, interpret=interpret), mg.read_rows(n_s, interpret=interpret)
        b_s_, n_s_ = (mg.read_columns(r, interpret=interpret) for r in (b_s, n_s))
        shape = (C, C)
        t = mg.iota(shape, 0, interpret=interpret)
        s = mg.iota(shape, 1, interpret=interpret)
        keep = (t >= s) & (mg.per_row(n_t, shape) == mg.per_column(n_s_, shape))
        diff = mg.per_row(b_t, shape) - mg.per_column(b_s_, shape)
        self.D = jnp.exp(jnp.where(keep, diff, -jnp.inf))  # masked before exp
        self.start = mg.read_rows(start_s, interpret=interpret)
        self.end = mg.read_rows(end_s, interpret=interpret)
        self.total = mg.read_rows(total_s, interpret=interpret)

    def rows(self, x, factor):
        return x * mg.per_row(factor, x.shape)


def _forward_kernel(*refs, C, N, H, interpret, keep):
    q_ref, k_ref, v_ref, b_ref, n_ref, st_ref, en_ref, tot_ref, s0_ref = refs[:9]
    o_ref, s_ref = refs[9:11]
    se_ref = refs[11] if keep else None
    q_s, k_s, v_s, b_s, n_s, st_s, en_s, tot_s = refs[11 + keep : 19 + keep]
    a_s, x_s, S_s, o_s, f32_s, bar_in, bar_s = refs[19 + keep :]
    dtype = q_s.dtype
    b, h, vt, vs = mg.block_position(H, v_s.shape[-1])
    mm = functools.partial(mg.matmul, interpret=interpret)

    staged = (q_s, k_s, v_s, b_s, n_s, st_s, en_s, tot_s)

    def inputs(j, slot):
        t = mg.ds(j * C, C)
        src = (q_ref.at[b, t, h], k_ref.at[b, t, h], v_ref.at[b, t, h, vs])
        src += tuple(r.at[b, h, t] for r in (b_ref, n_ref, st_ref, en_ref))
        src += (tot_ref.at[b, h, j],)
        return [(x, buf.at[slot]) for x, buf in zip(src, staged, strict=True)]

    def step(j, slot, S):
        t = mg.ds(j * C, C)
        q_s, k_s, v_s, b_s, n_s, st_s, en_s, tot_s = (buf.at[slot] for buf in staged)
        ch = _Chunk(b_s, n_s, st_s, en_s, tot_s, C, interpret)
        A = mm(q_s, k_s, trans_b=True) * ch.D
        q = mg.read(q_s, interpret=interpret).astype(jnp.float32)
        k = mg.read(k_s, interpret=interpret).astype(jnp.float32)
        a_s[...] = A.astype(dtype)
        x_s[...] = ch.rows(q, ch.start).astype(dtype)
        S_s[...] = S.astype(dtype)
        mg.drain()  # the previous chunk's output and state copies have left f32_s and o_s
        if keep:  # the state entering this chunk, for the backward pass
            f32_s[...] = S
        mg.publish()
        o = mm(x_s, S_s, init=mm(a_s, v_s))
        o_s[...] = o.astype(dtype)
        x_s[...] = ch.rows(k, ch.end).astype(dtype)  # q ⊙ start is read: the buffer is free
        out = [(o_s, o_ref.at[b, t, h, vs])]
        if keep:
            out.append((f32_s, se_ref.at[b, h, j, :, vs]))
        mg.store(out)  # also publishes k ⊙ end to the tensor cores
        return mm(x_s, v_s, trans_a=True, init=ch.rows(S, ch.total))

    state = (s0_ref.at[b, h, :, vs], s_ref.at[b, h, :, vs])
    pipeline = dict(inputs=inputs, input_bars=bar_in)
    mg.walk(step, N, *state, f32_s, bar_s, reverse=False, interpret=interpret, **pipeline)


def _backward_kernel(*refs, C, N, H, interpret):
    q_ref, k_ref, v_ref, do_ref, b_ref, n_ref, st_ref, en_ref, tot_ref, se_ref, dsT_ref = refs[:11]
    dq_ref, dk_ref, dv_ref, db_ref, ds0_ref = refs[11:16]
    q_s, k_s, v_s, do_s, b_s, n_s, st_s, en_s, tot_s = refs[16:25]
    a_s, da_s, x_s, S_s, dS_s, dv_s, g_s, f32_s, db_s, bar_in, bar_s = refs[25:]
    dtype = q_s.dtype
    b, h, vt, vs = mg.block_position(H, v_s.shape[1])
    mm = functools.partial(mg.matmul, interpret=interpret)

    def step(j, dS):
        t = mg.ds(j * C, C)
        mg.drain()  # the previous chunk's copies out have left the output buffers
        mg.load(
            [
                (q_ref.at[b, t, h], q_s),
                (k_ref.at[b, t, h], k_s),
                (v_ref.at[b, t, h, vs], v_s),
                (do_ref.at[b, t, h, vs], do_s),
                (b_ref.at[b, h, t], b_s),
                (n_ref.at[b, h, t], n_s),
                (st_ref.at[b, h, t], st_s),
                (en_ref.at[b, h, t], en_s),
                (tot_ref.at[b, h, j], tot_s),
                (se_ref.at[b, h, j, :, vs], f32_s),
            ],
            bar_in,
        )
        ch = _Chunk(b_s, n_s, st_s, en_s, tot_s, C, interpret)
        A = mm(q_s, k_s, trans_b=True) * ch.D
        dA = mm(do_s, v_s, trans_b=True) * ch.D
        q = mg.read(q_s, interpret=interpret).astype(jnp.float32)
        k = mg.read(k_s, interpret=interpret).astype(jnp.float32)
        S = mg.read(f32_s, interpret=interpret)
        a_s[...] = A.astype(dtype)
        da_s[...] = dA.astype(dtype)
        x_s[...] = ch.rows(k, ch.end).astype(dtype)
        S_s[...] = S.astype(dtype)
        dS_s[...] = dS.astype(dtype)
        mg.publish()
        dv = mm(x_s, dS_s, init=mm(a_s, do_s, trans_a=True))
        dq = mm(da_s, k_s) + ch.rows(mm(do_s, S_s, trans_b=True), ch.start)
        dk = mm(da_s, q_s, trans_a=True) + ch.rows(mm(v_s, dS_s, trans_b=True), ch.end)
        db_s[...] = jnp.sum(q * dq - k * dk, axis=1)  # dL/dB_t, this tile's share
        dv_s[...] = dv.astype(dtype)
        g_s[...] = dq
        mg.store(
            [
                (dv_s, dv_ref.at[b, t, h, vs]),
                (g_s, dq_ref.at[vt, b, t, h]),
                (db_s, db_ref.at[vt, b, h, t]),
            ]
        )
        mg.drain()
        g_s[...] = dk
        x_s[...] = ch.rows(q, ch.start).astype(dtype)  # k ⊙ end is read: the buffer is free
        mg.store([(g_s, dk_ref.at[vt, b, t, h])])  # also publishes q ⊙ start
        return mm(x_s, do_s, trans_a=True, init=ch.rows(dS, ch.total))

    cotangent = (dsT_ref.at[b, h, :, vs], ds0_ref.at[b, h, :, vs])
    mg.walk(step, N, *cotangent, f32_s, bar_s, reverse=True, interpret=interpret)


# ---- calls ----


# Shared memory past an H100's raises before compiling (`mosaic_gpu.check_smem`).
_check_smem = functools.partial(
    mg.check_smem, what='causal_linear_attention(method="pallas")', tile=VALUE_TILE
)


def _call_forward(q, k, v, a, s0, config, keep):
    C, dtype, interpret = config
    B, T, H, M = q.shape
    Dv = v.shape[-1]
    N, V = T // C, VALUE_TILE
    rows, total = _decay_rows(a, C, M)
    out_type = [
        jax.ShapeDtypeStruct((B, T, H, Dv), dtype),
        jax.ShapeDtypeStruct((B, H, M, Dv), jnp.float32),
    ]
    if keep:
        out_type.append(jax.ShapeDtypeStruct((B, H, N, M, Dv), jnp.float32))
    f32 = jnp.float32
    staged = [mg.smem((C, M), dtype, 2), mg.smem((C, M), dtype, 2), mg.smem((C, V), dtype, 2)]
    staged += [mg.smem((C,), f32, 2)] * 4 + [mg.smem((M,), f32, 2)]
    scratch = staged + [mg.smem((C, C), dtype), mg.smem((C, M), dtype)]
    scratch += [mg.smem((M, V), dtype), mg.smem((C, V), dtype), mg.smem((M, V), f32)]
    _check_smem(scratch, "forward", C, M, dtype)
    scratch += [mg.barrier(len(staged), stages=2), mg.barrier(1)]
    body = functools.partial(_forward_kernel, C=C, N=N, H=H, interpret=interpret, keep=keep)
    outs = mg.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        rows=B * H,
        tiles=Dv // V,
        interpret=interpret,
        name="linear_attention_fwd_gpu",
    )(q, k, v, *rows, total, s0)
    return outs[0], outs[1], (outs[2] if keep else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_gpu(q, k, v, a, s0, config):
    o, s, _ = _call_forward(q, k, v, a, s0, config, keep=False)
    return o, s


def _linear_gpu_fwd(q, k, v, a, s0, config):
    o, s, entering = _call_forward(q, k, v, a, s0, config, keep=True)
    return (o, s), (q, k, v, a, s, entering)


def _linear_gpu_bwd(config, residuals, cotangents):
    C, dtype, interpret = config
    q, k, v, a, s, entering = residuals
    do, ds = cotangents
    B, T, H, M = q.shape
    Dv = v.shape[-1]
    N, V = T // C, VALUE_TILE
    NV = Dv // V
    rows, total = _decay_rows(a, C, M)
    f32 = jnp.float32
    out_type = [
        jax.ShapeDtypeStruct((NV, B, T, H, M), f32),
        jax.ShapeDtypeStruct((NV, B, T, H, M), f32),
        jax.ShapeDtypeStruct((B, T, H, Dv), dtype),
        jax.ShapeDtypeStruct((NV, B, H, T), f32),
        jax.ShapeDtypeStruct((B, H, M, Dv), f32),
    ]
    scratch = [mg.smem((C, M), dtype), mg.smem((C, M), dtype)]
    scratch += [mg.smem((C, V), dtype), mg.smem((C, V), dtype)]
    scratch += [mg.smem((C,), f32)] * 4 + [mg.smem((M,), f32)]
    scratch += [mg.smem((C, C), dtype), mg.smem((C, C), dtype)]
    scratch += [mg.smem((C, M), dtype)]
    scratch += [mg.smem((M, V), dtype), mg.smem((M, V), dtype), mg.smem((C, V), dtype)]
    scratch += [mg.smem((C, M), f32), mg.smem((M, V), f32), mg.smem((C,), f32)]
    _check_smem(scratch, "backward", C, M, dtype)
    scratch += [mg.barrier(10), mg.barrier(1)]
    body = functools.partial(_backward_kernel, C=C, N=N, H=H, interpret=interpret)
    dq, dk, dv, db, ds0 = mg.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        rows=B * H,
        tiles=NV,
        interpret=interpret,
        name="linear_attention_bwd_gpu",
    )(q, k, v, do.astype(dtype), *rows, total, entering, ds)
    # the final state carries exp(B_T − B_s): ⟨dS_T, S_T⟩ enters dL/dB at the last token
    db_BTH = jnp.moveaxis(jnp.sum(db, 0), 2, 1)
    db_BTH = db_BTH.at[:, -1].add(jnp.sum(ds * s, (-2, -1)))
    da = suffix_sum_to_reset(db_BTH[..., None], jnp.isneginf(a)[..., None])[..., 0]
    return jnp.sum(dq, 0).astype(q.dtype), jnp.sum(dk, 0).astype(k.dtype), dv, da, ds0


_linear_gpu.defvjp(_linear_gpu_fwd, _linear_gpu_bwd)

"""Causal linear attention with a log decay per key channel (GLA, RWKV-6-style gates) on Hopper:
the chunk walk as Mosaic GPU kernels, the intra-chunk scores from XLA.

With a decay per key channel the scores of a chunk are A_ts = Σ_m q_tm k_sm exp(b_tm − b_sm)
(s ≤ t, b the cumulative log decay inside the chunk, masked before `exp` across a reset): the
exponent depends on the channel, so A is no single matmul. Its exact form splits the chunk
into sub-blocks of 16 queries, a matmul for the keys of earlier sub-blocks and `[16, 16, M]`
elementwise decays for the diagonal blocks (`decays.SubBlocks`, as the XLA chunk form does);
those diagonal blocks need row gathers of the float32 decays that Mosaic GPU's wgmma-tiled
arrays (64-row tiles) do not express, so here XLA makes A (and, by autodiff, its pullback) and
the kernels take it as an input. Per chunk, with start_t = exp(b_t), end_s = exp(b_C − b_s)
and total = exp(b_C) per channel (0 across a reset):

    o_t = Σ_s A_ts v_s + (q_t ⊙ start_t)ᵀ S        S' = diag(total) S + Σ_s (k_s ⊙ end_s) v_sᵀ

The kernels (one block per batch row · head and 64-wide value tile, the chunks in order, the
state `[M, 64]` in registers, wgmma and TMA as in `pallas_gpu.py`) take A `[B, H, T, C]`
(float32), q ⊙ start and k ⊙ end (in the input dtype) and total `[B, H, N, M]`. Their backward
pass walks the chunks last to first with the state cotangent dS:

    dA = do vᵀ     dv = Aᵀ do + (k ⊙ end) dS     d(q ⊙ start) = do Sᵀ     d(k ⊙ end) = v dSᵀ
    d total_m = Σ_v dS_mv S_mv                  dS_prev = diag(total) dS + (q ⊙ start)ᵀ do

(each value tile's share, float32, summed in XLA), and XLA's autodiff carries them back to q, k
and the log decay through A, the factors and the cumulative sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.kernels.primitives import mosaic_gpu as mg
from linear_attention.kernels.primitives.decays import ChunkDecays, SubBlocks, sub_block_size

# Chunks whose scores XLA makes at once (`key_decay_inputs`): the sub-block decays of a chunk
# are 16 times its q in float32, so the whole sequence's at once dwarfs the kernels' memory.
SCORE_CHUNKS = 8


def key_decay_inputs(q_BTHM, k_BTHM, a_BTHM, C):
    """(A `[B, H, T, C]` float32, q ⊙ start and k ⊙ end `[B, T, H, M]` in q's dtype, total
    `[B, H, N, M]`) from the padded inputs (T a multiple of C), differentiably: `SCORE_CHUNKS`
    chunks at a time (`lax.map`), each group's sub-block decays remade in the backward pass
    (`jax.checkpoint`), so XLA holds one group's at a time."""
    B, T, H, M = q_BTHM.shape
    N = T // C
    dtype = q_BTHM.dtype

    def chunk_major(x):  # [B, T, H, M] -> [N, B, H, C, M]
        return jnp.moveaxis(x.reshape(B, N, C, H, M), (1, 3), (0, 2))

    @jax.checkpoint
    def one_chunk(qka):
        q, k, a = qka
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        d = ChunkDecays(a)
        A = SubBlocks(d.b, d.n, sub_block_size(C)).scores(q, k)  # [B, H, C, C]
        return A, (q * d.start).astype(dtype), (k * d.end).astype(dtype), d.total

    qka = tuple(chunk_major(x) for x in (q_BTHM, k_BTHM, a_BTHM))
    A, qs, ke, total = jax.lax.map(one_chunk, qka, batch_size=min(SCORE_CHUNKS, N))
    A = jnp.moveaxis(A, 0, 2).reshape(B, H, T, C)
    qs, ke = (jnp.moveaxis(x, (0, 2), (1, 3)).reshape(B, T, H, M) for x in (qs, ke))
    return A, qs, ke, jnp.moveaxis(total, 0, 2)


def _forward_kernel(*refs, C, N, H, interpret, keep, delta):
    A_ref, qs_ref, ke_ref, v_ref, tot_ref = refs[:5]
    w_ref = refs[5] if delta else None
    s0_ref, o_ref, s_ref = refs[5 + delta : 8 + delta]
    se_ref = refs[8 + delta] if keep else None
    refs = refs[8 + delta + keep :]
    A_s, qs_s, ke_s, v_s, tot_s = refs[:5]
    w_s = refs[5] if delta else None
    a_s, S_s, o_s, f32_s = refs[5 + delta : 9 + delta]
    x_s = refs[9 + delta] if delta else None
    bar_in, bar_s = refs[-2:]
    dtype = a_s.dtype
    b, h, vt, vs = mg.block_position(H, v_s.shape[-1])
    mm = functools.partial(mg.matmul, interpret=interpret)
    staged = (A_s, qs_s, ke_s, v_s, tot_s) + ((w_s,) if delta else ())

    def inputs(j, slot):
        t = mg.ds(j * C, C)
        src = (A_ref.at[b, h, t], qs_ref.at[b, t, h], ke_ref.at[b, t, h])
        src += (v_ref.at[b, t, h, vs], tot_ref.at[b, h, j])
        if delta:
            src += (w_ref.at[b, t, h],)
        return [(x, buf.at[slot]) for x, buf in zip(src, staged, strict=True)]

    def step(j, slot, S):
        t = mg.ds(j * C, C)
        A_s, qs_s, ke_s, v_s, tot_s, *w_s = (buf.at[slot] for buf in staged)
        a_s[...] = mg.read(A_s, interpret=interpret).astype(dtype)
        S_s[...] = S.astype(dtype)
        mg.drain()  # the previous chunk's output and state copies have left f32_s and o_s
        if keep:  # the state entering this chunk, for the backward pass
            f32_s[...] = S
        mg.publish()
        vals = _values(v_s, *(w_s or [None]), x_s, S_s, interpret=interpret)
        o = mm(qs_s, S_s, init=mm(a_s, vals))
        o_s[...] = o.astype(dtype)
        out = [(o_s, o_ref.at[b, t, h, vs])]
        if keep:
            out.append((f32_s, se_ref.at[b, h, j, :, vs]))
        mg.store(out)
        total = mg.read_rows(tot_s, interpret=interpret)
        return mm(ke_s, vals, trans_a=True, init=S * mg.per_row(total, S.shape))

    state = (s0_ref.at[b, h, :, vs], s_ref.at[b, h, :, vs])
    pipeline = dict(inputs=inputs, input_bars=bar_in)
    mg.walk(step, N, *state, f32_s, bar_s, reverse=False, interpret=interpret, **pipeline)


def _backward_kernel(*refs, C, N, H, interpret, delta):
    A_ref, qs_ref, ke_ref, v_ref, do_ref, tot_ref, se_ref, dsT_ref = refs[:8]
    w_ref = refs[8] if delta else None
    refs = refs[8 + delta :]
    dA_ref, dqs_ref, dke_ref, dv_ref, dtot_ref, ds0_ref = refs[:6]
    refs = refs[6:]
    (A_s, qs_s, ke_s, v_s, tot_s, a_s, do_s, S_s, dS_s, g_s, f32_s, dtot_s, dv_s) = refs[:13]
    w_s, x_s = refs[13:15] if delta else (None, None)
    bar_in, bar_s = refs[-2:]
    dtype = a_s.dtype
    b, h, vt, vs = mg.block_position(H, v_s.shape[1])
    mm = functools.partial(mg.matmul, interpret=interpret)

    def step(j, dS):
        t = mg.ds(j * C, C)
        mg.drain()  # the previous chunk's copies out have left the output buffers
        copies = [
            (A_ref.at[b, h, t], A_s),
            (qs_ref.at[b, t, h], qs_s),
            (ke_ref.at[b, t, h], ke_s),
            (v_ref.at[b, t, h, vs], v_s),
            (do_ref.at[b, t, h, vs], do_s),
            (tot_ref.at[b, h, j], tot_s),
            (se_ref.at[b, h, j, :, vs], f32_s),
        ]
        if delta:
            copies.append((w_ref.at[b, t, h], w_s))
        mg.load(copies, bar_in)
        S = mg.read(f32_s, interpret=interpret)
        a_s[...] = mg.read(A_s, interpret=interpret).astype(dtype)
        S_s[...] = S.astype(dtype)
        dS_s[...] = dS.astype(dtype)
        dtot_s[...] = jnp.sum(dS * S, axis=1)  # d total_m, this tile's share
        mg.publish()
        vals = _values(v_s, w_s, x_s, S_s, interpret=interpret)  # as the forward pass's
        A_s[...] = mm(do_s, vals, trans_b=True)  # dA (A's float32 copy is read)
        dv = mm(ke_s, dS_s, init=mm(a_s, do_s, trans_a=True))  # dv, or dX = dU
        g_s[...] = mm(do_s, S_s, trans_b=True)  # d(q ⊙ start)
        dv_s[...] = dv.astype(dtype)
        mg.store(
            [
                (A_s, dA_ref.at[vt, b, h, t]),
                (g_s, dqs_ref.at[vt, b, t, h]),
                (dv_s, dv_ref.at[b, t, h, vs]),
                (dtot_s, dtot_ref.at[vt, b, h, j]),
            ]
        )
        mg.drain()
        g_s[...] = mm(vals, dS_s, trans_b=True)  # d(k ⊙ end)
        mg.store([(g_s, dke_ref.at[vt, b, t, h])])
        total = mg.read_rows(tot_s, interpret=interpret)
        dS_prev = mm(qs_s, do_s, trans_a=True, init=dS * mg.per_row(total, dS.shape))
        if delta:  # X = U − W S: −Wᵀ dX joins dS (dW = −dX Sᵀ is taken in XLA: `_walk_bwd`)
            dS_prev = dS_prev - mm(w_s, dv_s, trans_a=True)
        return dS_prev

    cotangent = (dsT_ref.at[b, h, :, vs], ds0_ref.at[b, h, :, vs])
    mg.walk(step, N, *cotangent, f32_s, bar_s, reverse=True, interpret=interpret)


def _values(v_s, w_s, x_s, S_s, *, interpret):
    """The chunk's values for the walk: v itself, or with W (`w_s`; v then holds U) the delta
    rule's X = U − W S, written to `x_s` in its dtype and published to the tensor cores."""
    if w_s is None:
        return v_s
    U = mg.read(v_s, interpret=interpret).astype(jnp.float32)
    x_s[...] = (U - mg.matmul(w_s, S_s, interpret=interpret)).astype(x_s.dtype)
    mg.publish()
    return x_s


def _scratch(C, M, V, dtype, backward, delta):
    """The kernels' shared buffers: the chunk's inputs (two stages of them in the pipelined
    forward kernel), then the working buffers; with `delta`, W's chunk (staged with the inputs
    in the forward kernel) and the values X = U − W S."""
    f32 = jnp.float32
    stages = None if backward else 2
    s = [mg.smem((C, C), f32, stages), mg.smem((C, M), dtype, stages)]
    s += [mg.smem((C, M), dtype, stages), mg.smem((C, V), dtype, stages)]
    s += [mg.smem((M,), f32, stages)]
    if delta and not backward:
        s += [mg.smem((C, M), dtype, stages)]
    s += [mg.smem((C, C), dtype)]
    if backward:
        s += [mg.smem((C, V), dtype), mg.smem((M, V), dtype), mg.smem((M, V), dtype)]
        s += [mg.smem((C, M), f32), mg.smem((M, V), f32), mg.smem((M,), f32)]
        s += [mg.smem((C, V), dtype)]
        if delta:
            s += [mg.smem((C, M), dtype)]
    else:
        s += [mg.smem((M, V), dtype), mg.smem((C, V), dtype), mg.smem((M, V), f32)]
    if delta:
        s += [mg.smem((C, V), dtype)]
    return s


def _call_forward(A, qs, ke, v, total, s0, w, config, keep, check_smem):
    C, V, interpret, name = config
    delta = w is not None
    B, T, H, M = qs.shape
    Dv = v.shape[-1]
    N = T // C
    dtype = v.dtype
    out_type = [
        jax.ShapeDtypeStruct((B, T, H, Dv), dtype),
        jax.ShapeDtypeStruct((B, H, M, Dv), jnp.float32),
    ]
    if keep:
        out_type.append(jax.ShapeDtypeStruct((B, H, N, M, Dv), jnp.float32))
    scratch = _scratch(C, M, V, dtype, backward=False, delta=delta)
    check_smem(scratch, "forward", C, M, dtype)
    scratch += [mg.barrier(5 + delta, stages=2), mg.barrier(1)]
    body = functools.partial(
        _forward_kernel, C=C, N=N, H=H, interpret=interpret, keep=keep, delta=delta
    )
    outs = mg.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        rows=B * H,
        tiles=Dv // V,
        interpret=interpret,
        name=f"{name}_fwd_gpu",
    )(A, qs, ke, v, total, *([w] if delta else []), s0)
    return outs[0], outs[1], (outs[2] if keep else None)


def key_decay_walk(
    A, qs, ke, v, total, s0, *, C, V, interpret, check_smem, w=None, name="linear_attention_key"
):
    """The chunk walk from the intra-chunk scores A and the decayed q and k (`key_decay_inputs`):
    `(out [B, T, H, Dv] in v's dtype, state [B, H, M, Dv] float32)`; differentiable.

    With `w` (`[B, T, H, M]` in v's dtype), the delta rule's walk (`delta/pallas_gpu.py`): v is
    U and each chunk's values are X = U − W S, the state-corrected ones, in place of v; the
    backward kernel adds dU = dX and −Wᵀ dX to dS, and XLA dW = −dX Sᵀ from the states
    entering the chunks. `name`: the kernels' names
    (`{name}_fwd_gpu`, `{name}_bwd_gpu`)."""
    return _walk(A, qs, ke, v, total, s0, w, (C, V, bool(interpret), name), check_smem)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _walk(A, qs, ke, v, total, s0, w, config, check_smem):
    o, s, _ = _call_forward(A, qs, ke, v, total, s0, w, config, False, check_smem)
    return o, s


def _walk_fwd(A, qs, ke, v, total, s0, w, config, check_smem):
    o, s, entering = _call_forward(A, qs, ke, v, total, s0, w, config, True, check_smem)
    return (o, s), (A, qs, ke, v, total, w, entering)


def _walk_bwd(config, check_smem, residuals, cotangents):
    C, V, interpret, name = config
    A, qs, ke, v, total, w, entering = residuals
    delta = w is not None
    do, ds = cotangents
    B, T, H, M = qs.shape
    Dv = v.shape[-1]
    N, NV = T // C, Dv // V
    dtype = v.dtype
    f32 = jnp.float32
    out_type = [
        jax.ShapeDtypeStruct((NV, B, H, T, C), f32),
        jax.ShapeDtypeStruct((NV, B, T, H, M), f32),
        jax.ShapeDtypeStruct((NV, B, T, H, M), f32),
        jax.ShapeDtypeStruct((B, T, H, Dv), dtype),
        jax.ShapeDtypeStruct((NV, B, H, N, M), f32),
        jax.ShapeDtypeStruct((B, H, M, Dv), f32),
    ]
    scratch = _scratch(C, M, V, dtype, backward=True, delta=delta)
    check_smem(scratch, "backward", C, M, dtype)
    scratch += [mg.barrier(7 + delta), mg.barrier(1)]
    body = functools.partial(_backward_kernel, C=C, N=N, H=H, interpret=interpret, delta=delta)
    dA, dqs, dke, dv, dtot, ds0 = mg.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        rows=B * H,
        tiles=NV,
        interpret=interpret,
        name=f"{name}_bwd_gpu",
    )(A, qs, ke, v, do.astype(dtype), total, entering, ds, *([w] if delta else []))
    return (
        jnp.sum(dA, 0),
        jnp.sum(dqs, 0).astype(qs.dtype),
        jnp.sum(dke, 0).astype(ke.dtype),
        dv,
        jnp.sum(dtot, 0),
        ds0,
        _w_cotangent(dv, entering, C).astype(w.dtype) if delta else None,
    )


def _w_cotangent(dx_BTHD, entering_BHNMD, C):
    """dW = −dX Sᵀ per chunk (S the state entering it, float32): one matmul per chunk in XLA,
    where the kernels would return a float32 share per value tile. `[B, T, H, M]` float32."""
    B, T, H, D = dx_BTHD.shape
    dx = dx_BTHD.reshape(B, T // C, C, H, D).astype(jnp.float32)
    dw = -jnp.einsum("bnchd,bhnmd->bnchm", dx, entering_BHNMD, precision=jax.lax.Precision.HIGHEST)
    return dw.reshape(B, T, H, -1)


_walk.defvjp(_walk_fwd, _walk_bwd)
